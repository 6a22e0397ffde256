"""Where a constrained row's grammar begins when it starts after the model's reasoning.

vLLM's reasoning-aware structured output: with thinking on, a chat request's constraint
(response_format, tool_choice required or named) applies to the answer, not to the thinking. The
grammar starts after the thinking segment's end marker: at once when the prompt ends with no
segment open and the first token does not open one (that first token may be the start marker or
any token the grammar allows), or after the end marker when the prompt (the template, e.g. a
DeepSeek-R1-style `<think>\\n` generation prompt) or the first token opened the segment. A
prompt that ends with a segment just closed (a template turning thinking off writes an empty one)
gets the grammar from the first token.

The markers are those of the vocabulary (parallm.text.assistant.THINK_PAIRS, as mlx-lm finds
them), as token ids; a marker several tokens long is matched as that id sequence. gpt-oss's
harmony format has no thinking pair: its answer is the message after `<|channel|>final`, its
header, and `<|message|>` (the prompt ends inside an assistant message's header, `<|start|>assistant`):
the end marker is `<|channel|>final` and the grammar begins after the next `<|message|>`, so a header
such as `<|channel|>final <|constrain|>json<|message|>` (what gpt-oss writes for a response format)
is left free as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence as Seq

# (start ids, end ids) or (start ids, end ids, then): with `then`, the grammar begins after the first
# `then` token following the end marker (harmony's header between "<|channel|>final" and "<|message|>")
Markers = tuple[tuple[int, ...], tuple[int, ...]] | tuple[tuple[int, ...], tuple[int, ...], int]
CLOSED_TAIL = 2  # tokens after a prompt's end marker that still count as "closed at the end"


def thinking_from_file(path: str | Path) -> Markers | None:
    """The thinking markers of a model's tokenizer.json as token ids, or None: the single-token
    pairs mlx-lm knows, then Gemma's `<|channel>thought` … `<channel|>`."""
    from parallm.text.assistant import THINK_PAIRS

    text = Path(path).read_text()
    added = {t["content"]: int(t["id"]) for t in json.loads(text).get("added_tokens", [])}
    for start, end in THINK_PAIRS:
        if start in added and end in added:
            return (added[start],), (added[end],)
    if "<|channel>" in added and "<channel|>" in added:
        from tokenizers import Tokenizer

        thought = Tokenizer.from_str(text).encode("thought", add_special_tokens=False).ids
        return (added["<|channel>"], *thought), (added["<channel|>"],)
    if all(m in added for m in ("<|start|>", "<|channel|>", "<|message|>")):
        # gpt-oss harmony: the prompt ends with "<|start|>assistant"; the answer is the final channel's message
        from tokenizers import Tokenizer

        final = Tokenizer.from_str(text).encode("final", add_special_tokens=False).ids
        return (added["<|start|>"],), (added["<|channel|>"], *final), added["<|message|>"]
    return None


def _find(ids: Seq[int], marker: tuple[int, ...], start: int = 0) -> int:
    """Index of the first occurrence of `marker` in ids[start:], or -1."""
    n, m = len(ids), len(marker)
    first = marker[0]
    for i in range(max(0, start), n - m + 1):
        if ids[i] == first and tuple(ids[i:i + m]) == marker:
            return i
    return -1


def _rfind(ids: Seq[int], marker: tuple[int, ...]) -> int:
    m = len(marker)
    for i in range(len(ids) - m, -1, -1):
        if tuple(ids[i:i + m]) == marker:
            return i
    return -1


class ThinkGate:
    """One row's thinking state: `begin(outputs, pending)` gives the output index where its grammar
    starts, or None while the row thinks (its tokens are then unconstrained)."""

    __slots__ = ("start", "end", "then", "inside", "may_open", "scanned", "_begin")

    def __init__(self, markers: Markers, prompt_ids: Seq[int]) -> None:
        self.start, self.end = markers[0], markers[1]
        self.then = markers[2] if len(markers) > 2 else None
        last_end = _rfind(prompt_ids, self.end)
        self.inside = _rfind(prompt_ids, self.start) > last_end  # the prompt opened it
        # an empty segment closed in the prompt's last tokens is a template turning thinking off
        # (Qwen3's enable_thinking=False writes "<think>\n\n</think>\n\n"): the answer comes at once
        closed_at_end = last_end >= 0 and len(prompt_ids) - last_end - len(self.end) <= CLOSED_TAIL
        self.may_open = not self.inside and not closed_at_end and len(self.start) == 1
        self.scanned = 0  # outputs before this index hold no end marker
        self._begin: int | None = None

    @property
    def opener(self) -> int | None:
        """The start marker's token, which the first token may be besides the grammar's."""
        return self.start[0] if self.may_open else None

    def begin(self, outputs: Seq[int], pending: int | None = None) -> int | None:
        """Where the grammar starts in outputs + [pending] (None: still thinking, or the first token
        is to come and may open a segment); a begin found through a pending token the sequence did not
        keep is searched again."""
        n = len(outputs) + (pending is not None)
        if self._begin is not None and self._begin <= n:
            return self._begin
        self._begin = None
        if self.may_open:
            if n == 0:
                return None
            first = outputs[0] if outputs else pending
            if first != self.start[0]:
                self._begin = 0
                return 0
            self.may_open, self.inside, self.scanned = False, True, 1
        if not self.inside:
            self._begin = 0
            return 0
        ids = list(outputs) if pending is None else [*outputs, pending]
        j = _find(ids, self.end, self.scanned)
        if j < 0:
            self.scanned = max(self.scanned, len(outputs) - len(self.end) + 1)
            return None
        begin = j + len(self.end)
        if self.then is not None:  # the rest of the header: the grammar begins after its `then` token
            k = _find(ids, (self.then,), begin)
            if k < 0:
                return None
            begin = k + 1
        self._begin = begin
        return self._begin
