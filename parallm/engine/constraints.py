"""Grammar constraints in the engine: compiled grammars cached, one matcher per sequence, and
the worker thread that fills the token masks while the model pass runs.

A constrained sequence owns an llguidance matcher that has consumed its output tokens. Before
each pass the worker brings every matcher up to date with its sequence's `output_ids` and the
token of the pass still in flight (the overlapped schedule launches pass t before pass t-1 is
read: the runner launches pass t's forward, reads t-1's tokens, which the device finished first,
and hands them here while the forward runs), rolling back a speculative token a preemption
discarded, and fills an int32 bitmask row per constrained row (bit t of row b: token t
allowed); unconstrained rows are all ones. Preemption by recompute keeps the outputs and n > 1
siblings each have their own copy of the compiled matcher, so they need nothing else. llguidance
releases the GIL while it fills. The sampler applies the mask before temperature and filters
(sampling.apply_bitmask), in the sampling part of pass t's graph.

A matcher that reached its end allows only EOS, so a finished structure ends with "stop"; one
that runs out of max_tokens first ends with "length" and the partial text, as any request does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence as Seq

import numpy as np

from parallm.protocol import Constraint
from parallm.text.grammar import GrammarError, compile_text, explain
from parallm.threads import lower_priority, name_os_thread

from .sequence import Sequence
from .think_gate import Markers, ThinkGate

TokenizerSource = Callable[[], Any]
log = logging.getLogger("parallm.constraints")


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def tokenizer_from_file(path: str | Path, vocab_size: int, eos_ids: Seq[int]) -> Any:
    """An llguidance tokenizer from a model's tokenizer.json, as wide as the model's logits."""
    import llguidance

    text = Path(path).read_text()
    json.loads(text)  # a clear error for a broken file before llguidance reads it
    return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_ids) or None)


FREE, GRAMMAR, GRAMMAR_OR_OPENER = 0, 1, 2  # what a row's next token may be (RowMatcher.sync)


class Grammar:
    """A compiled grammar: its matcher (copied for each sequence) and the bitmask row of its first token
    (None: not computed), filled when it compiled, off the step loop."""

    __slots__ = ("matcher", "first")

    def __init__(self, matcher: Any, first: np.ndarray | None = None) -> None:
        self.matcher = matcher
        self.first = first


class RowMatcher:
    """One sequence's matcher and the tokens it has consumed: the sequence's outputs from where its
    grammar begins (0, or after its reasoning: think_gate.py), then the token of the pass in flight
    when the mask was computed for the pass after it (overlap)."""

    __slots__ = ("template", "matcher", "ids", "confirmed", "gate", "origin", "first", "error_logged")

    def __init__(self, template: Any, gate: ThinkGate | None = None, first: np.ndarray | None = None) -> None:
        """`first`: the grammar's first-token bitmask row (Grammar.first), used while nothing is consumed."""
        self.template = template  # the compiled grammar's matcher, copied (an errored matcher cannot reset)
        self.matcher = template.deep_copy()
        self.ids: list[int] = []
        self.confirmed = 0  # ids[:confirmed] are outputs the sequence kept
        self.gate = gate
        self.origin = 0  # the output index where the grammar begins
        self.first = first
        self.error_logged = False

    def sync(self, output_ids: list[int], pending: int | None = None) -> int:
        """Bring the matcher to `output_ids` followed by `pending` (the token sampled by the pass in
        flight); returns what the next token may be: FREE while the row thinks, GRAMMAR, or
        GRAMMAR_OR_OPENER (the first token, which may also open a thinking segment). A pending
        token consumed last time that the sequence did not keep (its pass was discarded by a
        preemption) is rolled back."""
        mode = GRAMMAR
        if self.gate is not None:
            begin = self.gate.begin(output_ids, pending)
            if begin is None:
                if self.gate.opener is None:
                    return FREE
                begin, mode = 0, GRAMMAR_OR_OPENER
            if begin != self.origin:
                self.origin, self.matcher, self.ids, self.confirmed = begin, self.template.deep_copy(), [], 0
        o, k = self.origin, self.confirmed
        kept = max(0, len(output_ids) - o)  # outputs inside the grammar
        if kept < k:  # never expected: outputs only grow; replay from the start
            self._replay(output_ids, pending)
            return mode
        target = output_ids[o + k:]
        if pending is not None and len(output_ids) >= o:
            target = [*target, pending]
        ours = self.ids[k:]
        common = 0
        for a, b in zip(ours, target):
            if a != b:
                break
            common += 1
        extra = len(ours) - common
        if extra and not self.matcher.rollback(extra):  # a matcher in error cannot roll back
            self._replay(output_ids, pending)
            return mode
        del self.ids[k + common:]
        if common < len(target):
            self.matcher.consume_tokens(target[common:])
            self.ids.extend(target[common:])
        self.confirmed = kept
        return mode

    def _replay(self, output_ids: list[int], pending: int | None) -> None:
        o = self.origin
        self.matcher = self.template.deep_copy()
        self.ids = [*output_ids[o:], *([] if pending is None or len(output_ids) < o else [pending])]
        self.matcher.consume_tokens(self.ids)
        self.confirmed = max(0, len(output_ids) - o)


