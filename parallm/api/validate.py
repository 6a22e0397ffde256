"""Request bodies to checked Structs: JSON and type errors from msgspec, then the cross-field rules.

Everything here raises errors.APIError with OpenAI's status, type, param and code. What only the
tokenizer or engine can know (prompt length against the context, token ids against the
vocabulary) is checked there and comes back as a BackendError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from parallm.api.errors import APIError, from_decode, from_validation, invalid, model_not_found
from parallm.api.schemas import (ChatCompletionRequest, CompletionRequest, NotYetSupported, SamplingRequest,
                                 TokenizeRequest)

T = TypeVar("T")

MAX_CHOICES = 1024      # n times the number of prompts in one request
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32; larger ones are a 400, not an overflow
TEXT_PARTS = ("text", "input_text")
IMAGE_PARTS = ("image_url", "input_image")


@dataclass(frozen=True)
class Limits:
    """What validation needs to know about the server."""

    model_name: str
    max_model_len: int = 0          # 0: unknown (the tokenizer still checks the real one)
    max_output_tokens: int = 0      # largest max_tokens accepted; 0: the context length
    default_max_tokens: int = 256   # max_tokens when a request gives none
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)  # the OpenAI routes' defaults (generation_config)
    max_n: int = 64                 # samples per prompt: the engine's max_num_seqs (its rows)
    adapters: frozenset[str] = frozenset()  # loaded adapter names, also accepted as `model` (vLLM's LoRA naming)
    tool_parser: str = ""           # tool_choice auto: "" = the model's own syntax (inferred), else a parser name
    max_logprobs: int = 20          # server.max_logprobs (vLLM's --max-logprobs); -1: no cap here (the engine's: the vocabulary)
    max_constraint_bytes: int = 0   # engine.max_constraint_bytes: largest constraint text; 0: no cap here
    max_request_prompt_tokens: int = 0  # server.max_request_prompt_tokens: prompts x n one request may prefill; 0: any

    @property
    def output_cap(self) -> int:
        """Largest max_tokens accepted (0: no cap known here)."""
        return self.max_output_tokens or self.max_model_len


_decoders: dict[type, msgspec.json.Decoder] = {}


def decode(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into `kind` (unknown fields are ignored); malformed, mistyped, not UTF-8
    or nested past what the decoder allows -> 400."""
    if not body.strip():
        raise invalid("The request body is empty; expected a JSON object.", code="invalid_json")
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None
    except msgspec.DecodeError as exc:
        raise from_decode(exc) from None
    except UnicodeDecodeError:
        raise invalid("The request body is not valid UTF-8.", code="invalid_json") from None
    except RecursionError:
        raise invalid("The request body nests arrays or objects too deeply.", code="invalid_json") from None


def check_free_form(value: Any, param: str) -> None:
    """Client JSON that travels on as it is (chat_template_kwargs, tool calls): every integer must
    fit MessagePack's 64 bits, which carry it between the stages."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not -2**63 <= item < 2**64:
                raise invalid(f"{param} holds an integer outside 64 bits ({item}).", param, code="invalid_value")
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def unsupported(message: str, param: str) -> APIError:
    return invalid(message, param, code="unsupported_parameter")


def check_not_supported(req: NotYetSupported) -> None:
    """A 400 naming the first field a known client sends to change generation that is not supported yet."""
    for name in NotYetSupported.__struct_fields__:
        value = getattr(req, name)
        if value is not None and value is not False:
            raise unsupported(f"{name} is not supported by this server yet; leave it out (or null).", name)


def check_logprobs(value: int | None, param: str, limits: Limits, *, prompt: bool = False) -> None:
    """vLLM's 400 for more logprob alternatives than the server allows (SamplingParams._validate_logprobs)."""
    if value is not None and limits.max_logprobs >= 0 and value > limits.max_logprobs:
        raise invalid(f"Requested {'prompt' if prompt else 'sample'} logprobs of {value}, which is greater than max "
                      f"allowed: {limits.max_logprobs} (start the server with --server.max-logprobs {value} or -1)",
                      param, code="invalid_value")


