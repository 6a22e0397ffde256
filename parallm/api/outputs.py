"""Backend Outputs to OpenAI response parts: unpacking, logprob shapes, usage, whole responses.

`Piece` is what one Output adds to one choice; `PromptInfo` is the prompt side (echo text,
ids, prompt logprobs) that arrives on the first Output of a sequence. `Collector` gathers a
whole non-streamed response; sse.py builds chunks from the same pieces.

Logprob shapes (OpenAI's documented ones):
- completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`; the
  sampled token is always in its `top_logprobs` dict (so up to logprobs+1 entries, as OpenAI
  documents); with echo the prompt comes first, its first token's logprob and top being null.
- chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal}`.
A logprob of -inf (a token the sampler could not pick) is reported as -9999.0, like vLLM, since
JSON has no infinity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parallm.api.errors import APIError
from parallm.api.schemas import (AssistantMessage, ChatChoice, ChatCompletionResponse, ChatLogprobs,
                                 CompletionChoice, CompletionLogprobs, CompletionResponse, PromptLogprob,
                                 PromptLogprobs, PromptTokensDetails, TokenLogprob, TopLogprob, UsageInfo)
from parallm.api.structured import tool_message
from parallm.api.translate import Plan
from parallm.protocol import Output, Usage, unpack_floats, unpack_ids, unpack_top
from parallm.text.vocab import token_string_bytes

MIN_LOGPROB = -9999.0

Alt = tuple[int, str, float]  # an alternative: token id, token string, logprob


def logprob(value: float) -> float | None:
    """A logprob fit for JSON: NaN (no value) -> None, -inf -> -9999.0."""
    return None if math.isnan(value) else max(value, MIN_LOGPROB)


def _strings(given: list[str], ids: list[int]) -> list[str]:
    return given if len(given) == len(ids) else [f"token_id:{i}" for i in ids]


def _id_names(row: list[Alt]) -> list[Alt]:
    return [(t, f"token_id:{t}", lp) for t, _, lp in row]


def _rows(ids: bytes, lps: bytes, strings: list[str], rows: int) -> list[list[Alt]]:
    """Row-major top-k (ids, logprobs, strings) as `rows` lists of alternatives."""
    top = unpack_top(ids, lps, rows)
    if not top:
        return [[] for _ in range(rows)]
    names = iter(_strings(strings, [t for row in top for t, _ in row]))
    return [[(t, next(names), lp) for t, lp in row] for row in top]


@dataclass
class PromptInfo:
    """The prompt side of a sequence: echo text, ids, and prompt logprobs (the first token's None)."""

    text: str | None = None
    ids: list[int] | None = None
    logprobs: list[float | None] | None = None   # one per prompt token
    tokens: list[str] | None = None
    top: list[list[Alt] | None] | None = None    # per prompt token
    ranks: list[int | None] | None = None        # per prompt token: vLLM's rank (1 = the most likely)

    @classmethod
    def of(cls, out: Output, top_k: int) -> "PromptInfo | None":
        """From the first Output of a sequence; `top_k`: alternatives asked per prompt token."""
        if out.prompt_text is None and not out.prompt_ids and not out.prompt_logprobs:
            return None
        ids = unpack_ids(out.prompt_ids) if out.prompt_ids else None
        info = cls(text=out.prompt_text, ids=ids)
        if out.prompt_logprobs:
            lps: list[float | None] = [logprob(v) for v in unpack_floats(out.prompt_logprobs)]
            size = len(ids) if ids is not None else max(len(out.prompt_tokens), len(lps))
            info.logprobs = ([None] * (size - len(lps)) + lps)[-size:]
            info.logprobs[0] = None
            info.tokens = out.prompt_tokens if len(out.prompt_tokens) == size else \
                _strings([], ids) if ids is not None else [""] * size
            rows = len(out.prompt_top_ids) // 4 // top_k if top_k else 0
            top: list[list[Alt] | None] = list(_rows(out.prompt_top_ids, out.prompt_top_logprobs,
                                                     out.prompt_top_tokens, rows))
            info.top = ([None] * (size - rows) + top)[-size:]
            info.top[0] = None
            if out.prompt_ranks:
                ranks: list[int | None] = [r or None for r in unpack_ids(out.prompt_ranks)]
                info.ranks = ([None] * (size - len(ranks)) + ranks)[-size:]
                info.ranks[0] = None
        return info

    def as_token_ids(self) -> None:
        """vLLM's return_tokens_as_token_ids: every token string becomes "token_id:<id>"."""
        if self.ids is not None and self.tokens is not None:
            self.tokens = _strings([], self.ids)
        if self.top is not None:
            self.top = [None if row is None else _id_names(row) for row in self.top]

    def merge(self, other: "PromptInfo") -> None:
        """Fill what this one lacks from another sequence's (sample 0 alone carries logprobs)."""
        for name in ("text", "ids", "logprobs", "tokens", "top", "ranks"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(other, name))


@dataclass
class Piece:
    """What one Output adds to one choice."""

    text: str
    ids: list[int]
    logprobs: list[float]
    tokens: list[str]
    top: list[list[Alt]]
    finish_reason: str | None
    stop_reason: int | str | None
    prompt: PromptInfo | None
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    tool_call_deltas: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, out: Output, prompt_top_k: int = 0, echo_only: bool = False, as_ids: bool = False) -> "Piece":
        if out.finish_reason == "error":
            raise APIError(500, "The generation failed inside the server.", code="internal_error")
        ids = unpack_ids(out.token_ids)
        lps = unpack_floats(out.logprobs)
        piece = cls(out.text, ids, lps, _strings(out.tokens, ids) if lps else [],
                    _rows(out.top_ids, out.top_logprobs, out.top_tokens, len(ids)) if lps else [],
                    out.finish_reason, out.stop_reason, PromptInfo.of(out, prompt_top_k), out.reasoning,
                    list(out.tool_calls), list(out.tool_call_deltas))
        if as_ids:
            piece.tokens = _strings([], ids) if lps else []
            piece.top = [_id_names(row) for row in piece.top]
            if piece.prompt is not None:
                piece.prompt.as_token_ids()
        if echo_only:  # max_tokens=0 with echo: one token was generated only to get the prompt's logprobs
            piece.text, piece.ids, piece.logprobs, piece.tokens, piece.top = "", [], [], [], []
            if piece.finish_reason is not None:
                piece.finish_reason, piece.stop_reason = "length", None
        return piece


