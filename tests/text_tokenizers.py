"""Small tokenizers built in-process for the parallm.text tests (no downloads).

`byte_bpe()` is a byte-level BPE trained on a mixed-script corpus with a small vocabulary, so
multi-byte characters (emoji, CJK, accents) really are split across tokens, some tokens holding
the tail of one character and the head of the next.
"""

from __future__ import annotations

import functools
import random

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>{% endif %}"
          "{% endif %}")
ALPHABET = ("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,!?\n\t-_'\"éèàüßñçøå你好世界中文日本語한국어"
            "😀🎉👍🏽🤖🚀€£¥ΩπλЖДя∑√∞")

CORPUS = [
    "the quick brown fox jumps over the lazy dog", "hello world, hello there!",
    "café naïve résumé über straße mañana façade", "你好世界 中文文本 日本語のテキスト 한국어 텍스트",
    "emoji 😀 🎉 👍🏽 🤖 🚀 party", "price: 5€ 3£ 100¥", "ΩπλЖДя ∑√∞ math",
] * 20


def random_text(rng: random.Random, max_len: int = 40) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, max_len)))


@functools.lru_cache(maxsize=None)
def raw_byte_bpe(bos: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])
    return tok


def byte_bpe(chat_template: str | None = CHATML, bos: bool = False) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=raw_byte_bpe(bos), chat_template=chat_template,
                                   eos_token="<|im_end|>", bos_token="<|endoftext|>")


def byte_token(tok: PreTrainedTokenizerFast, b: int) -> int:
    """The id of the single-byte token for byte b."""
    from parallm.text.vocab import _BYTE_LEVEL
    char = next(c for c, v in _BYTE_LEVEL.items() if v == b)
    return tok.convert_tokens_to_ids(char)


@functools.lru_cache(maxsize=None)
def metaspace_bpe() -> Tokenizer:
    """A SentencePiece-style tokenizer: '▁' marks spaces, bytes fall back to <0xNN> tokens."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "Hello": 3, "!": 4, "▁": 5}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    return tok