def check_n(n: int, n_prompts: int, limits: Limits) -> None:
    if n > limits.max_n:
        raise invalid(f"n ({n}) is more than the {limits.max_n} samples this server decodes together "
                      "(engine.max_num_seqs).", "n")
    if n * n_prompts > MAX_CHOICES:
        raise invalid(f"n ({n}) times the number of prompts ({n_prompts}) is more than the "
                      f"{MAX_CHOICES} choices one request may ask for.", "n")


CHARS_PER_TOKEN_ESTIMATE = 4


def check_prompt_tokens(items: list[Any], n: int, limits: Limits) -> None:
    """One request may not ask for more prefill than server.max_request_prompt_tokens: 1,024 prompts x 2,000
    ids timed out other clients' requests for over 2 minutes on a CPU. Token-id prompts count exactly;
    text before tokenization at CHARS_PER_TOKEN_ESTIMATE characters a token."""
    cap = limits.max_request_prompt_tokens
    if not cap:
        return
    total = n * sum(len(p) if isinstance(p, list) else -(-len(p) // CHARS_PER_TOKEN_ESTIMATE) for p in items
                    if isinstance(p, (list, str)))
    if total > cap:
        raise _past_cap(total, cap)


def _past_cap(total: int, cap: int) -> APIError:
    return invalid(f"this request asks to prefill about {total} prompt tokens (its prompts times n); a request "
                   f"may ask for at most {cap} (server.max_request_prompt_tokens). Send fewer or shorter "
                   "prompts per request.", "prompt")


class _PromptOnly(msgspec.Struct):
    """A completion body's prompt left undecoded (skipped over in C: 10 ms for 6 MB) and its n."""

    prompt: msgspec.Raw = msgspec.Raw(b"")
    n: int = 1


_prompt_only = msgspec.json.Decoder(_PromptOnly)
LARGE_BODY_BYTES = 1 << 20  # a body this large may hold more ids than the cap (a token id takes >= 2 bytes)


def decode_completion(body: bytes, limits: Limits) -> CompletionRequest:
    """A completion body decoded, or a 400. A large body of token ids is first counted without decoding them: its
    ids are the commas of its prompt plus one (a prompt holding no string), and past
    server.max_request_prompt_tokens it is refused there. Decoding 1,024 x 2,000 ids took 0.07 s of the ingress's
    event loop, only for the cap to refuse them; sent back to back, every other client's request queued behind
    those decodes (issue 30's canary)."""
    cap = limits.max_request_prompt_tokens
    if cap and len(body) >= LARGE_BODY_BYTES:
        try:
            head = _prompt_only.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
            head = None  # the full decode names what is wrong
        raw = bytes(head.prompt) if head is not None else b""
        if raw.startswith(b"[") and b'"' not in raw:  # ids only (text is counted once decoded)
            total = max(1, head.n) * (raw.count(b",") + 1)
            if total > cap:
                raise _past_cap(total, cap)
    return decode(body, CompletionRequest)


def check_model(model: str | None, limits: Limits) -> None:
    if model is not None and model != limits.model_name and not model.startswith(limits.model_name + ":") \
            and model not in limits.adapters:
        raise model_not_found(model)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(s == "" for s in stops):
        raise invalid("stop strings must not be empty", "stop")
    return stops


def max_tokens(given: int | None, param: str, limits: Limits, *, zero_ok: bool = False) -> int:
    """The max_tokens to use: the request's (checked against the cap) or the server default."""
    if given is None:
        out = limits.default_max_tokens
        if limits.max_output_tokens:
            out = min(out, limits.max_output_tokens)
        if limits.max_model_len:
            out = min(out, max(1, limits.max_model_len - 1))
        return out
    if given == 0 and not zero_ok:
        raise invalid(f"{param} must be at least 1, got 0.", param, code="invalid_value")
    cap = limits.output_cap
    if cap and given > cap:
        raise invalid(f"{param} is too large: {given}. This server generates at most {cap} tokens "
                      "per request.", param, code="invalid_value")
    return given


def _check_sampling(req: SamplingRequest, limits: Limits, n_prompts: int, resolved_max: int) -> None:
    check_model(req.model, limits)
    check_not_supported(req)
    if req.stream_options is not None and not req.stream:
        raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")
    check_n(req.n, n_prompts, limits)
    check_logprobs(req.prompt_logprobs, "prompt_logprobs", limits, prompt=True)
    if req.min_tokens > resolved_max:
        raise invalid(f"min_tokens ({req.min_tokens}) must be at most max_tokens ({resolved_max}).", "min_tokens")
    bad = next((k for k in (req.logit_bias or {}) if not 0 <= k <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise invalid(f"logit_bias key {bad} is not a token id.", "logit_bias")
    stop_strings(req.stop)


def prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts of a completion request: strings or token-id lists, one per choice group. Each id's range was
    checked by the decoder (schemas.TokenId, in C); a pass over them here in Python took 0.12 s of the
    ingress's event loop for 1,024 x 2,000 ids, which server.max_request_prompt_tokens then refused anyway."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt must not be an empty list.", "prompt")
    if all(isinstance(p, int) for p in prompt):
        out: list[str | list[int]] = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        out = list(prompt)
    else:
        raise invalid("prompt must be a string, a list of strings, a list of token ids or a list of "
                      "token-id lists (not a mix).", "prompt")
    return out


def check_completion(req: CompletionRequest, limits: Limits) -> tuple[list[str | list[int]], int]:
    """(prompts, max_tokens) of a valid completion request; max_tokens 0 only with echo."""
    items = prompts(req.prompt)
    resolved = max_tokens(req.max_tokens, "max_tokens", limits, zero_ok=req.echo)
    _check_sampling(req, limits, len(items), resolved)
    check_prompt_tokens(items, req.n, limits)
    check_logprobs(req.logprobs, "logprobs", limits)
    if req.suffix:
        raise unsupported("suffix is not supported by this server.", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported("best_of is only supported when equal to n.", "best_of")
    return items, resolved


def check_chat(req: ChatCompletionRequest, limits: Limits) -> int:
    """max_tokens of a valid chat request (max_completion_tokens wins over max_tokens)."""
    if req.max_completion_tokens is not None:
        resolved = max_tokens(req.max_completion_tokens, "max_completion_tokens", limits)
    else:
        resolved = max_tokens(req.max_tokens, "max_tokens", limits)
    _check_sampling(req, limits, 1, resolved)
    check_free_form(req.tools, "tools")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise unsupported("only the 'text' modality is supported.", "modalities")
    if req.audio is not None:
        raise unsupported("audio output is not supported.", "audio")
    check_logprobs(req.top_logprobs, "top_logprobs", limits)
    if req.top_logprobs and not req.logprobs:
        raise invalid("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    check_free_form(req.chat_template_kwargs, "chat_template_kwargs")
    check_messages(req.messages, req.add_generation_prompt, req.continue_final_message)
    return resolved


def check_messages(messages: list[Any], add_generation_prompt: bool, continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:
        raise invalid("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                      "continue_final_message")
    for i, msg in enumerate(messages):
        if msg.tool_calls is not None:
            check_free_form(msg.tool_calls, f"messages[{i}].tool_calls")
        if not isinstance(msg.content, list):
            continue
        for j, part in enumerate(msg.content):
            if isinstance(part, str):
                continue
            where = f"messages[{i}].content[{j}]"
            if part.type in IMAGE_PARTS:  # fetched, decoded and checked by the tokenizer stage (parallm/vision)
                if part.image_url is None:
                    raise invalid(f"{where} has no 'image_url'.", f"{where}.image_url")
                continue
            if part.type not in TEXT_PARTS:
                raise unsupported(f"{where}: content part type {part.type!r} is not supported (parts of type "
                                  "'text', or 'image_url' for a vision-language model).", f"{where}.type")
            if part.text is None:
                raise invalid(f"{where} has no 'text'.", f"{where}.text")


def check_token_ids(ids: list[int], param: str = "tokens") -> None:
    if any(not 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise invalid(f"{param} holds a token id that is negative or past {MAX_TOKEN_ID}.", param)


def check_tokenize(req: TokenizeRequest, limits: Limits) -> None:
    check_model(req.model, limits)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("Give exactly one of prompt or messages.", "prompt")
    if req.continue_final_message:
        raise unsupported("continue_final_message is not supported by /v1/tokenize.", "continue_final_message")
    check_free_form(req.chat_template_kwargs, "chat_template_kwargs")
    if req.messages is not None:
        check_messages(req.messages, req.add_generation_prompt, False)