# --------------------------------------------------------------------------- logprob shapes

def add_completion_logprobs(into: CompletionLogprobs, tokens: list[str], lps: list[float | None] | list[float],
                            tops: list[list[Alt]] | list[list[Alt] | None], k: int, offset: int) -> int:
    """Append tokens to a completions logprobs object; returns the text offset after them."""
    for token, lp, alts in zip(tokens, lps, tops):
        into.tokens.append(token)
        into.text_offset.append(offset)
        offset += len(token)
        value = None if lp is None else logprob(lp)
        into.token_logprobs.append(value)
        if value is None:
            into.top_logprobs.append(None)
            continue
        top = {name: _chat_lp(v) for _, name, v in (alts or [])[:k]}
        top.setdefault(token, value)  # OpenAI: the sampled token is always listed
        into.top_logprobs.append(top)
    return offset


def _chat_lp(value: float) -> float:
    lp = logprob(value)
    return MIN_LOGPROB if lp is None else lp


def chat_logprobs(tokens: list[str], lps: list[float], tops: list[list[Alt]], k: int) -> list[TokenLogprob]:
    return [TokenLogprob(token=token, logprob=_chat_lp(lp), bytes=token_string_bytes(token),
                         top_logprobs=[TopLogprob(token=name, logprob=_chat_lp(v), bytes=token_string_bytes(name))
                                       for _, name, v in alts[:k]])
            for token, lp, alts in zip(tokens, lps, tops)]


