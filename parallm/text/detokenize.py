"""Incremental detokenization: token ids in, text deltas out, one token at a time.

vLLM's algorithm (prefix/read offsets): keep a small window of ids; the window's first part
(`ids[:read]`) was already emitted as `prefix_text`. For a new token, decode the whole window;
if the text grew and does not end in U+FFFD (an incomplete multi-byte character whose remaining
bytes are in tokens still to come), the new text is `decode(window)[len(prefix_text):]`, and the
window slides forward so the last emitted group becomes the new prefix. Decoding a window with a
little left context (instead of each token alone) is what keeps leading spaces and multi-byte
characters right with decoders that are not a plain concatenation of tokens.

Invariant: for decoders whose output only grows when ids are appended (byte-level BPE,
Metaspace, WordPiece), the concatenation of all deltas plus `flush()` equals
`decode(context + generated)` minus `decode(context)`; with a byte-level decoder that is exactly
`decode(generated)`. (SentencePiece ByteFallback re-renders an earlier valid character as U+FFFD
when an invalid byte follows it in the same byte run; no incremental decoder can match that.)
"""

from __future__ import annotations

from typing import Sequence

from parallm.text.vocab import TokenizerLike, TokenizerView

REPLACEMENT = "\ufffd"

# Prompt tokens kept as left context for the first generated tokens (vLLM uses 5).
CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 bytes, so once this many text-bearing tokens follow a
# boundary, the text before it is settled. Used only by the safety valve below.
SETTLED_AFTER = 4
# If this many tokens are held back (text keeps ending in U+FFFD: a model emitting garbage
# bytes), emit up to a settled boundary so the window, and the cost per token, stays bounded.
MAX_HELD = 16


class IncrementalDetokenizer:
    """Turns appended token ids into text deltas; O(window) work per token, the window small.

    `add(id)` returns the new text (possibly "" while a character is incomplete); `flush()`
    returns whatever was held back, at finish.
    """

    def __init__(self, tokenizer: TokenizerLike, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True, keep_special: frozenset[int] = frozenset()) -> None:
        """`keep_special`: special tokens whose text stays although skip_special_tokens hides the
        others (the markers a tool-call or reasoning split reads, text/assistant.kept_special_ids)."""
        self.tok = TokenizerView.of(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self._hidden = self.tok.special_ids - keep_special if skip_special_tokens and keep_special else None
        self._ids: list[int] = self._context(prompt_ids)
        self._read = len(self._ids)          # ids[:read] are emitted, as prefix_text
        self._prefix_text = self._decode(self._ids)
        self.num_tokens = 0                  # generated tokens added so far

    def _decode(self, ids: list[int]) -> str:
        if self._hidden is not None:
            hidden = self._hidden
            return self.tok.decode([i for i in ids if i not in hidden], False)
        return self.tok.decode(ids, self.skip_special_tokens)

    def _context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's last few tokens, less any trailing incomplete character.

        A prompt that ends inside a character (ids cut mid-emoji) must not lend those bytes to
        the completion: the completion's text is what its own ids decode to.
        """
        ctx = [int(i) for i in prompt_ids[-CONTEXT_TOKENS:]]
        while ctx and self._decode(ctx).endswith(REPLACEMENT):
            ctx.pop()
        return ctx

    @property
    def held_tokens(self) -> int:
        """Tokens whose text is not emitted yet (an incomplete character, or text-less tokens)."""
        return len(self._ids) - self._read

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" if none yet)."""
        self._ids.append(int(token_id))
        self.num_tokens += 1
        text = self._decode(self._ids)
        if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT):
            return self._emit(text, len(self._ids))
        if self.held_tokens > MAX_HELD:
            return self._release_settled(text)
        return ""

    def add_many(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """At finish: the held-back text, a trailing incomplete character rendered as U+FFFD."""
        if self.held_tokens == 0:
            return ""
        text = self._decode(self._ids)
        return self._emit(text, len(self._ids)) if len(text) > len(self._prefix_text) else ""

    def _emit(self, text: str, upto: int) -> str:
        """Emit `text` (the decode of ids[:upto]) past the prefix; slide the window to ids[read:upto]."""
        new = text[len(self._prefix_text):]
        del self._ids[:self._read]
        self._read = upto - self._read
        self._prefix_text = self._decode(self._ids[:self._read])
        return new

    def _release_settled(self, text: str) -> str:
        """Safety valve: emit up to the last boundary followed by SETTLED_AFTER text-bearing tokens."""
        skipped = (self.tok.special_ids if self._hidden is None else self._hidden) if self.skip_special_tokens \
            else frozenset()
        bearing = 0
        cut = len(self._ids)
        while cut > self._read and bearing < SETTLED_AFTER:
            cut -= 1
            bearing += self._ids[cut] not in skipped
        if bearing < SETTLED_AFTER or cut <= self._read:
            return ""
        settled = self._decode(self._ids[:cut])
        if len(settled) <= len(self._prefix_text) or not text.startswith(settled):
            return ""
        return self._emit(settled, cut)
