"""The engine stage's own cost per step, without MLX: a fake engine that returns `--batch`
outputs per step drives `EngineStage.run()`; a thread drains the detokenizer socket. What is
left per loop iteration is the stage's polling, encoding, sending and heartbeat work.

    PYTHONPATH=$PWD python -m perf.profile_stage_loop --batch 1,256 --steps 5000   # -> perf/results/stage-loop-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import zmq

from parallm.config import build_config
from parallm.engine.request import SeqOutput
from parallm.protocol import EngineStats
from parallm.runtime import StageRuntime
from parallm.transport import open_socket
from perf.harness import Results, add_results_options


class FakeEngine:
    """Returns `batch` one-token outputs per step; the stage shuts down after `steps` steps."""

    def __init__(self, rt: StageRuntime, batch: int, steps: int) -> None:
        self.rt, self.batch, self.steps, self.n = rt, batch, steps, 0
        self.last_batch_size = batch
        self.rids = [f"{i:032x}" for i in range(batch)]

    def has_work(self) -> bool:
        return True

    def owes_outputs(self) -> bool:
        return False

    def step(self, emit: object = None) -> list[SeqOutput]:
        self.n += 1
        if self.n >= self.steps:
            self.rt.shutting_down = True
        return [SeqOutput(rid=rid, index=0, token_ids=[self.n], adapter="", version=0) for rid in self.rids]

    def request_ids(self) -> list[str]:
        return []

    def stats(self) -> EngineStats:
        return EngineStats()


def measure(batch: int, steps: int) -> dict:
    from parallm.stages.engine import EngineStage

    config = build_config(environ={}, overrides={"transport": {"run_dir": tempfile.mkdtemp(prefix="stage-loop-")}})
    ctx = zmq.Context()
    rt = StageRuntime(config, "engine", ctx=ctx)
    detok = open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True)
    received = [0]

    def sink() -> None:
        while received[0] < steps - 1 and detok.poll(2000):
            detok.recv()
            received[0] += 1

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    stage = EngineStage(config, rt, FakeEngine(rt, batch, steps), {})
    t0 = time.perf_counter()
    stage.run()
    wall = time.perf_counter() - t0
    thread.join(10)
    split = {k: round(1000 * v, 4) for k, v in stage.stats().loop.ms_mean.items()}  # ms -> us
    # the context stays open: the runtime's heartbeat thread still holds a socket of it
    return {"batch": batch, "steps": steps, "us_per_iteration": round(1e6 * wall / steps, 2),
            "stage_us_mean": split, "received": received[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,256")
    parser.add_argument("--steps", type=int, default=5000)
    add_results_options(parser)
    args = parser.parse_args(argv)
    result = {"loadavg_at_start": os.getloadavg(), "runs": []}
    for b in [int(x) for x in args.batch.split(",")]:
        result["runs"].append(measure(b, args.steps))
        print(json.dumps(result["runs"][-1]), flush=True)
    result["loadavg_at_end"] = os.getloadavg()
    Results.from_args("stage-loop", args, argv).write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
