"""SGLang's native /generate and vLLM's /inference/v1/generate, on the /generate machinery.

Both bodies are translated to the vLLM /generate shape (checked and built by rl_plan, so there is
one validation and one generation path) and answered in their own shape:
- SGLang (sglang 0.5.23 `GenerateReqInput`): `{text, output_ids, meta_info: {id, finish_reason:
  {type: stop|length|abort, ...}, prompt_tokens, completion_tokens, cached_tokens, weight_version,
  output_token_logprobs: [[logprob, token_id, text|null], ...], input_token_logprobs}}`, one object
  for one prompt and n == 1, else a JSON list (sample j of prompt i at i*n + j);
- /inference/v1/generate (vllm 0.31 token-in/token-out): `{request_id, model, created, choices:
  [{index, token_ids, finish_reason, logprobs: {content: [{token: "token_id:<id>", logprob, bytes,
  top_logprobs}]} | null}], usage, prompt_logprobs, prompt_token_ids}`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from parallm.api.errors import from_validation, invalid
from parallm.api.outputs import prompt_logprobs
from parallm.api.rl_render import Gathered, Sample, lp_or_floor
from parallm.api.rl_schemas import GenerateTokensRequest, SglangGenerateRequest, SglangSampling, VllmGenerateRequest
from parallm.api.validate import unsupported

# vLLM SamplingParams fields that change nothing parallm does differently (output framing, detokenizer
# spacing, MoE routing replay); anything else not in VllmGenerateRequest is refused by name.
_TITO_IGNORED = frozenset({"output_kind", "spaces_between_special_tokens", "detokenize", "routed_experts_prompt_start",
                           "skip_clone", "extra_args"})
_TITO_FIELDS = frozenset(VllmGenerateRequest.__struct_fields__) - {"prompt", "prompt_token_ids"}
_SGLANG_REFUSED = ("json_schema", "regex", "ebnf", "structural_tag", "logit_bias", "custom_params")


def _convert(body: Any, kind: type) -> Any:
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        raise from_validation(exc) from None


def _adapter(model: str | None, base: str) -> str:
    """vLLM names a LoRA adapter by using its name as `model`; the served model (or none) is the base."""
    if not model or model == base:
        return ""
    if model.startswith(base + ":"):
        return model[len(base) + 1:]
    return model


def tito_request(raw: dict[str, Any], base: str) -> tuple[GenerateTokensRequest, VllmGenerateRequest]:
    """An /inference/v1/generate body as (itself, the vLLM /generate request it runs as)."""
    req = _convert(raw, GenerateTokensRequest)
    if req.stream:
        raise unsupported("stream is not supported on /inference/v1/generate; use /v1/completions.", "stream")
    for name in ("features", "content_parts"):
        if getattr(req, name) is not None:
            raise unsupported(f"{name} (multimodal input) is not supported by this server.", name)
    params = dict(req.sampling_params)
    unknown = sorted(set(params) - _TITO_FIELDS - _TITO_IGNORED)
    if unknown:
        raise unsupported(f"sampling_params.{unknown[0]} is not supported by this server.",
                          f"sampling_params.{unknown[0]}")
    for name in _TITO_IGNORED:
        params.pop(name, None)
    if params.get("max_tokens", 16) is None:
        params["max_tokens"] = None
    params.setdefault("max_tokens", 16)
    adapter = _adapter(req.model, base)
    body = {**params, "prompt": {"prompt_token_ids": req.token_ids}, "priority": req.priority}
    if adapter:
        body["adapter"] = adapter
    return req, _convert(body, VllmGenerateRequest)


@dataclass
class SglangNames:
    """The fields of a SGLang body that the tokenizer stage's errors about one prompt name (Job.renamed)."""

    prompts: list[str]
    images: list[list[str]]


def sglang_request(raw: dict[str, Any]) -> tuple[SglangGenerateRequest, VllmGenerateRequest, SglangNames]:
    """A SGLang /generate body as (itself, the vLLM /generate request it runs as, its fields by prompt): a
    prompt with `image_data` becomes a vLLM TokensPrompt with `multi_modal_data`."""
    req = _convert(raw, SglangGenerateRequest)
    if req.stream:
        raise unsupported("stream is not supported on SGLang's /generate here; use /v1/completions.", "stream")
    if req.input_embeds is not None:
        raise unsupported("input_embeds is not supported by this server (token ids or text, and images).",
                          "input_embeds")
    if (req.input_ids is None) == (req.text is None):
        raise invalid("Give exactly one of input_ids or text.", "input_ids")
    if req.logprob_start_len not in (-1, 0) and req.return_logprob:
        raise unsupported("logprob_start_len other than -1 is not supported (input logprobs: use "
                          "/inference/v1/generate's prompt_logprobs).", "logprob_start_len")
    sp = req.sampling_params or SglangSampling()
    for name in _SGLANG_REFUSED:
        if getattr(sp, name) is not None:
            raise unsupported(f"sampling_params.{name} is not supported by this server.", f"sampling_params.{name}")
    if req.input_ids is not None:
        ids = req.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        if any(isinstance(p, list) != batch for p in ids):
            raise invalid("input_ids must be a list of token ids or a list of such lists, not a mix.", "input_ids")
        field, listed = "input_ids", [{"prompt_token_ids": p} for p in (ids if batch else [ids])]
    else:
        batch = isinstance(req.text, list)
        field, listed = "text", [{"prompt": t} for t in (req.text if batch else [req.text])]
    images = _sglang_images(req.image_data, len(listed), batch)
    for p, each in zip(listed, images):
        if each:
            p["multi_modal_data"] = {"image": [image for _, image in each]}
    if not any(images) and field == "text":
        listed = [p["prompt"] for p in listed]  # plain strings, as before images
    prompts: Any = listed if batch else listed[0]
    names = SglangNames([f"{field}[{i}]" for i in range(len(listed))] if batch else [field],
                        [[name for name, _ in each] for each in images])
    body: dict[str, Any] = {
        "prompt": prompts, "n": sp.n, "max_tokens": sp.max_new_tokens, "min_tokens": sp.min_new_tokens,
        "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "min_p": sp.min_p,
        "repetition_penalty": sp.repetition_penalty, "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty, "stop": sp.stop, "stop_token_ids": sp.stop_token_ids,
        "ignore_eos": sp.ignore_eos, "skip_special_tokens": sp.skip_special_tokens,
        "include_stop_str_in_output": sp.no_stop_trim, "seed": sp.sampling_seed, "priority": req.priority,
        "logprobs": req.top_logprobs_num if req.return_logprob else None, "adapter": req.lora_path or "",
    }
    return req, _convert(body, VllmGenerateRequest), names


