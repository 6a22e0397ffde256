"""Issue 30: adapter and weight directories named by path are read off the engine stage's loop
(stages/engine_reads.py).

Before, the loop read them itself: a file on a slow disk or mount held every other request's next token
for as long as its read took (up to the 30 s file timeout). Here the first open of each file is made slow
(a cold disk; once read it is in the page cache and opens at once), and the stage must keep decoding
another request while the load is in progress, then load it."""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import pytest
import zmq

from parallm import files, protocol
from parallm.config import build_config
from parallm.runtime import StageRuntime
from parallm.stages.engine import EngineStage
from parallm.transport import Receiver, open_socket
from tests._adapter_helpers import lora_model, save_mlx
from tests._engine_helpers import make_engine, tiny_model
from tests.test_engine_stage_compile import submit

COLD_S = 1.0


@pytest.fixture
def stage(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path / "run")},
                                                 "adapters": {"allowed_dirs": [str(tmp_path)]}})
    ctx = zmq.Context()
    rt = StageRuntime(config, "engine", ctx=ctx)
    detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
    s = EngineStage(config, rt, make_engine(tiny_model("llama")), {})
    s.detok = detok
    opened: set[str] = set()
    open_now = files.open_regular

    def cold_open(path):  # the first read of a file waits on the disk
        if str(path) not in opened:
            opened.add(str(path))
            time.sleep(COLD_S)
        return open_now(path)

    monkeypatch.setattr(files, "open_regular", cold_open)
    yield s
    s.reads.close()
    ctx.destroy(0)


def drive(stage: EngineStage, qid: str, t0: float, seconds: float = 10.0) -> tuple[list[float], protocol.Message | None]:
    """Step the stage until `qid` is answered: when each token of request "plain" came out (seconds since
    `t0`), and the answer."""
    token_times, answer = [], None
    while answer is None and time.monotonic() - t0 < seconds:
        stage.work()
        while (m := stage.detok.recv(timeout_ms=1)) is not None:
            for o in getattr(m, "outputs", []):
                if o.rid == "plain":
                    token_times += [time.monotonic() - t0] * len(protocol.unpack_ids(o.token_ids))
            if getattr(m, "qid", None) == qid or getattr(m, "rid", None) == qid:
                answer = m
    return token_times, answer


def test_decoding_goes_on_while_an_adapter_directory_is_read(stage, tmp_path):
    model = tiny_model("llama")
    path = save_mlx(model, lora_model(model), tmp_path / "ad")
    stage.handle(submit("plain", max_tokens=400))
    stage.work()
    t0 = time.monotonic()
    stage.handle(protocol.AdapterPublish(name="ad", path=str(path), qid="q1", reply_to=b"c"))
    assert time.monotonic() - t0 < COLD_S / 2  # handling the message does not read the files
    token_times, answer = drive(stage, "q1", t0)
    assert isinstance(answer, protocol.AdapterLoaded) and answer.name == "ad"
    assert sum(t < COLD_S for t in token_times) >= 5  # tokens kept coming while the files were read
    assert stage.engine.adapters.latest("ad") is not None


def test_decoding_goes_on_while_a_weight_directory_is_read(stage, tmp_path):
    norm = stage.engine.model.model.norm.weight
    weights = tmp_path / "w"
    weights.mkdir()
    mx.save_safetensors(str(weights / "model.safetensors"), {"model.norm.weight": norm * 1.5})
    stage.handle(submit("plain", max_tokens=400))
    stage.work()
    t0 = time.monotonic()
    stage.handle(protocol.WeightsUpdate(path=str(weights), qid="q2", reply_to=b"c"))
    token_times, answer = drive(stage, "q2", t0)
    assert isinstance(answer, protocol.WeightsUpdated) and answer.version == 1 and answer.tensors == 1
    assert sum(t < COLD_S for t in token_times) >= 5


def test_a_read_that_times_out_is_answered_and_the_loop_never_waits(stage, tmp_path):
    model = tiny_model("llama")
    path = save_mlx(model, lora_model(model), tmp_path / "slow")
    stage.reads.timeout_s = COLD_S / 4
    stage.handle(protocol.AdapterPublish(name="slow", path=str(path), qid="q3", reply_to=b"c"))
    _, answer = drive(stage, "q3", time.monotonic())
    assert isinstance(answer, protocol.RequestError) and answer.code == "invalid_adapter_file"
    assert "longer than" in answer.message and str(tmp_path) not in answer.message
    assert stage.engine.adapters.latest("slow") is None


def test_a_path_outside_the_allowed_dirs_is_refused_at_once(stage):
    stage.handle(protocol.AdapterPublish(name="x", path=str(Path("/etc")), qid="q4", reply_to=b"c"))
    _, answer = drive(stage, "q4", time.monotonic(), seconds=1.0)
    assert isinstance(answer, protocol.RequestError) and answer.status == 403 and not stage.reads
