"""The tokenizer stage's logic: prompts, chat templates and prompt-length checks, to token ids.

Errors are `TemplateError`s carrying an OpenAI-style message, the offending parameter and an
HTTP status, so the stage can answer with a RequestError without knowing what went wrong.
Messages follow vLLM's wording where vLLM has one, since clients match on them.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from parallm.protocol import Detokenize, RequestError, TextSubmit, Tokenize, unpack_ids
from parallm.text.vocab import TokenizerLike, TokenizerView

# Arguments of apply_chat_template that chat_template_kwargs must not override.
_RESERVED_KWARGS = frozenset({
    "conversation", "tokenize", "chat_template", "add_generation_prompt", "continue_final_message",
    "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "return_assistant_tokens_mask"})
_TEXT_PARTS = ("text", "input_text")
_IMAGE_PARTS = ("image_url", "input_image", "image")


class TemplateError(ValueError):
    """A request the tokenizer stage refuses: an OpenAI-style error for the client."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def to_error(self, rid: str, reply_to: bytes = b"") -> RequestError:
        return RequestError(rid=rid, reply_to=reply_to, status=self.status, code=self.code,
                            message=self.message, param=self.param)


def content_text(content: Any, where: str, image_token: str | None = None,
                 text_only: str = "this model takes text only") -> str | None:
    """A message's content as a string: OpenAI content-part lists joined with newlines (as vLLM); an
    image part is the model's `image_token` (None: refused with `text_only`, the reason)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TemplateError(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in _TEXT_PARTS:
            raise TemplateError(f"{where}[{j}] has no 'text' string", f"{where}[{j}].text")
        elif kind in _IMAGE_PARTS and image_token is not None:
            texts.append(image_token)
        elif kind in _IMAGE_PARTS:
            raise TemplateError(f"{where}[{j}]: content part type {kind!r} is not supported: {text_only}",
                                f"{where}[{j}].type")
        else:
            raise TemplateError(f"{where}[{j}]: content part type {kind!r} is not supported; this model "
                                "takes text only (parts of type 'text')", f"{where}[{j}].type")
    return "\n".join(texts)


def normalize_messages(messages: Sequence[Any], image_token: str | None = None,
                       text_only: str = "this model takes text only") -> list[dict[str, Any]]:
    """Copies of the messages that chat templates expect: string content, tool-call arguments as
    dicts (templates apply `tojson` to them; OpenAI sends them as JSON strings)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TemplateError("messages must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise TemplateError(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}].role")
        msg = dict(msg)
        if "content" in msg:
            msg["content"] = content_text(msg["content"], f"messages[{i}].content", image_token, text_only)
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_parse_arguments(call) for call in msg["tool_calls"]]
        out.append(msg)
    return out


def _parse_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


PROBE_CHARS_PER_TOKEN = 8  # a prompt longer than this many characters per allowed token has a first slice tokenized


