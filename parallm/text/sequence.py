"""Detokenizer-side state of one sequence (rid, index): engine deltas in, client outputs out.

Semantics follow vLLM's output processor:
- A stop *token* (eos or one of stop_token_ids; the engine ends the sequence with finish_reason
  "stop") stays in token_ids and in usage, but its text is not emitted unless include_stop_str.
- A stop *string* is found here, not in the engine: the text is cut before it (or after it with
  include_stop_str), finish_reason becomes "stop" and stop_reason the string, the tokens after
  the one that completed it are dropped (from ids, logprobs and usage), and `needs_abort` tells
  the stage to abort the sequence in the engine, which is still generating it.
- Deltas that arrive after the sequence finished here (the engine ran ahead) are ignored.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from parallm.protocol import (DetokSpec, Output, Rollout, SeqDelta, Track, Usage, VersionSpans, extend_spans, pack_ids,
                              unpack_ids)
from parallm.text.assistant import AssistantSplitter, Split, kept_special_ids, splitter_for
from parallm.text.detokenize import IncrementalDetokenizer
from parallm.text.stop import StopStringMatcher
from parallm.text.vocab import TokenizerLike, TokenizerView

_I32 = 4  # bytes per packed id or float


class DetokState:
    """One sequence's text state; `update()` per engine delta, `rollout()` once finished.

    With `spec=None` (a raw token-id request) no text is produced: ids and logprobs pass through.
    """

    def __init__(self, tokenizer: TokenizerLike, rid: str, index: int = 0,
                 prompt_ids: Sequence[int] = (), spec: DetokSpec | None = None, *,
                 adapter: str = "", submitted_at: float = 0.0, stop_token_ids: Sequence[int] = (),
                 min_tokens: int = 0, metadata: dict[str, Any] | None = None) -> None:
        self.tok = TokenizerView.of(tokenizer)
        self.rid, self.index, self.spec = rid, index, spec
        self.prompt_ids = list(prompt_ids)
        self.adapter, self.submitted_at = adapter, submitted_at
        self.metadata = metadata or {}
        self.stop_token_ids = frozenset(stop_token_ids)
        self.min_tokens = min_tokens
        self._split: AssistantSplitter | None = splitter_for(self.tok, spec, self.prompt_ids) \
            if spec is not None and spec.assistant else None
        self._detok = None if spec is None else IncrementalDetokenizer(
            self.tok, self.prompt_ids, spec.skip_special_tokens,
            kept_special_ids(self.tok, self._split) if self._split is not None else frozenset())
        self._stop = StopStringMatcher(spec.stop, spec.include_stop_str) if spec and spec.stop else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.needs_abort = False
        self.num_tokens = 0                      # tokens kept (sent to the client)
        self.versions: VersionSpans = []
        self.first_token_at = 0.0
        self.finished_at = 0.0
        self._ids = bytearray()
        self._logprobs = bytearray()
        self._text: list[str] = []
        self._cached_tokens = 0
        self._sent_prompt = False

    @classmethod
    def from_track(cls, tokenizer: TokenizerLike, track: Track, index: int = 0) -> "DetokState":
        spec = track.spec
        return cls(tokenizer, track.rid, index, unpack_ids(track.prompt_ids), spec.detok, adapter=spec.adapter,
                   submitted_at=spec.submitted_at, metadata=spec.metadata, stop_token_ids=spec.params.stop_token_ids,
                   min_tokens=spec.params.min_tokens)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text)

    # ------------------------------------------------------------------ per step

    def update(self, delta: SeqDelta, now: float | None = None) -> Output | None:
        """Consume one engine delta; the Output for the client, or None once finished here."""
        if self.finished:
            return None
        now = time.time() if now is None else now
        ids = unpack_ids(delta.token_ids)
        if delta.usage is not None:
            self._cached_tokens = delta.usage.cached_tokens
        text, keep, stop_string = self._detokenize(ids, delta.finish_reason)
        out = Output(rid=self.rid, index=self.index, adapter=delta.adapter, version=delta.version,
                     text=text, usage=delta.usage, prompt_logprobs=delta.prompt_logprobs,
                     prompt_top_ids=delta.prompt_top_ids, prompt_top_logprobs=delta.prompt_top_logprobs,
                     prompt_ranks=delta.prompt_ranks, pooled=delta.pooled)
        self._slice_tokens(out, delta, ids, keep)
        self._record(out, keep, now)
        if self._split is not None:
            self._assistant(out, self._split.feed(out.text))
        if stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
            self.needs_abort = delta.finish_reason is None
            out.usage = Usage(prompt_tokens=delta.usage.prompt_tokens if delta.usage else len(self.prompt_ids),
                              completion_tokens=self.num_tokens, cached_tokens=self._cached_tokens)
        elif delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            if delta.finish_reason == "stop" and ids and ids[-1] in self.stop_token_ids:
                self.stop_reason = ids[-1]
        if self.finished:
            self.finished_at = now
            out.finish_reason, out.stop_reason = self.finish_reason, self.stop_reason  # type: ignore[assignment]
            if self._split is not None:
                self._assistant(out, self._split.finish(), add=True)
        self._add_prompt_extras(out, delta)
        return out

    def _detokenize(self, ids: list[int], finish: str | None) -> tuple[str, int, str | None]:
        """(text to emit, how many of ids to keep, the stop string that matched or None)."""
        if self._detok is None:
            return "", len(ids), None
        assert self.spec is not None
        # vLLM: the text of the token that ended the sequence is left out unless include_stop_str.
        decode = ids[:-1] if finish == "stop" and ids and not self.spec.include_stop_str else ids
        parts: list[str] = []
        for i, tid in enumerate(decode):
            piece = self._detok.add(tid)
            if self._stop is None:
                parts.append(piece)
                continue
            safe, stop = self._stop.feed(piece, check=self.num_tokens + i + 1 > self.min_tokens)
            parts.append(safe)
            if stop is not None:
                return "".join(parts), i + 1, stop
        if finish is not None:
            tail = self._detok.flush()
            if self._stop is not None:
                safe, stop = self._stop.feed(tail, check=self.num_tokens + len(ids) > self.min_tokens)
                parts.append(safe)
                if stop is not None:
                    return "".join(parts), len(decode), stop
                tail = self._stop.flush()
            parts.append(tail)
        return "".join(parts), len(ids), None

    @staticmethod
    def _assistant(out: Output, split: Split, add: bool = False) -> None:
        """The split of this output's text: content stays `text`, the rest goes to its own fields."""
        out.text = out.text + split.content if add else split.content
        out.reasoning += split.reasoning
        out.tool_calls = out.tool_calls + split.tool_calls
        out.tool_call_deltas = out.tool_call_deltas + split.tool_call_deltas

    def _slice_tokens(self, out: Output, delta: SeqDelta, ids: list[int], keep: int) -> None:
        """Ids, logprobs and top-k of the first `keep` tokens, and their strings when asked."""
        n = len(ids)
        out.token_ids = delta.token_ids[:keep * _I32]
        out.logprobs = delta.logprobs[:keep * _I32]
        k = len(delta.top_ids) // (_I32 * n) if n else 0
        out.top_ids = delta.top_ids[:keep * k * _I32]
        out.top_logprobs = delta.top_logprobs[:keep * k * _I32]
        if self.spec is not None and self.spec.token_strings:
            out.tokens = self.tok.token_strings(ids[:keep])
            if out.top_ids:
                out.top_tokens = self.tok.token_strings(unpack_ids(out.top_ids))

    def _record(self, out: Output, keep: int, now: float) -> None:
        if keep:
            extend_spans(self.versions, self.num_tokens, out.version)
            if not self.first_token_at:
                self.first_token_at = now
        self.num_tokens += keep
        self._ids += out.token_ids
        self._logprobs += out.logprobs
        if out.text:
            self._text.append(out.text)

    def _add_prompt_extras(self, out: Output, delta: SeqDelta) -> None:
        """Echo (first output only) and the prompt's token strings when prompt logprobs come."""
        spec = self.spec
        if spec is not None and spec.echo and not self._sent_prompt:
            out.prompt_text = self.tok.decode(self.prompt_ids, skip_special_tokens=False)
            out.prompt_ids = pack_ids(self.prompt_ids)
        self._sent_prompt = True
        if spec is not None and spec.token_strings and delta.prompt_logprobs:
            out.prompt_tokens = self.tok.token_strings(self.prompt_ids)
            if delta.prompt_top_ids:
                out.prompt_top_tokens = self.tok.token_strings(unpack_ids(delta.prompt_top_ids))

    # ------------------------------------------------------------------ at finish

    def rollout(self, metadata: dict[str, Any] | None = None) -> Rollout:
        """The whole sequence for trainers: ids, sampler logprobs, version spans, text, timings."""
        return Rollout(rid=self.rid, index=self.index, prompt_ids=pack_ids(self.prompt_ids),
                       completion_ids=bytes(self._ids), logprobs=bytes(self._logprobs),
                       adapter=self.adapter, versions=list(self.versions),
                       finish_reason=self.finish_reason,  # type: ignore[arg-type]
                       metadata=self.metadata if metadata is None else metadata, text=self.text,
                       submitted_at=self.submitted_at, first_token_at=self.first_token_at,
                       finished_at=self.finished_at)