def _sglang_images(data: Any, n_prompts: int, batch: bool) -> list[list[tuple[str, Any]]]:
    """SGLang's image_data as (its field, the image) per prompt: for one prompt an image or a list of them, for a
    batch one entry per prompt (an image, a list, or null). An image is a URL, base64 text or {"url": ...}."""
    if data is None:
        return [[] for _ in range(n_prompts)]
    if batch and (not isinstance(data, list) or len(data) != n_prompts):
        raise invalid(f"image_data must hold one entry per prompt ({n_prompts}) for a batch.", "image_data")
    out = []
    for where, entry in zip([f"image_data[{i}]" for i in range(n_prompts)] if batch else ["image_data"],
                            data if batch else [data]):
        items = [] if entry is None else [(f"{where}[{k}]", x) for k, x in enumerate(entry)] \
            if isinstance(entry, list) else [(where, entry)]
        for name, image in items:
            if not isinstance(image, (str, dict)) or not image:
                raise invalid(f"{name} must be an image URL, base64 text or {{\"url\": ...}}.", name)
        out.append(items)
    return out


# --------------------------------------------------------------------------- answers

def _sglang_finish(s: Sample) -> dict[str, Any] | None:
    if s.finish_reason == "stop":
        return {"type": "stop", "matched": s.stop_reason}
    if s.finish_reason == "length":
        return {"type": "length", "length": len(s.ids)}
    if s.finish_reason is None:
        return None
    return {"type": "abort", "message": f"the request ended: {s.finish_reason}"}


def render_sglang(g: Gathered) -> Any:
    job = g.job
    items = []
    for p, group in enumerate(g.samples):
        side = g.prompts[p]
        for j, s in enumerate(group):
            meta: dict[str, Any] = {
                "id": f"{job.rid}-{p}-{j}" if len(g.samples) * job.n > 1 else job.rid,
                "finish_reason": _sglang_finish(s), "prompt_tokens": len(side.ids or []),
                "completion_tokens": len(s.ids), "cached_tokens": s.cached_tokens,
                "weight_version": str(s.versions[-1][1] if s.versions else 0), "versions": s.versions}
            if job.logprobs is not None:
                texts = s.token_texts if job.text_in_logprobs else [None] * len(s.ids)
                meta["output_token_logprobs"] = [[lp_or_floor(lp), tid, text]
                                                 for tid, lp, text in zip(s.ids, s.logprobs, texts)]
                meta["input_token_logprobs"] = []
                if job.logprobs:
                    meta["output_top_logprobs"] = [[[lp_or_floor(v), t, None] for t, v in row[:job.logprobs]]
                                                   for row in s.top]
            items.append({"text": s.text, "output_ids": s.ids, "meta_info": meta})
    return items[0] if len(items) == 1 else items


def _content(s: Sample, k: int) -> list[dict[str, Any]]:
    out = []
    for i, (tid, lp) in enumerate(zip(s.ids, s.logprobs)):
        name = f"token_id:{tid}"
        alts = (s.top[i] if i < len(s.top) else [])[:max(k, 1)]
        top = [{"token": f"token_id:{t}", "logprob": lp_or_floor(v), "bytes": None} for t, v in alts] or \
            [{"token": name, "logprob": lp_or_floor(lp), "bytes": None}]
        out.append({"token": name, "logprob": lp_or_floor(lp), "bytes": None, "top_logprobs": top})
    return out


def render_tito(g: Gathered, req: GenerateTokensRequest) -> dict[str, Any]:
    job = g.job
    [group], [side] = g.samples, g.prompts
    choices = [{"index": j, "token_ids": s.ids, "finish_reason": s.finish_reason,
                "logprobs": {"content": _content(s, job.logprobs)} if job.logprobs is not None else None,
                "routed_experts": None, "sampling_mask": None, "versions": s.versions}
               for j, s in enumerate(group)]
    completion = sum(len(s.ids) for s in group)
    prompt_tokens = len(side.ids or [])
    return {"request_id": req.request_id or job.rid, "model": job.model, "created": int(time.time()),
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion},
            "prompt_logprobs": prompt_logprobs(side.info, job.prompt_logprobs or 0)
            if job.prompt_logprobs is not None and side.info is not None else None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": side.ids if req.return_token_ids else None}