def _allow(buf: np.ndarray, row: int, token: int) -> None:
    buf[row, token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))


def items_in_row_for(max_bytes: int) -> int:
    """llguidance's largest alternation a grammar may hold (its `max_items_in_row`, 2,000 by default) for
    constraints up to `max_bytes`: one alternative takes at least 2 bytes of a regex ("a|"), so any
    constraint the engine admits fits. With the default, a 64 KiB list of 2,800 choices passed the size check,
    compiled, and failed on its second token (ParserTooComplex: "row has 2801 items"): the row could only end,
    with a token that is none of the choices."""
    return max(2000, max_bytes // 2 + 1)


class Constraints:
    """Every constrained sequence of one engine. Empty (and free) while no request has a constraint."""

    def __init__(self, vocab_size: int, eos_ids: Seq[int], tokenizer: TokenizerSource | None = None,
                 cache_size: int = 256, thinking: Callable[[], Markers | None] | None = None,
                 max_bytes: int = 65536) -> None:
        """`tokenizer`: builds the llguidance tokenizer when a first grammar compiles; `thinking`: gives
        the model's thinking markers as token ids (think_gate.thinking_from_file) when a first
        constraint begins after the reasoning; `max_bytes`: the largest constraint a request may carry
        (engine.max_constraint_bytes), which sets the parser's limits (items_in_row_for)."""
        self.vocab_size = vocab_size
        self.max_items_in_row = items_in_row_for(max_bytes)
        self.eos_ids = [int(t) for t in eos_ids]
        self._tokenizer_source = tokenizer
        self._tokenizer: Any = None
        self._tokenizer_error = "this engine has no tokenizer for grammar constraints"
        self._thinking_source = thinking
        self._thinking: Markers | None | bool = False  # False: not looked up yet
        # (kind, value) -> compiled Grammar, or the GrammarError it raised (LRU): keyed by content, so that a
        # repeat finds it without rebuilding the grammar text (0.7 s for 20k choices)
        self._templates: OrderedDict[tuple[str, str], Grammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()  # the cache is shared with the compile thread
        self._compiler: ThreadPoolExecutor | None = None
        self._prepared: Future | None = None  # prepare()'s build
        self._compiler_lowered = False  # the compile thread runs below the step loop once requests compile on it
        # wraps each request's compile: the engine stage gives its OpenBLAS governor's (blas.ThreadGovernor.background),
        # which leaves the compile a core while it runs
        self.background: Callable[[], ContextManager[None]] = contextlib.nullcontext
        self.cache_size = cache_size
        self.rows: dict[int, tuple[Sequence, RowMatcher]] = {}
        self._buf = np.zeros((0, mask_words(vocab_size)), dtype=np.int32)
        self._pool: ThreadPoolExecutor | None = None
        self._executor: Any = None
        self.compiled = 0
        self.cache_hits = 0

    # ------------------------------------------------------------------ set-up
    def use_tokenizer(self, tokenizer: Any) -> None:
        """Use this llguidance LLTokenizer (tests, or a tokenizer already built)."""
        self._tokenizer = tokenizer

    def use_thinking(self, markers: Markers | None) -> None:
        """Use these thinking markers (start ids, end ids), or none (tests, or markers already known)."""
        self._thinking = markers

    @property
    def thinking(self) -> Markers | None:
        if self._thinking is False:
            try:
                self._thinking = self._thinking_source() if self._thinking_source is not None else None
            except (OSError, ValueError) as exc:  # no tokenizer.json: no markers, the grammar begins at once
                log.warning("no thinking markers for grammar constraints: %s", exc)
                self._thinking = None
        return self._thinking  # type: ignore[return-value]

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self._tokenizer_source is None:
                raise GrammarError(self._tokenizer_error)
            try:
                self._tokenizer = self._tokenizer_source()
            except (OSError, ValueError) as exc:  # no tokenizer.json, or one llguidance cannot read
                log.warning("no llguidance tokenizer for grammar constraints: %s", exc)
                self._tokenizer_source = None  # not tried again on every grammar (each try reads the file)
                self._tokenizer_error = "this model's tokenizer cannot be used for grammar constraints"
            if self._tokenizer is None:
                raise GrammarError(self._tokenizer_error)
        return self._tokenizer

    def prepare(self) -> Future:
        """Build the llguidance tokenizer and look up the thinking markers now, on the compile thread: the
        engine stage does it beside its warm-up, before it serves. Built when a first grammar compiled, it
        held the GIL for its whole build (0.6-0.9 s for SmolLM2's 49k tokens on a CPU), and every running
        row's next token waited that long (issue 30: a canary's p99 2.2-3.1x its idle p99 beside a first
        constraint). The future's result is None; a model without a usable tokenizer raises GrammarError.
        Called again (the engine stage and Engine.warm_up both ask), it returns the same future."""

        def build() -> None:
            self.tokenizer  # noqa: B018 - built and kept
            self.thinking  # noqa: B018

        if self._prepared is None:
            self._prepared = self._compile_thread().submit(build)
        return self._prepared

    def _compile_thread(self) -> ThreadPoolExecutor:
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="parallm-grammar", initializer=name_os_thread)
        return self._compiler

    def _template(self, c: Constraint) -> Grammar:
        key = (c.kind, c.value)
        with self._lock:
            found = self._templates.get(key)
            if found is not None:
                self._templates.move_to_end(key)
                self.cache_hits += 1
        if found is None:
            try:
                found = self._compile(c)
            except GrammarError as exc:
                found = exc
            with self._lock:
                self._templates[key] = found
                if len(self._templates) > self.cache_size:
                    self._templates.popitem(last=False)
        if isinstance(found, GrammarError):
            raise found
        return found

    def _compile(self, c: Constraint) -> Grammar:
        """The grammar's matcher and its first-token bitmask: a new matcher's first mask is the costliest
        (4-12 ms for a 64 KiB choice list on SmolLM2's 49k tokens, against well under 1 ms once a token is
        consumed), and it is the same for every sequence of the grammar, so it is filled here, on the compile
        thread, not on the step loop (issue 30: three 64 KiB grammars' first masks added ~40-60 ms of CPU to the
        prefill pass of their prompts on the 2-core CPU, and a canary waited for that pass)."""
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask

        text = compile_text(c)  # not validated again: the matcher reports what is wrong
        try:
            m = llguidance.LLMatcher(self.tokenizer, text, log_level=0,
                                     limits=llguidance.LLParserLimits(max_items_in_row=self.max_items_in_row))
        except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError with a message
            raise GrammarError(explain(str(exc))) from None
        if m.is_error():
            raise GrammarError(explain(m.get_error()))
        words = mask_words(self.tokenizer.vocab_size)
        first = np.zeros((1, words), dtype=np.int32)
        fill_next_token_bitmask(m.deep_copy(), first, 0)
        with self._lock:
            self.compiled += 1
        return Grammar(m, first[0] if words == mask_words(self.vocab_size) else None)

    def forget(self) -> None:
        """Drop every compiled grammar and zero the counters (after the engine's warm-up, which compiles one)."""
        with self._lock:
            self._templates.clear()
            self.compiled = self.cache_hits = 0

    def check(self, c: Constraint) -> None:
        """Compile (or find) the grammar; raises GrammarError naming what is wrong."""
        self._template(c)

    def cached(self, c: Constraint) -> bool:
        """Whether `c`'s grammar was compiled already (or failed to): `check` and `attach` answer at once."""
        with self._lock:
            return (c.kind, c.value) in self._templates

    def compile_later(self, c: Constraint, deadline: float) -> Future:
        """Compile `c`'s grammar on the compile thread (one, apart from the mask worker, so that the masks of
        running rows never wait behind it); the future's result is None, or the GrammarError. A compile still
        queued at `deadline` (time.monotonic) is skipped: its request was refused meanwhile. The compile thread
        runs below the step loop's priority (threads.lower_priority), and inside `background` (the OpenBLAS pool
        gives it a core: a low priority alone did not keep it off the pool's cores, issue 30)."""
        def compile_one() -> None:
            if not self._compiler_lowered:  # not for prepare(): the start-up build runs beside the warm-up at full speed
                self._compiler_lowered = True
                lower_priority()
            if time.monotonic() > deadline:
                raise TimeoutError("the grammar waited past its deadline to compile")
            if self.cached(c):
                self._template(c)
                return
            with self.background():
                self._template(c)

        return self._compile_thread().submit(compile_one)

    # ------------------------------------------------------------------ sequences
    def attach(self, seqs: Seq[Sequence], c: Constraint) -> None:
        """Give each sequence (n > 1 siblings included) its own matcher of the compiled grammar, which
        begins after the sequence's reasoning when the constraint says so and the model has thinking
        markers."""
        grammar = self._template(c)
        markers = self.thinking if c.after_reasoning else None
        for s in seqs:
            self.rows[s.seq_id] = (s, RowMatcher(grammar.matcher, ThinkGate(markers, s.prompt_ids) if markers else None,
                                                 grammar.first))

    def constrained(self, seqs: Seq[Sequence]) -> bool:
        rows = self.rows
        return bool(rows) and any(s.seq_id in rows for s in seqs)

    def prune(self) -> None:
        """Forget the matchers of finished sequences."""
        done = [sid for sid, (s, _) in self.rows.items() if s.finish_reason is not None]
        for sid in done:
            del self.rows[sid]

    # ------------------------------------------------------------------ masks
    def masks(self, seqs: Seq[Sequence], pending: Seq[int | None] | None = None) -> np.ndarray:
        """[len(seqs), ceil(V/32)] int32 bitmasks: each constrained row's matcher brought up to
        date with its outputs and `pending[i]` (the token of the pass in flight, not yet read into
        its outputs), then its allowed next tokens; other rows all allowed."""
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask_par

        self.prune()
        B = len(seqs)
        if self._buf.shape[0] < B:
            self._buf = np.zeros((max(B, 2 * self._buf.shape[0]), self._buf.shape[1]), dtype=np.int32)
        buf = self._buf[:B]
        buf.fill(-1)
        work, openers = [], []
        for i, s in enumerate(seqs):
            entry = self.rows.get(s.seq_id)
            if entry is None:
                continue
            row = entry[1]
            mode = row.sync(s.output_ids, None if pending is None else pending[i])
            if mode == FREE:  # thinking: the grammar begins after the end marker
                continue
            if row.matcher.is_error():
                if not row.error_logged:
                    log.warning("constrained row %s ends: its grammar failed mid-output (%s)", s.seq_id,
                                row.matcher.get_error())
                    row.error_logged = True
                buf[i] = 0
                for t in self.eos_ids:  # a matcher in error (never expected) lets the row end
                    _allow(buf, i, t)
                continue
            if not row.ids and row.first is not None:  # nothing consumed: the grammar's first mask
                buf[i] = row.first
            else:
                work.append((row.matcher, i))
            if mode == GRAMMAR_OR_OPENER:
                openers.append((i, row.gate.opener))
        if work:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            fill_next_token_bitmask_par(self._executor, work, buf)
        for i, t in openers:
            _allow(buf, i, t)
        return buf.copy()

    def submit(self, seqs: Seq[Sequence], pending: Seq[int | None] | None = None) -> Future:
        """Compute `masks(seqs, pending)` on the worker thread (llguidance drops the GIL while it fills)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="parallm-masks", initializer=name_os_thread)
        return self._pool.submit(self.masks, list(seqs), None if pending is None else list(pending))

    def stats(self) -> dict[str, int]:
        self.prune()
        return {"constrained_rows": len(self.rows), "grammars_cached": len(self._templates),
                "grammars_compiled": self.compiled, "grammar_cache_hits": self.cache_hits}