class Templater:
    """Turns TextSubmit / Tokenize / Detokenize requests into ids or text, checking them."""

    def __init__(self, tokenizer: TokenizerLike, max_model_len: int, vocab_size: int | None = None) -> None:
        self.tok = TokenizerView.of(tokenizer)
        self.max_model_len = max_model_len
        self.vocab_size = self.tok.vocab_size if vocab_size is None else vocab_size
        self.image_token: str | None = None  # a vision-language model's: what an image part renders as
        self.text_only = "this model takes text only"  # why image parts are refused otherwise

    # ------------------------------------------------------------------ requests

    def encode(self, req: TextSubmit) -> list[int]:
        """The prompt ids for a request, checked against the vocabulary and the context length."""
        given = [name for name in ("prompt", "messages", "prompt_ids") if getattr(req, name) is not None]
        if len(given) != 1:
            raise TemplateError("give exactly one of prompt, messages or prompt_ids"
                                + (f" (got {', '.join(given)})" if given else ""), "prompt")
        if req.messages is not None:
            param = "messages"
            text = self.render(req.messages, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               chat_template_kwargs=req.chat_template_kwargs)
            ids = self.encode_bounded(text, req.add_special_tokens, req.spec.params.max_tokens, param)
        elif req.prompt is not None:
            param = "prompt"
            ids = self.encode_bounded(req.prompt, req.add_special_tokens, req.spec.params.max_tokens, param)
        else:
            param = "prompt"
            ids = self.check_ids(unpack_ids(req.prompt_ids or b""), param)
        if not ids:
            raise TemplateError("The decoder prompt cannot be empty", param)
        self.check_length(len(ids), req.spec.params.max_tokens, param)
        return ids

    def encode_bounded(self, text: str, add_special_tokens: bool, max_tokens: int | None, param: str) -> list[int]:
        """The ids of a prompt, refused before tokenizing it whole when it surely does not fit the context:
        longer than max_model_len x the longest token (x2 for normalizers), or a first slice of it alone
        (PROBE_CHARS_PER_TOKEN characters per allowed token) already past max_model_len. An 8 MB prompt
        was tokenized whole (4-7.5 s of this stage's loop, everyone's requests waiting) before its 400."""
        n = self.max_model_len
        if n and len(text) > 2 * n * self.tok.longest_token_chars:
            self.check_length(len(text) // (2 * self.tok.longest_token_chars), max_tokens, param, at_least=True)
        if n and len(text) > n * PROBE_CHARS_PER_TOKEN:
            probe = len(self.tok.encode(text[:n * PROBE_CHARS_PER_TOKEN], add_special_tokens=False))
            if probe - 1 >= n:  # the cut may split one token in two
                self.check_length(probe - 1, max_tokens, param, at_least=True)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    def tokenize(self, req: Tokenize) -> list[int]:
        """/v1/tokenize: a prompt or chat messages to ids (no length check, as vLLM)."""
        if (req.prompt is None) == (req.messages is None):
            raise TemplateError("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            text = self.render(req.messages, add_generation_prompt=req.add_generation_prompt,
                               chat_template_kwargs=req.chat_template_kwargs)
            return self.tok.encode(text, add_special_tokens=req.add_special_tokens)
        return self.tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)

    def detokenize(self, req: Detokenize) -> str:
        """/v1/detokenize: ids (checked) to text."""
        ids = self.check_ids(unpack_ids(req.ids), "tokens")
        return self.tok.decode(ids, skip_special_tokens=req.skip_special_tokens)

    # ------------------------------------------------------------------ parts

    def render(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False,
               chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template applied to the messages, as text (special tokens written out)."""
        if self.tok.hf is None or not self.tok.chat_template:
            raise TemplateError("This model has no chat template, so chat messages cannot be used; "
                                "send a plain prompt to /v1/completions instead", "messages")
        if add_generation_prompt and continue_final_message:
            raise TemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` "
                                "to True.", "continue_final_message")
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_KWARGS.intersection(kwargs))
        if reserved:
            raise TemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                "chat_template_kwargs")
        conversation = normalize_messages(messages, self.image_token, self.text_only)
        try:
            text = self.tok.hf.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)
        except Exception as exc:  # a template raising on these messages is the request's fault
            raise TemplateError(f"The chat template could not be applied to these messages: {exc}",
                                "messages") from None
        if not isinstance(text, str):
            raise TemplateError("The chat template did not produce text", "messages", status=500,
                                code="internal_error")
        return text

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        """Ids must be in [0, vocab_size)."""
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise TemplateError(f"Token id {bad} is out of vocabulary (the vocabulary has "
                                f"{self.vocab_size} tokens)", param)
        return ids

    def check_length(self, prompt_tokens: int, max_tokens: int | None, param: str = "messages", *,
                     at_least: bool = False) -> None:
        """vLLM's context-length check: prompt + max_tokens must fit in max_model_len (`at_least`: the
        prompt has at least `prompt_tokens` tokens; it was not tokenized whole)."""
        n = self.max_model_len
        some = "at least " if at_least else ""
        if max_tokens is None:
            if prompt_tokens >= n:
                raise TemplateError(
                    f"This model's maximum context length is {n} tokens. However, you requested "
                    f"{some}{prompt_tokens} tokens in the messages, Please reduce the length of the messages.",
                    param)
        elif prompt_tokens + max_tokens > n:
            raise TemplateError(
                f"This model's maximum context length is {n} tokens. However, you requested "
                f"{some}{prompt_tokens + max_tokens} tokens ({some}{prompt_tokens} in the messages, {max_tokens} in "
                f"the completion). Please reduce the length of the messages or completion.",
                param)
