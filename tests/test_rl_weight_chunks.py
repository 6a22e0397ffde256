"""A full-weight update sent in chunks over the trainer's PUB socket (AdapterPublisher.publish_weights: one
layer per WeightsUpdate) is all or nothing: chunks are checked and staged as they come, the served
weights change only when the last one is in, and an update that fails midway (a corrupt or misshapen
chunk, a missing chunk, a trainer gone quiet) leaves them untouched while requests go on under the old
version. Why it failed reaches the trainer: a RequestError when the chunk carried a qid, else the
engine's stats (`weights`) and GET /v1/training/status. Driven through the engine stage's handler with
a real engine on a tiny model (no stage processes)."""

from __future__ import annotations

import mlx.core as mx
import pytest
import zmq
from mlx.utils import tree_flatten
from starlette.testclient import TestClient

from _engine_helpers import greedy, reference_greedy, req, tiny_model
from parallm import protocol
from parallm.adapters import save_bytes
from parallm.api.app import build_app
from parallm.config import Config, EngineConfig, ServerConfig, build_config
from parallm.engine import Engine, EngineModel
from parallm.engine.weights import by_layer
from parallm.runtime import StageRuntime
from parallm.transport import Receiver, open_socket
from test_api_fakes import FakeBackend

PROMPT = list(range(5, 30))


@pytest.fixture
def stage(tmp_path):
    from parallm.stages.engine import EngineStage

    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path)},
                                                 "adapters": {"weights_staging_dir": str(tmp_path / "staging")}})
    (tmp_path / "staging").mkdir()
    ctx = zmq.Context()
    try:
        rt = StageRuntime(config, "engine", ctx=ctx)
        detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
        engine = Engine(EngineModel(tiny_model("llama", 0), [0], 256, 101), Config(engine=EngineConfig(block_size=8, kv_budget_mb=16)))
        stage = EngineStage(config, rt, engine, {})
        stage.detok = detok
        stage.staging_root = tmp_path / "staging"
        yield stage
        stage.staging.close()
    finally:
        ctx.destroy(0)


def chunks_of(model, update_id: str = "u1", **kw) -> list[protocol.WeightsUpdate]:
    """What publish_weights sends: one chunk per layer."""
    groups = by_layer(dict(tree_flatten(model.parameters())))
    return [protocol.WeightsUpdate(weights=save_bytes(g), update_id=update_id, chunk=i, chunks=len(groups), **kw)
            for i, g in enumerate(groups)]


def snapshot(engine: Engine) -> dict[str, mx.array]:
    return {k: mx.array(v) for k, v in tree_flatten(engine.model.parameters())}


def unchanged(engine: Engine, before: dict[str, mx.array]) -> bool:
    return all(mx.array_equal(before[k], v).item() for k, v in tree_flatten(engine.model.parameters()))


def serve_one_step_each(stage, messages: list) -> list[int]:
    """Handle the messages one by one with an engine step after each; the versions of the tokens sampled."""
    versions = []
    for message in messages:
        stage.handle(message)
        versions += [o.version for o in stage.engine.step() if o.token_ids]
    return versions


def test_chunks_are_applied_only_when_the_last_one_is_in(stage):
    engine, new = stage.engine, tiny_model("llama", 1)
    before = snapshot(engine)
    engine.add_request(req("r", PROMPT, greedy(40)))
    chunks = chunks_of(new)
    versions = serve_one_step_each(stage, chunks[:-1])
    assert versions and set(versions) == {0} and unchanged(engine, before)       # served on the old weights
    status = stage.stats().weights
    assert (status.receiving, status.received, status.chunks) == ("u1", len(chunks) - 1, len(chunks))
    stage.handle(chunks[-1])
    assert engine.weights_version == 1 and stage.stats().weights.receiving == ""
    stage.expire_weights()                                    # the loop's sweep: one rank, it serves version 1
    assert not any(stage.staging_root.iterdir())                                  # the staged chunks are gone
    assert engine.stats().weights_updates == 1
    out = []
    engine.add_request(req("after", PROMPT, greedy(6)))
    while engine.has_work():
        out += [t for o in engine.step() if o.rid == "after" for t in o.token_ids]
    assert out == reference_greedy(new, PROMPT, 6)


def _corrupt(chunks):
    chunks[1].weights = chunks[1].weights[:40]
    return chunks


def _misshapen(chunks):
    tensors = by_layer(dict(tree_flatten(tiny_model("llama", 1).parameters())))[1]
    name = next(iter(tensors))
    chunks[1].weights = save_bytes({**tensors, name: tensors[name][:1]})
    return chunks


def _missing(chunks):
    return [c for c in chunks if c.chunk != 1]


def _non_finite(chunks):
    tensors = by_layer(dict(tree_flatten(tiny_model("llama", 1).parameters())))[2]
    chunks[2].weights = save_bytes({k: v * float("nan") for k, v in tensors.items()})
    return chunks


