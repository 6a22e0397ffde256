"""Tokenizers rebuilt from GGUF metadata: SmolLM2's against Hugging Face's ids, SentencePiece's
against the sentencepiece library, and the files transformers and mlx-lm read."""

from __future__ import annotations

import io
import json

import pytest

from parallm.config import ModelConfig
from parallm.models import ModelLoadError, ModelSource, load_tokenizer, resolve_model
from parallm.models.gguf_tokenizer import build_tokenizer

from test_models_default import FRANCE_PROMPT_IDS, SYSTEM_IDS

# Hugging Face tokenizer ids (transformers, SmolLM2-135M-Instruct) for chat prompts.
HELLO_PROMPT_IDS = SYSTEM_IDS + [1, 4093, 198, 28120, 905, 2, 198, 1, 520, 9531, 198]
FRENCH_PROMPT_IDS = SYSTEM_IDS + [1, 4093, 198, 65, 2726, 290, 1264, 2618, 47765, 1121, 367, 2618, 4649, 9148, 428,
                                  2756, 96, 19870, 430, 16520, 8715, 30, 2, 198, 1, 520, 9531, 198]

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "multiple   internal    spaces",
    "tabs\tand\nnewlines\r\nmixed",
    "I'm sure they'll say it's fine, don't you think?",
    "Numbers 12345 and 3.14159 and 1,000,000",
    "Café naïve résumé façade Ångström e\u0301",
    "你好，世界！日本語のテキスト 한국어",
    "Emoji: 😀👍🏽🇺🇸 and ❤️",
    "def foo(x):\n    return x ** 2  # comment\n",
    "<|im_start|> inside text <|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> ModelSource:
    return resolve_model(ModelConfig(cache_dir=str(tmp_path_factory.mktemp("parallm-cache"))), progress=False)


@pytest.fixture(scope="module")
def tokenizer(source: ModelSource):
    return load_tokenizer(source)


def chat(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_prompts_match_hugging_face_ids(tokenizer) -> None:
    assert chat(tokenizer, "hello world") == HELLO_PROMPT_IDS
    assert chat(tokenizer, "What is the capital of France?") == FRANCE_PROMPT_IDS
    assert chat(tokenizer, "Quelle est la capitale de la France ? Réponds en une phrase.") == FRENCH_PROMPT_IDS


def test_chat_template_renders_smollm2_format(tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    own_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(own_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids(tokenizer) -> None:
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tokenizer.encode("<|endoftext|>", add_special_tokens=False) == [0]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert tokenizer.eos_token_id == 2 and tokenizer.model_max_length == 8192
    assert tokenizer.decode([1, 28120, 2], skip_special_tokens=True) == "hello"


def test_no_bos_added_and_digits_split(tokenizer) -> None:
    assert tokenizer.encode("hello") == [28120]  # SmolLM2: add_bos_token is false
    ids = tokenizer.encode("2024", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_files_agree_with_tokenizers_and_mlx_lm(source: ModelSource, tokenizer) -> None:
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, load as load_mlx_tokenizer
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(source.path / "tokenizer.json"))
    wrapper = load_mlx_tokenizer(source.path, eos_token_ids=[2])
    for text in TEXTS:
        expected = raw.encode(text).ids
        assert tokenizer.encode(text) == expected
        assert wrapper.encode(text) == expected
    assert wrapper.eos_token_ids == {2}
    assert isinstance(wrapper.detokenizer, BPEStreamingDetokenizer)
    detok = wrapper.detokenizer
    detok.reset()
    for token in raw.encode(TEXTS[8]).ids:
        detok.add_token(token)
    detok.finalize()
    assert detok.text == TEXTS[8]
    config = json.loads((source.path / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["chat_template"].startswith("{% for message in messages %}")
    assert json.loads((source.path / "generation_config.json").read_text())["eos_token_id"] == 2


def _spm_metadata(user_defined: tuple[str, ...] = ()) -> tuple[object, dict]:
    import sentencepiece as spm

    corpus = ("The quick brown fox jumps over the lazy dog. Numbers: 12345, 3.14159 and 1,000,000.\n"
              "Café naïve résumé façade, “quotes” and ‘single’. 你好，世界！ Emoji 😀👍🏽 ok.\n"
              "def foo(x):\n    return x ** 2  # comment\n\tTabbed line\n") * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.splitlines()), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=list(user_defined), allow_whitespace_only_pieces=True, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):  # as llama.cpp's converter types the pieces
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 4 if piece in user_defined else 1)
    return sp, {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.unknown_token_id": 0}


def test_sentencepiece_vocab_matches_sentencepiece() -> None:
    sp, metadata = _spm_metadata()
    tok, facts = build_tokenizer(metadata)
    texts = TEXTS[:-2] + ["zzqx unseen ✓ ☃", "   ", "a\n\n\nb"]
    for text in texts:
        expected = sp.encode(text)
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == expected, text
        assert tok.decode(ids) == sp.decode(expected)
    # Control tokens written in the text are matched whole, as transformers and llama.cpp do
    # (sentencepiece itself would spell them out).
    assert tok.encode("</s>", add_special_tokens=False).ids == [2]
    assert tok.encode("hi").ids[0] == 1  # llama.cpp adds BOS to SentencePiece vocabularies by default
    assert facts["add_bos_token"] is True


def test_sentencepiece_user_defined_tokens_stay_whole() -> None:
    _, metadata = _spm_metadata(user_defined=("<tool>",))
    tok, _ = build_tokenizer(metadata)
    tokens = metadata["tokenizer.ggml.tokens"]
    pieces = [tokens[i] for i in tok.encode("x <tool> y", add_special_tokens=False).ids]
    # llama.cpp's SentencePiece path prefixes a space to the text after every token it matched
    # whole (`is_prev_special`), as transformers' legacy tokenizers do; sentencepiece itself does
    # not ("▁y"). parallm follows llama.cpp, the reference for GGUF files.
    assert pieces == ["▁x", "▁", "<tool>", "▁▁", "y"]


def test_unknown_pre_tokenizer_is_refused() -> None:
    _, metadata = _spm_metadata()
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'falcon'"):
        build_tokenizer({**metadata, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "falcon",
                         "tokenizer.ggml.merges": ["a b"]})
    with pytest.raises(ModelLoadError, match="tokenizer model 'bert'"):
        build_tokenizer({**metadata, "tokenizer.ggml.model": "bert"})
