"""Loading a served model's tokenizer and context length without importing MLX."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parallm.config import ModelConfig


def model_limits(model: ModelConfig) -> dict[str, Any]:
    """max_model_len and model_type from a resolved model directory's config.json."""
    config = json.loads((Path(model.path) / "config.json").read_text())
    config = {**(config.get("text_config") or {}), **config}  # a multimodal checkpoint states them in text_config
    limit = int(config.get("max_position_embeddings") or config.get("max_seq_len") or 0)
    if model.max_model_len:
        limit = min(limit, model.max_model_len) if limit else model.max_model_len
    return {"max_model_len": limit, "model_type": config.get("model_type", ""),
            "vocab_size": int(config.get("vocab_size") or 0)}


# For models that ship no chat template: each message as "role: content" on its own line.
DEFAULT_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def chat_template_text(setting: str) -> str:
    """model.chat_template (--chat-template): the contents of the file it names, or the template
    itself; anything else is refused at start rather than at the first chat request."""
    path = Path(setting).expanduser()
    try:
        if len(setting) < 4096 and path.is_file():
            return path.read_text()
    except OSError as exc:
        raise ValueError(f"model.chat_template: cannot read {setting}: {exc}") from None
    if "{{" in setting or "{%" in setting:
        return setting
    raise ValueError(f"model.chat_template {setting!r} is neither a file nor a Jinja template")


def load_text_tokenizer(model: ModelConfig):
    """(HF fast tokenizer, limits) of a resolved model directory (the supervisor resolves `model.path`),
    with the chat template of model.chat_template, else the model's own, else DEFAULT_CHAT_TEMPLATE."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    if model.chat_template:
        tokenizer.chat_template = chat_template_text(model.chat_template)
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer, model_limits(model)


def load_pooling_templaters(entries: list[str], trust_remote_code: bool = False) -> dict[str, Any]:
    """{served name: (HF fast tokenizer, PoolingInfo)} of model.pooling's entries, as the supervisor resolved
    them ('NAME:TASK=DIR'): a pooling model's text is tokenized with its own tokenizer, within its own
    length. A model without a chat template keeps none (chat messages to it are refused)."""
    from transformers import AutoTokenizer

    from parallm.config.pooling import parse_entry
    from parallm.pooling.spec import describe

    out = {}
    for entry in entries:
        name, task, path = parse_entry(entry)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        out[name] = (tokenizer, describe(Path(path), name, task))
    return out
