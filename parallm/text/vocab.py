"""A tokenizer-agnostic view over a HF fast tokenizer or a raw `tokenizers.Tokenizer`.

The text stages only need a few things from a tokenizer: decode a window of ids, encode text,
the vocabulary size, which ids are special, a chat template, and the raw bytes of one token
(for logprob token strings). This view gives them the same way whichever object the model
loader produced, so the classes in parallm.text never branch on the tokenizer's type.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BYTES_PREFIX = "bytes:"


def _byte_level_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable char that stands for each byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_LEVEL = _byte_level_table()


def _decoder_kinds(node: Any) -> list[dict[str, Any]]:
    """The leaf decoders of a decoder config (Sequence decoders flattened), in order."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [leaf for child in node.get("decoders", []) for leaf in _decoder_kinds(child)]
    return [node]


class TokenizerView:
    """One tokenizer, seen through the handful of operations the text stages use.

    Build one per process and share it: it caches per-token strings and bytes.
    """

    def __init__(self, tokenizer: Any) -> None:
        if isinstance(tokenizer, TokenizerView):
            raise TypeError("already a TokenizerView; use TokenizerView.of()")
        if isinstance(tokenizer, Tokenizer):
            self.hf: Any = None
            self.backend: Tokenizer = tokenizer
        else:
            self.hf = tokenizer
            backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
            if not isinstance(backend, Tokenizer):
                raise TypeError(f"{type(tokenizer).__name__} is not a fast tokenizer (no tokenizers backend)")
            self.backend = backend
        added = self.backend.get_added_tokens_decoder()
        self.added: dict[int, str] = {i: t.content for i, t in added.items()}
        special = {i for i, t in added.items() if t.special}
        if self.hf is not None:
            special.update(int(i) for i in getattr(self.hf, "all_special_ids", []) or [])
        self.special_ids: frozenset[int] = frozenset(special)
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        if self.hf is not None:
            self.vocab_size = max(self.vocab_size, len(self.hf))
        decoders = _decoder_kinds(json.loads(self.backend.to_str()).get("decoder"))
        kinds = {d.get("type") for d in decoders}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._space_marks = [d.get("replacement", "▁") for d in decoders if d.get("type") == "Metaspace"]
        self._space_marks += [d["pattern"]["String"] for d in decoders if d.get("type") == "Replace"
                              and d.get("content") == " " and "String" in d.get("pattern", {})]
        self._wordpiece = next((d.get("prefix", "##") for d in decoders if d.get("type") == "WordPiece"), None)
        self._strings: dict[int, str] = {}
        self._longest = 0

    @property
    def longest_token_chars(self) -> int:
        """The most characters one token can stand for (its vocabulary string's length: a byte-level
        token's string has one character per byte, so it is never shorter than the text it covers)."""
        if not self._longest:
            self._longest = max((len(piece) for piece in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return self._longest

    @classmethod
    def of(cls, tokenizer: "TokenizerLike") -> "TokenizerView":
        """The view itself if given one, else a new view (build once per process and pass it around)."""
        return tokenizer if isinstance(tokenizer, TokenizerView) else cls(tokenizer)

    # ------------------------------------------------------------------ text

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Backend decode: what HF's decode gives without `clean_up_tokenization_spaces` (as vLLM)."""
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.hf is not None:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def chat_template(self) -> Any:
        return getattr(self.hf, "chat_template", None) if self.hf is not None else None

    # ------------------------------------------------------------------ single tokens

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a special token: its text; out of vocabulary: b"")."""
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if self._byte_fallback:
            m = _BYTE_FALLBACK.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        for mark in self._space_marks:
            piece = piece.replace(mark, " ")
        if self._wordpiece is not None:
            piece = piece[len(self._wordpiece):] if piece.startswith(self._wordpiece) else " " + piece
        return piece.encode()

    def token_string(self, token_id: int) -> str:
        """OpenAI's logprob "token": the token's own text, or `bytes:\\xe2\\x80` when it is not valid UTF-8."""
        s = self._strings.get(token_id)
        if s is None:
            raw = self.token_bytes(token_id)
            try:
                s = raw.decode("utf-8")
            except UnicodeDecodeError:
                s = _BYTES_PREFIX + "".join(f"\\x{b:02x}" for b in raw)
            self._strings[token_id] = s
        return s

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        return [self.token_string(i) for i in ids]


def token_string_bytes(token: str) -> list[int]:
    """The UTF-8 bytes of a token string from `token_string` (OpenAI's logprob `bytes` field)."""
    if token.startswith(_BYTES_PREFIX + "\\x"):
        hexes = token[len(_BYTES_PREFIX):].split("\\x")[1:]
        if all(len(h) == 2 for h in hexes):
            try:
                return [int(h, 16) for h in hexes]
            except ValueError:
                pass
    return list(token.encode("utf-8"))


# A transformers PreTrainedTokenizerFast, a tokenizers.Tokenizer, or a TokenizerView of either.
TokenizerLike = Any
