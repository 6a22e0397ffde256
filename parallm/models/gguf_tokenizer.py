"""A Hugging Face tokenizer (tokenizer.json and friends) rebuilt from a GGUF file's metadata.

A GGUF has no tokenizer.json: it stores the vocabulary, merges (BPE) or scores (SentencePiece),
token types, special ids and the chat template. The pieces HF keeps in tokenizer.json that a
GGUF only names (the pre-tokenizer, by `tokenizer.ggml.pre`) come from the table below, written
to match the reference tokenizer.json of each family (SmolLM2 and StarCoder2: individual digits
then GPT-2's byte-level regex; Llama 3: its split regex, merges ignored for whole-vocabulary
words; Qwen2: NFC, then its split regex). A `pre` not in the table is refused rather than
approximated, since a wrong split silently changes every token id.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .errors import ModelLoadError

log = logging.getLogger(__name__)

# llama.cpp token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                    _byte_level(use_regex=False)])


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level(use_regex=True)])


# tokenizer.ggml.pre -> (pre-tokenizer, normalizer, ignore_merges)
_BPE_PRE: dict[str, tuple[Any, Any, bool]] = {
    "smollm": (_digits_then_gpt2, None, False),
    "starcoder": (_digits_then_gpt2, None, False),
    "gpt-2": (lambda: _byte_level(use_regex=True), None, False),
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), normalizers.NFC, False),
}
SUPPORTED_PRE = frozenset(_BPE_PRE)


def _spm_merges(tokens: list[str], scores: list[float], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: a piece that splits into two pieces of
    the vocabulary is one merge, and higher-scoring pieces merge first."""
    found = []
    for index, piece in enumerate(tokens):
        if vocab.get(piece) != index:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[index], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _special_id(metadata: Mapping[str, Any], key: str, n: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not 0 <= int(value) < n:
        raise ModelLoadError(f"GGUF tokenizer.ggml.{key} = {value} is outside the vocabulary (size {n})")
    return int(value)


def _bpe_tokenizer(metadata: Mapping[str, Any], tokens: list[str], vocab: dict[str, int]) -> Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in _BPE_PRE:
        raise ModelLoadError(
            f"GGUF BPE tokenizer with pre-tokenizer '{pre}' is not supported (supported: "
            f"{', '.join(sorted(_BPE_PRE))}); its token ids would differ from the model's own tokenizer")
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelLoadError("GGUF BPE tokenizer has no tokenizer.ggml.merges")
    pre_tokenizer, normalizer, ignore_merges = _BPE_PRE[pre]
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], dropout=None,
                               unk_token=None, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer()
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_tokenizer(metadata: Mapping[str, Any], tokens: list[str], vocab: dict[str, int],
                   unk: int | None) -> Tokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    if metadata.get("general.architecture", "").startswith("gemma") or not scores:
        # Gemma's scores do not follow its merge order; the order of the pieces does.
        scores = [-float(i) for i in range(len(tokens))]
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tok = Tokenizer(models.BPE(vocab, _spm_merges(tokens, scores, vocab), dropout=None,
                               unk_token=tokens[unk] if unk is not None else None,
                               fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("\u2581")] if add_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    tail = [decoders.Strip(" ", 1, 0)] if add_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()] + tail)
    return tok


def build_tokenizer(metadata: Mapping[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer, and facts for the config files (special tokens, flags, chat template)."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError("GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    n = len(tokens)
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * n
    if kind == "llama":
        # SentencePiece stores whitespace-only pieces with real spaces; text reaches them as U+2581.
        spelled = {t: "\u2581" * len(t) for t in tokens if t and not t.strip(" ")}
        tokens = [spelled[t] if t in spelled and spelled[t] not in tokens else t for t in tokens]
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if len(vocab) != n:
        log.warning("GGUF vocabulary repeats %d token strings; the repeats are unreachable", n - len(vocab))
    ids = {key: _special_id(metadata, f"{key}_token_id", n) for key in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    if kind == "gpt2":
        tok = _bpe_tokenizer(metadata, tokens, vocab)
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tok = _spm_tokenizer(metadata, tokens, vocab, ids["unknown"])
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise ModelLoadError(f"GGUF tokenizer model '{kind}' is not supported; supported: gpt2 (byte-level BPE), "
                             "llama (SentencePiece BPE)")
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    special = {i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)} | {i for i in ids.values() if i is not None}
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)
                            if vocab.get(tokens[i]) == i])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
                    if t == USER_DEFINED and vocab.get(tokens[i]) == i])
    tok.post_processor = _post_processor(tokens, kind, ids["bos"] if add_bos else None, ids["eos"] if add_eos else None)
    facts = {
        "tokens": {key: tokens[i] for key, i in ids.items() if i is not None},
        "ids": ids,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "additional_special_tokens": [tokens[i] for i in sorted(special) if i not in ids.values()],
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    return tok, facts


def _post_processor(tokens: list[str], kind: str, bos: int | None, eos: int | None) -> Any:
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False) if kind == "gpt2" else None
    head = [tokens[bos]] if bos is not None else []
    tail = [tokens[eos]] if eos is not None else []
    pairs = [(tokens[i], i) for i in dict.fromkeys(x for x in (bos, eos) if x is not None)]
    return processors.TemplateProcessing(single=[*head, "$A", *tail], pair=[*head, "$A", *tail, *head, "$B", *tail],
                                         special_tokens=pairs)


def eos_token_ids(facts: Mapping[str, Any]) -> list[int]:
    """End-of-sequence ids: eos, then end-of-turn and end-of-message where the file names them."""
    ids = facts["ids"]
    return list(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None))


def write_tokenizer_files(metadata: Mapping[str, Any], out: Path, *, model_max_length: int) -> list[int]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the eos ids."""
    tok, facts = build_tokenizer(metadata)
    tok.save(str(out / "tokenizer.json"))
    names = facts["tokens"]
    special_map = {f"{key}_token": names.get(gguf_key) for key, gguf_key in
                   (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    special_map = {k: v for k, v in special_map.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "additional_special_tokens": facts["additional_special_tokens"],
        "add_bos_token": facts["add_bos_token"],
        "add_eos_token": facts["add_eos_token"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if facts["chat_template"]:
        config["chat_template"] = facts["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map["additional_special_tokens"] = facts["additional_special_tokens"]
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
    return eos_token_ids(facts)
