"""A checked /generate body (any of the three shapes in rl_schemas) to protocol TextSubmits: a `Job`.

The Job holds what building the answer needs (shape, prompts, n, how many logprob alternatives,
the request echo fields), so rl_render.py never looks at the request again.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from parallm.api.backend import BackendError
from parallm.api.errors import APIError, from_validation, invalid
from parallm.api.rl_schemas import (MlxRlGenerateRequest, RLSampling, Shape, TokensPrompt, TrlGenerateRequest,
                                    VllmGenerateRequest)
from parallm.api.structured import constraint_of
from parallm.api.translate import request_spec
from parallm.api.validate import (MAX_TOKEN_ID, Limits, check_logprobs, check_n, check_not_supported,
                                  check_prompt_tokens, max_tokens, stop_strings, unsupported)
from parallm.protocol import DetokSpec, SamplingParams, TextSubmit, pack_ids

Prompt = str | list[int]

_IMAGE_AT = re.compile(r"images\[(\d+)\]")
_REQUESTS: dict[str, type] = {"vllm": VllmGenerateRequest, "trl": TrlGenerateRequest, "mlx_rl": MlxRlGenerateRequest}
_SAMPLING_FIELDS = frozenset(RLSampling.__struct_fields__) | {"logprobs"}


@dataclass
class Job:
    """One /generate request: what goes to the backend and how to answer."""

    shape: Shape
    req: Any
    prompts: list[Prompt]
    n: int
    logprobs: int | None                 # alternatives per token when logprobs are wanted, else None
    prompt_logprobs: int | None = None   # alternatives per prompt token when prompt logprobs are wanted
    trl_nested: bool = False             # TRL >= 0.29 (it sends `logprobs`): nested logprobs + logprob_token_ids
    text_in_logprobs: bool = False       # SGLang's return_text_in_logprobs
    model: str = ""                      # the `model` the request named (echoed by /inference/v1/generate)
    rid: str = field(default_factory=lambda: "gen-" + uuid.uuid4().hex)
    submits: list[TextSubmit] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    # each prompt's field and its images' fields, as the request names them (`prompts[1]`, `images[1][0]`,
    # `prompt.multi_modal_data.image`): what the tokenizer stage's `prompt` / `images[k]` errors become
    prompt_params: list[str] = field(default_factory=list)
    image_params: list[list[str]] = field(default_factory=list)

    def renamed(self, exc: BaseException) -> BaseException:
        """The tokenizer stage's error about one prompt (it names the prompt `prompt` and its images
        `images[k]`) naming the field of this request instead."""
        if not isinstance(exc, BackendError) or exc.prompt is None or exc.prompt >= len(self.prompt_params):
            return exc
        images = self.image_params[exc.prompt]
        if exc.param == "prompt":
            exc.param = self.prompt_params[exc.prompt]
        elif (at := _IMAGE_AT.match(exc.param or "")) is not None and int(at[1]) < len(images):
            name = images[int(at[1])]
            exc.message = exc.message.replace(at[0], name, 1)
            exc.param = name + exc.param[at.end():]
        return exc

    @property
    def metadata(self) -> dict[str, Any]:
        """Client metadata that travels with the request (rollout subscribers see it)."""
        meta: dict[str, Any] = {"request_id": self.rid, "api": f"generate:{self.shape}"}
        if self.shape == "mlx_rl":
            for name in ("policy_version", "step_id", "request_id"):
                value = getattr(self.req, name)
                if value is not None:
                    meta["client_" + name if name == "request_id" else name] = value
        return meta


def parse(shape: Shape, body: dict[str, Any]) -> Any:
    """The body as the request struct of its shape (type and range errors -> 400 naming the field)."""
    if shape == "trl" and isinstance(body.get("generation_kwargs"), dict):
        extra = body["generation_kwargs"]
        unknown = sorted(set(extra) - _SAMPLING_FIELDS)
        if unknown:
            raise unsupported(f"generation_kwargs {unknown} are not supported by this server.", "generation_kwargs")
        body = {**body, **extra}  # vLLM: SamplingParams(**generation_kwargs) wins over the named fields
    try:
        return msgspec.convert(body, _REQUESTS[shape])
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None


def _ids(value: list[int], param: str) -> list[int]:
    if not value:
        raise invalid(f"{param} must not be an empty list of token ids.", param)
    bad = next((t for t in value if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise invalid(f"{param} has a token id that is negative or past {MAX_TOKEN_ID} ({bad}).", param)
    return list(value)


def _tokens_prompt(p: TokensPrompt, param: str) -> Prompt:
    if (p.prompt_token_ids is None) == (p.prompt is None):
        raise invalid(f"{param} must have exactly one of prompt_token_ids or prompt.", param)
    return _ids(p.prompt_token_ids, f"{param}.prompt_token_ids") if p.prompt is None else p.prompt


def prompts_of(shape: Shape, req: Any) -> list[Prompt]:
    if shape == "trl":
        return [p if isinstance(p, str) else _ids(p, f"prompts[{i}]") for i, p in enumerate(req.prompts)]
    if shape == "mlx_rl":
        return [req.prompt if isinstance(req.prompt, str) else _ids(req.prompt, "prompt")]
    if req.prompt_token_ids is not None:
        if req.prompt is not None:
            raise invalid("Give prompt or prompt_token_ids, not both.", "prompt_token_ids")
        return [_ids(req.prompt_token_ids, "prompt_token_ids")]
    if req.prompt is None:
        raise APIError(400, "Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    if isinstance(req.prompt, str):
        return [req.prompt]
    if isinstance(req.prompt, TokensPrompt):
        return [_tokens_prompt(req.prompt, "prompt")]
    if not req.prompt:
        raise invalid("prompt must not be an empty list.", "prompt")
    return [p if isinstance(p, str) else _tokens_prompt(p, f"prompt[{i}]") for i, p in enumerate(req.prompt)]


def _check(shape: Shape, req: Any, n_prompts: int, limits: Limits) -> None:
    check_not_supported(req)
    if req.stream:
        raise unsupported("stream is not supported on /generate; use /v1/completions with stream=true.", "stream")
    check_n(req.n, n_prompts, limits)
    check_logprobs(_logprobs(shape, req), "logprobs", limits)
    check_logprobs(getattr(req, "prompt_logprobs", None), "prompt_logprobs", limits, prompt=True)
    if shape == "trl" and req.images is not None and len(req.images) != n_prompts:
        raise invalid(f"images must hold one entry per prompt ({n_prompts}), got {len(req.images)}.", "images")
    if shape == "mlx_rl" and req.n != 1:
        raise invalid("the MLX RL shape returns one completion; send n=1 (or use the vLLM/TRL shapes).", "n")


def _logprobs(shape: Shape, req: Any) -> int | None:
    if shape == "trl":
        return req.logprobs           # TRL reads the sampled token's logprob (>= 0.29: and k alternatives)
    if shape == "mlx_rl":
        return 0 if req.logprobs else None
    return req.logprobs               # vLLM: None = no logprobs; k = the sampled token and k alternatives


def build(shape: Shape, req: Any, limits: Limits, answer: Shape | None = None) -> Job:
    """Check a parsed request and build its Job (raises APIError); `answer`: the shape to answer in
    when the request was translated to `shape` (SGLang's and /inference/v1/generate's bodies are
    checked as vLLM ones)."""
    prompts = prompts_of(shape, req)
    _check(shape, req, len(prompts), limits)
    check_prompt_tokens(prompts, req.n, limits)
    if shape == "trl" and req.truncate_prompt_tokens:
        prompts = [p[-req.truncate_prompt_tokens:] if isinstance(p, list) else p for p in prompts]
    resolved = max_tokens(req.max_tokens, "max_tokens", limits)
    if req.min_tokens > resolved:
        raise invalid(f"min_tokens ({req.min_tokens}) must be at most max_tokens ({resolved}).", "min_tokens")
    job = Job(answer or shape, req, prompts, req.n, _logprobs(shape, req),
              prompt_logprobs=getattr(req, "prompt_logprobs", None))
    params = SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k), min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, seed=req.seed, max_tokens=resolved, min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        logprobs=job.logprobs is not None, top_logprobs=job.logprobs or 0, prompt_logprobs=job.prompt_logprobs,
        constraint=constraint_of(req, max_bytes=limits.max_constraint_bytes))
    detok = DetokSpec(stop=stop_strings(req.stop), include_stop_str=req.include_stop_str_in_output,
                      skip_special_tokens=req.skip_special_tokens, echo=True)
    spec = request_spec(req, params, detok, adapter=req.adapter, metadata=job.metadata)
    images = images_of(shape, req, len(prompts))
    job.prompt_params = prompt_params(shape, req, len(prompts))
    job.image_params = [[param for param, _ in each] for each in images]
    for i, prompt in enumerate(prompts):
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, pack_ids(prompt))
        job.submits.append(TextSubmit(rid=job.rid if len(prompts) == 1 else f"{job.rid}-{i}", reply_to=b"", spec=spec,
                                      prompt=text, prompt_ids=ids, images=[url for _, url in images[i]]))
    return job


def prompt_params(shape: Shape, req: Any, n_prompts: int) -> list[str]:
    """The field each prompt came in."""
    if shape == "trl":
        return [f"prompts[{i}]" for i in range(n_prompts)]
    if shape == "vllm" and req.prompt is None:
        return ["prompt_token_ids"]
    if shape == "vllm" and isinstance(req.prompt, list):
        return [f"prompt[{i}]" for i in range(n_prompts)]
    return ["prompt"] * n_prompts


def images_of(shape: Shape, req: Any, n_prompts: int) -> list[list[tuple[str, str]]]:
    """Each prompt's images as (the field it came in, its URL): TRL's `images` (one entry per prompt: an
    image, a list, or null) or vLLM's TokensPrompt `multi_modal_data={"image": ...}`; the tokenizer stage
    fetches and checks them."""
    if shape == "trl":
        entries = req.images if req.images is not None else [None] * n_prompts
        return [_urls(e, f"images[{i}]") for i, e in enumerate(entries)]
    if shape != "vllm" or req.prompt is None:
        return [[] for _ in range(n_prompts)]
    listed = req.prompt if isinstance(req.prompt, list) else [req.prompt]
    out = []
    for i, p in enumerate(listed):
        data = p.multi_modal_data if isinstance(p, TokensPrompt) else None
        where = f"prompt[{i}].multi_modal_data" if isinstance(req.prompt, list) else "prompt.multi_modal_data"
        if data is not None and set(data) - {"image"}:
            raise unsupported(f"{where} holds {', '.join(sorted(set(data) - {'image'}))}; only images are served.", where)
        out.append(_urls(None if data is None else data.get("image"), f"{where}.image"))
    return out


def _urls(entry: Any, param: str) -> list[tuple[str, str]]:
    from parallm.vision.inputs import as_image_url
    from parallm.vision.fetch import ImageError

    if entry is None:
        return []
    named = [(f"{param}[{k}]", x) for k, x in enumerate(entry)] if isinstance(entry, list) else [(param, entry)]
    out = []
    for where, x in named:
        try:
            out.append((where, as_image_url(x)))
        except ImageError as exc:
            raise invalid(f"{where}: {exc.message}", where) from None
    return out
