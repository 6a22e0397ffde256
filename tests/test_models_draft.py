"""parallm.models.draft: the draft model of spec.mode draft loads when it shares the served model's
vocabulary (a tiny random-weight llama with the default model's tokenizer) and is refused, naming the
difference, when its tokenizer differs or its logits do not cover the vocabulary; an engine over the
default model with that draft (spec.mode draft) starts."""

import json
import shutil

import pytest

from parallm.config import Config, ModelConfig, SpecConfig
from parallm.models import ModelLoadError, load_draft, load_model, materialize
from parallm.models.shapes import build_model_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    default = load_model(ModelConfig())
    tok_dir = materialize(default.source, "float32")
    root = tmp_path_factory.mktemp("drafts")
    good = build_model_dir("tiny-draft", root / "good", tok_dir)
    narrow = build_model_dir("tiny-draft", root / "narrow", tok_dir, vocab_size=1000)
    other = root / "other"
    shutil.copytree(good, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, another vocabulary
    (other / "tokenizer.json").write_text(json.dumps(tok))
    return {"good": good, "narrow": narrow, "other": other}


def config(path) -> Config:
    return Config(spec=SpecConfig(mode="draft", draft_model=str(path)))


def test_a_draft_with_the_served_models_tokenizer_loads(dirs):
    loaded = load_draft(config(dirs["good"]))
    assert loaded.vocab_size == 49152 and loaded.dtype == "float32"


@pytest.mark.parametrize("which, fragment", [("other", "tokenizer differs from the served model's"),
                                             ("narrow", "do not cover token id")])
def test_a_draft_of_another_vocabulary_is_refused_naming_why(dirs, which, fragment):
    with pytest.raises(ModelLoadError, match=fragment) as err:
        load_draft(config(dirs[which]))
    assert "cannot draft for 'default'" in str(err.value)


@pytest.mark.slow  # the default model's verify passes: a minute on a loaded 2-core machine
def test_default_model_greedy_identical_with_the_tiny_draft_batched_with_staggered_arrivals(dirs):
    import numpy as np

    from _default_model import default_model
    from _engine_helpers import make_engine, run_all
    from test_engine_spec import default_model_settings, default_model_workload

    draft = load_draft(config(dirs["good"])).model
    kw = default_model_settings()
    made, arrivals = default_model_workload()
    plain = run_all(make_engine(default_model(), **kw), made, arrivals=arrivals)
    spec = SpecConfig(mode="draft", k=4, disable_batch_size=8, min_acceptance=0.0)
    engine = make_engine(default_model(), spec=spec, draft=draft, **kw)
    made, arrivals = default_model_workload()
    got = run_all(engine, made, arrivals=arrivals)
    for key in plain:
        assert got[key]["tokens"] == plain[key]["tokens"], key
        np.testing.assert_allclose(got[key]["logprobs"], plain[key]["logprobs"], atol=2e-3)
    s = engine.stats().spec
    assert s.mode == "draft" and s.verify_passes > 0
