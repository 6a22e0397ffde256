"""The RL loop learns: parallm-launch with its supervised trainer on the built-in length task, and
the mean reward rises clearly within a bounded number of steps (about 6 minutes on 2 CPU cores)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from .server import Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "train_length_cpu.toml"
STEPS = 24


@pytest.mark.timeout(1800)  # its own deadline below (1500 s) is the bound; pytest-timeout's 600 s default cut it
def test_mean_reward_rises_within_24_steps(tmp_path):
    ckpt = tmp_path / "ckpt"
    metrics = ckpt / "metrics.jsonl"
    with Server("--config", str(CONFIG), "--trainer.checkpointing.dir", str(ckpt),
                "--trainer.rl-training.steps", str(STEPS)) as srv:
        deadline = time.monotonic() + 1500
        while True:
            trainers = httpx.get(f"{srv.url}/v1/training/status", timeout=10).json()["trainers"]
            if trainers and trainers[0]["state"] == "stopped":
                break
            assert time.monotonic() < deadline, srv.output()
            time.sleep(2)
        status = trainers[0]
        policy = httpx.get(f"{srv.url}/v1/policy", timeout=10).json()["versions"]
        finished_by = time.monotonic() + 60  # the status is sent just before the process exits
        while not any("trainer finished" in line for line in srv.lines):
            assert time.monotonic() < finished_by, srv.output()
            time.sleep(0.5)
        assert "trainer" not in srv.stage_pids()        # exit 0 after its steps: not restarted
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= first + 0.25 and last >= 0.55, rewards
    assert [r["version"] for r in rows] == list(range(rows[0]["version"], rows[0]["version"] + STEPS))
    assert status["step"] == STEPS and policy["policy"] == rows[-1]["version"]
    assert all(0.98 < r["ratio_mean"] < 1.02 for r in rows), [r["ratio_mean"] for r in rows]