@pytest.mark.parametrize("spoil, code", [(_corrupt, "invalid_weights"), (_misshapen, "shape_mismatch"),
                                         (_missing, "chunk_missing"), (_non_finite, "non_finite")])
def test_an_update_failing_midway_changes_nothing(stage, spoil, code):
    engine = stage.engine
    before, want = snapshot(engine), reference_greedy(tiny_model("llama", 0), PROMPT, 30)
    engine.add_request(req("r", PROMPT, greedy(30)))
    versions = serve_one_step_each(stage, spoil(chunks_of(tiny_model("llama", 1))))
    assert set(versions) == {0} and unchanged(engine, before) and engine.weights_version == 0
    status = stage.stats().weights
    assert status.rejected == 1 and status.last_error_code == code and status.receiving == ""
    assert "u1" in status.last_error and "unchanged" in status.last_error
    assert not any(stage.staging_root.iterdir())
    out = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.token_ids]
    tokens_before = 30 - len(out)
    assert out == want[tokens_before:]        # the whole request on the old weights


def test_a_trainer_gone_quiet_is_dropped_after_the_timeout(stage):
    engine, before = stage.engine, snapshot(stage.engine)
    now = [100.0]
    stage.staging.clock = lambda: now[0]
    chunks = chunks_of(tiny_model("llama", 1))
    stage.handle(chunks[0])
    now[0] += stage.config.adapters.weights_chunk_timeout_s - 1
    stage.expire_weights()
    assert stage.stats().weights.receiving == "u1"
    now[0] += 2
    stage.expire_weights()
    status = stage.stats().weights
    assert status.receiving == "" and status.last_error_code == "chunk_timeout" and "60 s" in status.last_error
    for c in chunks[1:]:                                      # the rest, late: refused, nothing applied
        stage.handle(c)
    assert stage.stats().weights.last_error_code == "chunk_timeout" and stage.stats().weights.rejected == 1
    assert unchanged(engine, before) and engine.weights_version == 0 and not any(stage.staging_root.iterdir())


def test_a_new_update_abandons_the_one_being_received_and_errors_reach_a_qid(stage):
    engine = stage.engine
    first, second = chunks_of(tiny_model("llama", 1), "u1"), chunks_of(tiny_model("llama", 2), "u2")
    stage.handle(first[0])
    for c in second:
        stage.handle(c)
    assert engine.weights_version == 1 and stage.stats().weights.last_error_code == "abandoned"
    out = []
    engine.add_request(req("x", PROMPT, greedy(5)))
    while engine.has_work():
        out += [t for o in engine.step() for t in o.token_ids]
    assert out == reference_greedy(tiny_model("llama", 2), PROMPT, 5)
    stale = chunks_of(tiny_model("llama", 1), "u3", version=1, qid="q1", reply_to=b"trainer")[0]
    stage.handle(stale)                                       # version 1 is not newer than 1
    message = stage.detok.recv(timeout_ms=2000)
    assert isinstance(message, protocol.RequestError)
    assert (message.rid, message.reply_to, message.status, message.code) == ("q1", b"trainer", 409, "version_conflict")


def test_training_status_tells_why_the_last_update_was_refused():
    class Backend(FakeBackend):
        async def engine_stats(self) -> protocol.EngineStats:
            return protocol.EngineStats(weights_version=3, weights_updates=3, weights=protocol.WeightsStatus(
                rejected=1, last_error="full-weight update 'u9' dropped, the served weights unchanged: chunk 4 of 9 "
                "is missing (chunk 5 came next)", last_error_code="chunk_missing"))

    client = TestClient(build_app(Backend(), ServerConfig()))
    weights = client.get("/v1/training/status").json()["weights"]
    assert weights["version"] == 3 and weights["rejected"] == 1 and weights["last_error_code"] == "chunk_missing"
    assert "chunk 4 of 9 is missing" in weights["last_error"]


def test_staged_chunks_stay_until_every_tensor_parallel_rank_serves_the_update(stage, monkeypatch):
    """Rank 0 applies the update from the staging directory; the other ranks read it when they replay
    the call, after rank 0: it is deleted once their step digests report the new weights version."""
    engine, follower = stage.engine, protocol.RankState(rank=1, policy={"": 0})
    stats = engine.stats

    def group_stats():
        out = stats()
        out.ranks = [protocol.RankState(rank=0, policy={"": engine.weights_version}), follower]
        return out

    monkeypatch.setattr(engine, "stats", group_stats)
    for c in chunks_of(tiny_model("llama", 1)):
        stage.handle(c)
    assert engine.weights_version == 1
    stage.expire_weights()
    assert len(list(stage.staging_root.iterdir())) == 1       # rank 1 has not replayed it yet
    follower.policy = {"": 1}
    stage.expire_weights()
    assert not any(stage.staging_root.iterdir())