def prompt_logprobs(info: PromptInfo, k: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's own token (its rank: how many tokens are at least as likely) and
    its k most likely alternatives (ranks 1..k), as vLLM's gather_logprobs."""
    out: PromptLogprobs = []
    for i, lp in enumerate(info.logprobs or []):
        if lp is None:
            out.append(None)
            continue
        entry: dict[str, PromptLogprob] = {}
        if info.ids is not None and info.tokens is not None:
            entry[str(info.ids[i])] = PromptLogprob(logprob=lp, rank=info.ranks[i] if info.ranks else None,
                                                    decoded_token=info.tokens[i])
        for rank, (tid, name, v) in enumerate(((info.top or [])[i] or [])[:k], start=1):
            entry.setdefault(str(tid), PromptLogprob(logprob=logprob(v), rank=rank, decoded_token=name))
        out.append(entry)
    return out


# --------------------------------------------------------------------------- per choice and request

@dataclass
class ChoiceState:
    index: int
    prompt: int                        # which prompt of the request
    keep: bool = True                  # keep text and tokens (a whole response); streams only count
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    top: list[list[Alt]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None
    num_tokens: int = 0
    offset: int = 0                    # text offset for completions logprobs (streams)
    started: bool = False              # something was sent for it (streams)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)  # parsed from the model's own syntax (tool_choice auto)

    def add(self, piece: Piece) -> None:
        self.num_tokens += len(piece.ids)
        if piece.finish_reason is not None:
            self.finish_reason, self.stop_reason = piece.finish_reason, piece.stop_reason
        self.tool_calls += piece.tool_calls  # streams number them by this count
        if self.keep:
            self.reasoning.append(piece.reasoning)
            self.texts.append(piece.text)
            self.ids += piece.ids
            self.logprobs += piece.logprobs
            self.tokens += piece.tokens
            self.top += piece.top


class Collector:
    """Gathers a request's Outputs: per-choice state, the prompts, and exact usage."""

    def __init__(self, plan: Plan, keep: bool = True) -> None:
        self.plan = plan
        self.keep = keep
        self.choices: dict[int, ChoiceState] = {}
        self.prompts: dict[int, PromptInfo] = {}
        self.prompt_top_k = plan.submits[0].spec.params.prompt_logprobs or 0 if plan.submits else 0

    def choice(self, prompt: int, index: int) -> ChoiceState:
        key = prompt * self.plan.n + index
        state = self.choices.get(key)
        if state is None:
            state = self.choices[key] = ChoiceState(key, prompt, self.keep)
        return state

    def add(self, prompt: int, out: Output) -> tuple[ChoiceState, Piece]:
        piece = Piece.of(out, self.prompt_top_k, self.plan.echo_only, self.plan.tokens_as_ids)
        state = self.choice(prompt, out.index)
        state.add(piece)
        if out.usage is not None:
            state.usage = out.usage
        if piece.prompt is not None:
            known = self.prompts.get(prompt)
            if known is None:
                self.prompts[prompt] = piece.prompt
            else:
                known.merge(piece.prompt)
        return state, piece

    def usage(self) -> UsageInfo:
        """Prompt tokens once per prompt, completion tokens summed over every choice."""
        prompt_tokens = cached = completion = 0
        for p in range(len(self.plan.submits)):
            states = [s for s in self.choices.values() if s.prompt == p]
            usages = [s.usage for s in states if s.usage is not None]
            info = self.prompts.get(p)
            fallback = len(info.ids) if info is not None and info.ids is not None else 0
            prompt_tokens += max((u.prompt_tokens for u in usages), default=fallback)
            cached += max((u.cached_tokens for u in usages), default=0)
            if not self.plan.echo_only:
                completion += sum(s.usage.completion_tokens if s.usage is not None else s.num_tokens
                                  for s in states)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                         total_tokens=prompt_tokens + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def _states(self) -> list[ChoiceState]:
        return [self.choices.get(i) or ChoiceState(i, i // self.plan.n, finish_reason="abort")
                for i in range(self.plan.num_choices)]

    # ------------------------------------------------------------------ whole responses

    def completion(self) -> CompletionResponse:
        plan = self.plan
        choices = []
        for s in self._states():
            info = self.prompts.get(s.prompt)
            text = "".join(s.texts)
            lp = None
            if plan.logprobs is not None:
                lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
                offset = 0
                if plan.echo and info is not None and info.logprobs is not None:
                    offset = add_completion_logprobs(lp, info.tokens or [], info.logprobs, info.top or [],
                                                     plan.logprobs, 0)
                add_completion_logprobs(lp, s.tokens, s.logprobs, s.top, plan.logprobs, offset)
            if plan.echo and info is not None and info.text is not None:
                text = info.text + text
            choice = CompletionChoice(index=s.index, text=text, logprobs=lp, finish_reason=s.finish_reason,
                                      stop_reason=s.stop_reason)  # type: ignore[arg-type]
            self._extras(choice, s, info)
            choices.append(choice)
        return CompletionResponse(id=plan.id, created=plan.created, model=plan.model,
                                  system_fingerprint=plan.fingerprint, choices=choices, usage=self.usage())

    def _extras(self, choice: CompletionChoice, s: ChoiceState, info: PromptInfo | None) -> None:
        if self.plan.return_token_ids:
            choice.token_ids = s.ids
            choice.prompt_token_ids = info.ids or [] if info is not None else []
        if self.plan.prompt_logprobs is not None and info is not None and info.logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs(info, self.plan.prompt_logprobs)

    def chat(self) -> ChatCompletionResponse:
        plan = self.plan
        choices = []
        for s in self._states():
            lp = None
            if plan.logprobs is not None:
                lp = ChatLogprobs(content=chat_logprobs(s.tokens, s.logprobs, s.top, plan.logprobs))
            content, calls, finish = tool_message(plan.tools, "".join(s.texts), s.finish_reason)
            if s.tool_calls:  # the model's own syntax, parsed by the detokenizer
                calls, finish = s.tool_calls, "tool_calls" if finish == "stop" else finish
                content = content or None
            message = AssistantMessage(content=content)
            if calls is not None:
                message.tool_calls = calls
            reasoning = "".join(s.reasoning)
            if reasoning:
                message.reasoning = message.reasoning_content = reasoning
            choice = ChatChoice(index=s.index, message=message, logprobs=lp,
                                finish_reason=finish, stop_reason=s.stop_reason)  # type: ignore[arg-type]
            if plan.return_token_ids:
                choice.token_ids = s.ids
            choices.append(choice)
        response = ChatCompletionResponse(id=plan.id, created=plan.created, model=plan.model,
                                          system_fingerprint=plan.fingerprint, choices=choices, usage=self.usage())
        info = self.prompts.get(0)
        if plan.return_token_ids:
            response.prompt_token_ids = info.ids if info is not None else None
        if plan.prompt_logprobs is not None and info is not None and info.logprobs is not None:
            response.prompt_logprobs = prompt_logprobs(info, plan.prompt_logprobs)
        return response
