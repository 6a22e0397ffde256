"""parallm-train against the real server: supervised trainer killed and resumed while HTTP keeps
serving; stale rollouts from the rollout stream dropped and counted; status on ingress."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from parallm.client import Client
from parallm.config import (CheckpointConfig, LoRATrainConfig, ModelConfig, RLTrainingConfig, TrainerConfig,
                            TrainerModelConfig)
from parallm.protocol import SamplingParams
from parallm.training import checkpoint
from parallm.training.trainer import Trainer

from .server import Server

pytestmark = pytest.mark.e2e

SMALL_TRAINER = ("--trainer.enabled", "true", "--trainer.rl-training.prompts-per-step", "1",
                 "--trainer.rl-training.group-size", "4", "--trainer.rl-training.max-tokens", "8",
                 "--trainer.lora.num-layers", "2", "--trainer.lora.rank", "4",
                 "--trainer.checkpointing.every-steps", "1", "--trainer.checkpointing.keep-last", "2")


def training_status(url: str) -> dict:
    body = httpx.get(f"{url}/v1/training/status", timeout=10).json()
    assert body["object"] == "training.status"
    return body


def wait_for(predicate, timeout: float, what: str, server: Server):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}:\n{server.output()}")


SECOND_TRAINER = """
[[trainers]]
enabled = true
model = {{ adapter = "arith" }}
lora = {{ rank = 4, num_layers = 2 }}
rl_training = {{ task = "arithmetic", prompts_per_step = 1, group_size = 4, max_tokens = 8, learning_rate = 1e-3 }}
checkpointing = {{ dir = "{dir}", every_steps = 1, keep_last = 2, tensorboard_dir = "{dir}/tb" }}
"""


@pytest.mark.slow  # 155 s of `make test`'s 858 s on the 2-core host of 2026-11-30
def test_supervised_trainers_two_at_once_one_killed_resumes_with_increasing_versions_while_serving(tmp_path):
    """[trainer] (the length task on adapter 'policy') and a [[trainer]] entry (arithmetic on 'arith') run at
    once, each publishing its own versions, with their own status and metrics; the first is killed and
    resumes from its checkpoint while HTTP keeps serving."""
    ckpt = tmp_path / "ckpt"
    second = tmp_path / "second.toml"
    second.write_text(SECOND_TRAINER.format(dir=tmp_path / "ckpt-arith"))
    with Server("--config", str(second), *SMALL_TRAINER, "--trainer.checkpointing.dir", str(ckpt),
                "--engine.training-share", "0.5") as srv:
        def trainer_at(step: int, name: str = "trainer"):
            trainers = {t["trainer"]: t for t in training_status(srv.url)["trainers"]}
            found = trainers.get(name)
            return found if found and found["step"] >= step else None

        before = wait_for(lambda: trainer_at(2), 240, "two training steps", srv)
        assert before["adapter"] == "policy" and before["state"] == "running"
        arith = wait_for(lambda: trainer_at(1, "trainer-arith"), 240, "a step of the second trainer", srv)
        assert arith["adapter"] == "arith" and arith["version"] == arith["step"] + 1
        versions = httpx.get(f"{srv.url}/v1/policy", timeout=10).json()["versions"]
        assert versions["arith"] >= arith["version"] and versions["policy"] >= before["version"]
        assert 'parallm_training_step{adapter="arith",trainer="trainer-arith"}' in \
            httpx.get(f"{srv.url}/metrics", timeout=10).text
        [board] = (tmp_path / "ckpt-arith" / "tb").glob("events.out.tfevents.*")   # its TensorBoard file
        assert board.stat().st_size > 100
        assert before["version"] == before["step"] + 1          # version 1 = the initial weights
        assert {"loss", "reward_mean", "reward_std", "rollout_tokens_per_s"} <= set(before["last"])
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert 'parallm_training_step{adapter="policy",trainer="trainer"}' in metrics
        assert "parallm_training_staleness_bucket" in metrics
        phases = [line for line in metrics.splitlines() if line.startswith("parallm_training_phases_total ")]
        assert phases and float(phases[0].split()[1]) >= 3  # both trainers' updates reached the engine

        served, errors, stop = [], [], threading.Event()

        def keep_asking() -> None:
            with httpx.Client(base_url=srv.url, timeout=120) as http:
                while not stop.is_set():
                    r = http.post("/v1/chat/completions", json={
                        "model": "SmolLM2-135M-Instruct", "max_tokens": 4,
                        "messages": [{"role": "user", "content": "Say hi"}]})
                    (served if r.status_code == 200 else errors).append(r.status_code)

        asker = threading.Thread(target=keep_asking, daemon=True)
        asker.start()
        pid = srv.stage_pids()["trainer"]
        killed_at = trainer_at(0)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: srv.stage_pids().get("trainer", pid) != pid, 60, "the trainer's restart", srv)
        saved = checkpoint.latest(ckpt)
        assert saved is not None and saved.step >= killed_at["step"] - 1

        after = wait_for(lambda: (lambda t: t if t and t["resumed_from"] and t["step"] > killed_at["step"] else None)(
            trainer_at(0)), 240, "a step after the resume", srv)
        stop.set()
        asker.join(timeout=120)
        # resumed from the checkpoint, with versions above any the killed trainer published
        assert after["resumed_from"].startswith(str(ckpt))
        assert after["totals"]["resumes"] >= 1
        assert after["version"] > killed_at["version"]
        policy = httpx.get(f"{srv.url}/v1/policy", timeout=10).json()["versions"]
        assert policy["policy"] >= after["version"]
        assert errors == [] and len(served) >= 3, (errors, len(served))
        assert "StageDown" not in srv.output()
        assert any("trainer" in line and "restart" in line for line in srv.lines)


def test_rollouts_older_than_max_staleness_are_not_trained_on_and_are_counted(server, tmp_path):
    config = TrainerConfig(
        model=TrainerModelConfig(path="default", adapter="staleness-probe"),
        lora=LoRATrainConfig(rank=4, num_layers=2),
        rl_training=RLTrainingConfig(rollout_source="subscribe", prompts_per_step=1, group_size=4, max_tokens=8,
                                     max_staleness=0, learning_rate=1e-3, subscribe_group_timeout_s=10),
        checkpointing=CheckpointConfig(dir=str(tmp_path / "ck"), every_steps=100))
    trainer = Trainer(config, router=server.router, model=ModelConfig(path="default"), name="probe")
    trainer.setup()
    try:
        first = trainer.version
        time.sleep(0.5)  # the rollout SUB connects
        prompt = trainer._encode([{"role": "user", "content": "Describe rain in 5 words."}])
        with Client(server.router) as client:
            # fresh: sampled under the version the trainer just published
            for seed in range(1, 20):  # until a group's rewards differ (equal rewards carry no signal)
                client.generate(prompt, SamplingParams(max_tokens=8, logprobs=True, seed=seed), n=4,
                                adapter="staleness-probe")
                if trainer.train_step(trainer._next_groups()):
                    break
            assert trainer.version == first + 1 and trainer.totals["rollouts_trained"] == 4
            assert trainer.totals["rollouts_dropped_stale"] == 0
            # stale: pinned to the version before the trainer's last step
            client.generate(prompt, SamplingParams(max_tokens=8, logprobs=True, seed=99), n=4,
                            adapter="staleness-probe", adapter_version=first)
            assert trainer.train_step(trainer._next_groups()) == {}
        assert trainer.totals["rollouts_dropped_stale"] == 4
        assert trainer.totals["rollouts_trained"] == 4 and trainer.version == first + 1
        assert trainer.staleness_hist[1] == 4
        status = wait_for(lambda: next((t for t in training_status(server.url)["trainers"]
                                        if t["trainer"] == "probe" and t["totals"].get("rollouts_dropped_stale")), None),
                          20, "the probe's status on ingress", server)
        assert status["totals"]["rollouts_dropped_stale"] == 4 and status["staleness_hist"]["1"] == 4
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'parallm_training_rollouts_stale_dropped_total{adapter="staleness-probe",trainer="probe"} 4.0' in metrics
    finally:
        trainer.close()


def test_a_served_reward_model_is_the_trainers_reward(server, http, tmp_path):
    """parallm-train's rl_training.reward_model on the session server's `rm` (a random-weight
    LlamaForSequenceClassification beside the default model): the trainer's own rollouts are scored in one
    pool() batch per group over its ZeroMQ connection, each sample's reward is 0.5 x the length task's +
    2.0 x /v1/rewards' score of the same conversation, and the step's metrics report the model's part."""
    rl = RLTrainingConfig(prompts_per_step=1, group_size=4, max_tokens=8, learning_rate=1e-3, seed=5,
                          reward_model="rm", task_reward_weight=0.5, reward_model_weight=2.0)
    config = TrainerConfig(model=TrainerModelConfig(path="default", adapter="rm-probe"),
                           lora=LoRATrainConfig(rank=4, num_layers=2), rl_training=rl,
                           checkpointing=CheckpointConfig(dir=str(tmp_path / "ck"), every_steps=100))
    trainer = Trainer(config, router=server.router, model=ModelConfig(path="default"), name="rm-probe")
    trainer.setup()
    try:
        groups = trainer._next_groups()
        samples, rewards, _ = trainer._samples(groups)
        judged, calls = trainer.task.take_scores()
        assert calls == 1 and len(judged) == len(samples) == 4
        group = groups[0]
        convs = [group.messages + [{"role": "assistant", "content": c.text}] for c in group.completions]
        served = [d["reward"] for d in http.post("/v1/rewards", json={"model": "rm", "messages": convs}).json()["data"]]
        task = trainer.task.task.score(convs, [{**group.info, "finish_reason": c.finish_reason}
                                               for c in group.completions])
        assert judged == pytest.approx(served, abs=1e-5)
        assert rewards == pytest.approx([0.5 * t + 2.0 * r for t, r in zip(task, served)], abs=1e-5)
        for _ in range(5):  # a step (a group whose rewards differ: a random reward model's almost always do)
            last = trainer.train_step(groups)
            if last:
                break
            groups = trainer._next_groups()
        assert last and last["reward_model_batches"] == 1 and last["reward_model_mean"] is not None
        line = json.loads((tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()[-1])
        assert line["reward_model_mean"] == pytest.approx(last["reward_model_mean"])
    finally:
        trainer.close()
