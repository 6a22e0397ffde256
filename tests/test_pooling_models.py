"""Pooling models (parallm.pooling): the embedded all-MiniLM-L6-v2 against sentence-transformers'
vectors, and decoder embedding / reward / classifier models against a direct forward."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from parallm.models.errors import ModelLoadError
from parallm.pooling.load import load_pooling_model
from parallm.pooling.heads import truncate_dims
from tests._pooling_helpers import direct, write_decoder

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def minilm():
    return load_pooling_model("default")


def test_minilm_equals_sentence_transformers(minilm) -> None:
    """tests/data/make_minilm_reference.py made the reference (sentence-transformers 6.2.0, CPU)."""
    texts = json.loads((DATA / "minilm_texts.json").read_text())
    ref = np.load(DATA / "minilm_reference.npz")
    ids = minilm.tokenize(texts)
    assert [len(i) for i in ids] == ref["lengths"].tolist()
    ours = minilm.run(ids)
    cos = (ours * ref["embeddings"]).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref["embeddings"], axis=1)
    assert len(texts) == 32 and cos.min() >= 0.9999, cos.min()
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    info = minilm.info
    assert (info.name, info.task, info.family, info.pooling, info.dims, info.max_len, info.matryoshka) == \
        ("all-MiniLM-L6-v2", "embed", "encoder", "mean", 384, 256, None)


def test_batching_and_padding_do_not_change_a_vector(minilm) -> None:
    ids = minilm.tokenize(["short", "a much longer sentence that pads the short one in its batch", "mid length"])
    alone = np.stack([minilm.forward([i])[0] for i in ids])
    assert np.abs(minilm.forward(ids) - alone).max() < 1e-5
    assert np.abs(minilm.run(ids, max_tokens=16) - alone).max() < 1e-5  # split into sub-batches, order kept


def test_too_long_and_empty_inputs_are_refused(minilm) -> None:
    with pytest.raises(ValueError, match="at most 256"):
        minilm.forward([[101] * 257])
    with pytest.raises(ValueError, match="no tokens"):
        minilm.forward([[]])


def test_matryoshka_truncation_renormalizes() -> None:
    v = np.array([[3.0, 4.0, 12.0]], np.float32)
    assert np.allclose(truncate_dims(v, 2), [[0.6, 0.8]])


def test_reward_model_equals_direct_forward(tmp_path: Path) -> None:
    path, model, score = write_decoder(tmp_path / "rm", "seqcls", labels=1)
    rm = load_pooling_model(str(path), name="rm")
    assert (rm.info.task, rm.info.family, rm.info.pooling, rm.info.dims) == ("reward", "decoder", "last", 1)
    convo = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ids = rm.tokenize(["hello there", "the quick brown fox jumps"]) + rm.tokenize_chat([convo])
    got = rm.run(ids)
    for row, seq in enumerate(ids):
        want = float((direct(model, seq) @ score.T)[0])
        assert abs(got[row, 0] - want) < 1e-4 * max(1.0, abs(want))


def test_classifier_labels_and_logits(tmp_path: Path) -> None:
    path, model, score = write_decoder(tmp_path / "cls", "seqcls", labels=3, seed=1)
    clf = load_pooling_model(str(path))
    assert (clf.info.task, clf.info.labels) == ("classify", ("class_0", "class_1", "class_2"))
    ids = clf.tokenize(["is this spam?"])
    assert np.allclose(clf.run(ids)[0], np.array(direct(model, ids[0]) @ score.T), atol=1e-4)
    with pytest.raises(ModelLoadError, match="score.weight"):
        load_pooling_model(str(write_decoder(tmp_path / "plain", "embed")[0]), task="reward")


@pytest.mark.parametrize("how", ["last", "mean"])
def test_decoder_embedding_equals_direct_forward(tmp_path: Path, how: str) -> None:
    path, model, _ = write_decoder(tmp_path / "emb", "embed", extra={"matryoshka_dimensions": [16, 32]})
    if how == "mean":
        (path / "modules.json").write_text(json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling",
                                                          "type": "sentence_transformers.models.Pooling"}]))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    emb = load_pooling_model(str(path))
    assert (emb.info.task, emb.info.pooling, emb.info.matryoshka, emb.info.normalize) == \
        ("embed", how, (16, 32), how == "last")
    assert emb.info.allows_dimensions(16) and not emb.info.allows_dimensions(20)
    ids = emb.tokenize(["one", "two words here", "and a third, longer, input sentence"])
    got = emb.run(ids)
    for row, seq in enumerate(ids):
        want = np.array(direct(model, seq, how))
        if how == "last":
            want = want / np.linalg.norm(want)
        assert np.allclose(got[row], want, atol=1e-4)


def test_unknown_task_and_spec(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_pooling_model(str(tmp_path / "nothing"))
    with pytest.raises(ModelLoadError, match="unknown pooling task"):
        load_pooling_model("default", task="generate")
    mx.clear_cache()
