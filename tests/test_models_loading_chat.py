"""--chat-template FILE|STRING and the default template for a model that ships none
(parallm.text.loading.load_text_tokenizer, what the tokenizer and detokenizer stages load)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parallm.config import ModelConfig, parse_args
from parallm.models import resolve_model
from parallm.text.loading import DEFAULT_CHAT_TEMPLATE, load_text_tokenizer

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer files with the chat template taken out."""
    src = resolve_model(ModelConfig(cache_dir=str(tmp_path_factory.mktemp("cache"))), progress=False).path
    out = tmp_path_factory.mktemp("bare")
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "config")) and f.is_file():
            shutil.copy2(f, out / f.name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def render(tok) -> str:
    return tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)


def test_a_model_without_a_template_gets_the_default(bare_dir):
    tok, _ = load_text_tokenizer(ModelConfig(path=str(bare_dir)))
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    assert render(tok) == "user: Hi\nassistant: "


def test_chat_template_as_a_string_or_a_file(bare_dir, tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok, _ = load_text_tokenizer(ModelConfig(path=str(bare_dir), chat_template=template))
    assert render(tok) == "<user>Hi"
    f = tmp_path / "t.jinja"
    f.write_text("[{{ messages[0]['content'] }}]")
    tok, _ = load_text_tokenizer(ModelConfig(path=str(bare_dir), chat_template=str(f)))
    assert render(tok) == "[Hi]"


def test_a_bad_chat_template_setting_is_refused(bare_dir):
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_text_tokenizer(ModelConfig(path=str(bare_dir), chat_template="/no/such/template.jinja"))


def test_the_cli_spelling():
    config, _ = parse_args(["--chat-template", "{{ x }}"])
    assert config.model.chat_template == "{{ x }}"


def test_trust_remote_code_reaches_transformers(bare_dir, monkeypatch):
    import transformers

    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, **kw):
        seen.append(kw.get("trust_remote_code"))
        return real(path, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    load_text_tokenizer(ModelConfig(path=str(bare_dir)))
    load_text_tokenizer(ModelConfig(path=str(bare_dir), trust_remote_code=True))
    assert seen == [False, True]
    config, _ = parse_args(["--trust-remote-code", "true"])
    assert config.model.trust_remote_code is True
