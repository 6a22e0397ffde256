"""The draft model of speculative decoding (`--spec.mode draft --spec.draft-model PATH`): loaded like the
served model (any model spec, the served model's dtype), and refused unless it shares the served
model's vocabulary: the same token -> id map (added tokens included) and logits covering it. Its
logits may be narrower or wider than the served model's (padded embedding tables): the engine cuts or
pads them to the served model's width (engine/spec/draft.py)."""

from __future__ import annotations

from pathlib import Path

from parallm.config import Config

from .errors import ModelLoadError
from .loader import LoadedModel, load_model, load_tokenizer
from .resolve import resolve_model
from .source import ModelSource


def _vocab(source: ModelSource, trust_remote_code: bool) -> dict[str, int]:
    path = Path(source.path) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    return dict(load_tokenizer(source, trust_remote_code=trust_remote_code).get_vocab())


def vocabulary_mismatch(target: dict[str, int], draft: dict[str, int], draft_width: int) -> str | None:
    """Why a draft with this vocabulary and logits width cannot propose for a target with `target`
    (None: it can): the maps differ, or the draft's logits do not cover every id."""
    if target != draft:
        only_t = sorted(set(target.items()) - set(draft.items()), key=lambda kv: kv[1])
        only_d = sorted(set(draft.items()) - set(target.items()), key=lambda kv: kv[1])
        n = len(set(target.items()) ^ set(draft.items()))
        example = (f"the served model has {only_t[0][0]!r} = {only_t[0][1]}" if only_t
                   else f"the draft has {only_d[0][0]!r} = {only_d[0][1]}")
        return (f"its tokenizer differs from the served model's ({len(draft)} vs {len(target)} tokens, "
                f"{n} entries differ; e.g. {example})")
    top = max(draft.values(), default=-1)
    if draft_width <= top:
        return f"its logits ({draft_width} wide) do not cover token id {top}"
    return None


def load_draft(config: Config) -> LoadedModel:
    """The draft model `config.spec.draft_model`, in the served model's dtype; ModelLoadError naming the
    mismatch when its vocabulary is not the served model's."""
    spec = config.spec
    draft_config = type(config.model)(path=spec.draft_model, dtype=config.model.dtype,
                                       quantized_weights=config.model.quantized_weights,
                                       cache_dir=config.model.cache_dir,
                                       trust_remote_code=config.model.trust_remote_code)
    target_source = resolve_model(config.model, progress=False)
    loaded = load_model(draft_config)
    why = vocabulary_mismatch(_vocab(target_source, config.model.trust_remote_code),
                              _vocab(loaded.source, config.model.trust_remote_code), loaded.vocab_size)
    if why:
        raise ModelLoadError(f"spec.draft_model {spec.draft_model!r} cannot draft for {config.model.path!r}: {why}")
    return loaded
