"""Backend Outputs of a /generate Job to the answer in the shape it was asked in.

`Gathered` collects every Output per (prompt, sample); `render()` writes:
- vllm: `{"text": [prompt + completion], "prompt", "finish_reasons", "prompt_token_ids", "token_ids",
  "logprobs"?: [[[{token id: logprob}]]] }` — per sample, per token, a one-element list holding a dict whose
  first key is the sampled token (what Atropos reads) followed by up to `logprobs` alternatives;
- trl: `{"prompt_ids": [[...] per prompt], "completion_ids": [[...] per prompt x n], "logprobs": [[...]]}`;
- mlx_rl: `{request_id, policy_version, step_id, prompt_ids, completion_ids, text, logprobs, finish_reason,
  metadata: {batch_size, latency_ms, current_policy_version}}`.
Every shape also carries parallm's `versions` (per sample, `[[first token index, policy version], ...]`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from parallm.api.errors import APIError
from parallm.api.outputs import PromptInfo, logprob, prompt_logprobs
from parallm.api.rl_plan import Job
from parallm.protocol import Output, VersionSpans, extend_spans, unpack_floats, unpack_ids, unpack_top


@dataclass
class Sample:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    token_texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached_tokens: int = 0
    versions: VersionSpans = field(default_factory=list)

    def add(self, out: Output) -> None:
        if out.finish_reason == "error":
            raise APIError(500, "The generation failed inside the server.", code="internal_error")
        ids = unpack_ids(out.token_ids)
        if ids:
            extend_spans(self.versions, len(self.ids), out.version)
        self.ids += ids
        self.logprobs += unpack_floats(out.logprobs)
        self.top += unpack_top(out.top_ids, out.top_logprobs, len(ids))
        self.text += out.text
        self.token_texts += out.tokens
        if out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if out.usage is not None:
            self.cached_tokens = out.usage.cached_tokens


@dataclass
class PromptSide:
    ids: list[int] | None = None
    text: str | None = None
    info: PromptInfo | None = None   # prompt logprobs, when asked


class Gathered:
    """Every Output of a Job, per prompt and sample; `batch_size`/`version` for the MLX RL metadata."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.samples = [[Sample() for _ in range(job.n)] for _ in job.prompts]
        self.prompts = [PromptSide(ids=p if isinstance(p, list) else None) for p in job.prompts]
        self.batch_size = 0
        self.version = 0

    def add(self, prompt: int, out: Output, batch_size: int = 0) -> None:
        self.samples[prompt][out.index].add(out)
        side = self.prompts[prompt]
        if side.ids is None and out.prompt_ids:
            side.ids = unpack_ids(out.prompt_ids)
        if side.text is None and out.prompt_text is not None:
            side.text = out.prompt_text
        if side.info is None and out.prompt_logprobs and self.job.prompt_logprobs is not None:
            side.info = PromptInfo.of(out, self.job.prompt_logprobs)
            if side.info is not None and side.info.ids is None:
                side.info.ids = side.ids
        self.batch_size = max(self.batch_size, batch_size)
        self.version = max(self.version, out.version)

    def flat(self) -> list[Sample]:
        return [s for group in self.samples for s in group]


def lp_or_floor(value: float) -> float:
    """A logprob for JSON where a number is required: NaN and -inf are -9999.0 (vLLM's floor)."""
    v = logprob(value)
    return -9999.0 if v is None else v


_lp = lp_or_floor


def _ranked(sample: Sample, i: int, k: int) -> list[tuple[int, float]]:
    """The sampled token and up to k alternatives at position i, most likely first (vLLM's rank order)."""
    entries = {sample.ids[i]: sample.logprobs[i]}
    for alt, alt_lp in (sample.top[i] if i < len(sample.top) else [])[:k]:
        entries.setdefault(alt, alt_lp)
    return sorted(entries.items(), key=lambda e: -_lp(e[1]))


def _trl_nested(samples: list[Sample], k: int | None) -> dict[str, Any]:
    """TRL >= 0.29's answer: per sample, per token, the logprobs and token ids of the sampled token
    and k alternatives in rank order (null for both when logprobs was null)."""
    if k is None:
        return {"logprobs": None, "logprob_token_ids": None}
    ranked = [[_ranked(s, i, k) for i in range(len(s.logprobs))] for s in samples]
    return {"logprobs": [[[_lp(v) for _, v in row] for row in rows] for rows in ranked],
            "logprob_token_ids": [[[t for t, _ in row] for row in rows] for rows in ranked]}


def _atropos_prompt_logprobs(side: PromptSide, k: int) -> list[dict[str, float] | None]:
    """Per prompt position None (the first) or {token id: logprob} for the prompt's token and k
    alternatives: what Atropos' get_logprobs reads from /generate."""
    return [None if entry is None else {tid: (-9999.0 if v.logprob is None else v.logprob) for tid, v in entry.items()}
            for entry in prompt_logprobs(side.info, k)] if side.info is not None else []


def _vllm_logprobs(sample: Sample, k: int) -> list[list[dict[str, float]]]:
    out = []
    for i, (tid, lp) in enumerate(zip(sample.ids, sample.logprobs)):
        entry = {str(tid): _lp(lp)}
        for alt, alt_lp in (sample.top[i] if i < len(sample.top) else [])[:k]:
            entry.setdefault(str(alt), _lp(alt_lp))
        out.append([entry])
    return out


def render(g: Gathered) -> dict[str, Any]:
    job = g.job
    samples = g.flat()
    versions = [s.versions for s in samples]
    if job.shape == "trl":
        body = {"prompt_ids": [p.ids or [] for p in g.prompts], "completion_ids": [s.ids for s in samples],
                "logprobs": [[_lp(v) for v in s.logprobs] for s in samples],
                "finish_reasons": [s.finish_reason for s in samples], "versions": versions}
        if job.trl_nested:
            body.update(_trl_nested(samples, job.logprobs))
        return body
    if job.shape == "mlx_rl":
        req, [sample], [side] = job.req, samples, g.prompts
        return {"request_id": req.request_id, "policy_version": req.policy_version, "step_id": req.step_id,
                "prompt_ids": side.ids or [], "completion_ids": sample.ids, "text": sample.text,
                "logprobs": [_lp(v) for v in sample.logprobs] if job.logprobs is not None else None,
                "finish_reason": sample.finish_reason, "versions": sample.versions,
                "metadata": {"batch_size": g.batch_size,
                             "latency_ms": round((time.monotonic() - job.started) * 1000, 3),
                             "current_policy_version": g.version}}
    single = len(g.prompts) == 1
    prompt_texts = [p.text or "" for i, p in enumerate(g.prompts) for _ in range(job.n)]
    body: dict[str, Any] = {
        "text": [t + s.text for t, s in zip(prompt_texts, samples)],
        "prompt": g.prompts[0].text if single else [p.text for p in g.prompts],
        "finish_reasons": [s.finish_reason for s in samples],
        "prompt_token_ids": (g.prompts[0].ids or []) if single else [p.ids or [] for p in g.prompts],
        "token_ids": [s.ids for s in samples],
        "versions": versions,
    }
    if job.logprobs is not None:
        body["logprobs"] = [_vllm_logprobs(s, job.logprobs) for s in samples]
    if job.prompt_logprobs is not None:
        per_prompt = [_atropos_prompt_logprobs(p, job.prompt_logprobs) for p in g.prompts]
        body["prompt_logprobs"] = per_prompt[0] if single else per_prompt
    return body
