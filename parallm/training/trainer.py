"""The GRPO training loop: rollouts from the server, a LoRA step on MLX, a new version published.

    start:  load the base model + fresh LoRA (or resume the latest checkpoint), ask the engine for
            the adapter's latest version, publish the weights as the next one, wait until served
    step:   a batch of groups (requested, or read from the rollout stream)
            -> drop rollouts older than max_staleness versions (counted)
            -> rewards from the task, group-normalised advantages
            -> optional base-model logprobs for the KL (teacher-forced scoring on the server)
            -> GRPO update(s) -> publish version + 1 -> wait until the engine serves it
            -> metrics line, status to ingress, checkpoint every N steps

Version numbers only grow: a restarted trainer publishes max(checkpoint's, engine's latest) + 1,
so a version it published after its last checkpoint is never reused.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.optimizers as optim
import zmq

from parallm import protocol
from parallm.client import Client
from parallm.config import ModelConfig, TrainerConfig
from parallm.transport import Sender, open_socket

from . import checkpoint
from .grpo import GRPOUpdater, LossConfig, Sample, StepStats, group_advantages
from .memory import MemoryPlan, TrainerMemoryError, checkpoint_layers, make_plan
from .policy import Policy, load_policy
from .publisher import AdapterPublisher
from .tensorboard import EventWriter, scalars
from .atropos import AtroposRollouts
from .rollouts import GeneratedRollouts, Group, SubscribedRollouts
from .reward_model import WithRewardModel, with_reward_model
from .tasks import Task, load_task, score_group

log = logging.getLogger("parallm.trainer")

VERSION_WAIT_S = 60.0
PHASE_LEASE_S = 30.0  # an update phase the engine hears of lapses this long after the last micro-batch
PHASE_RENEW_S = 2.0   # renewed at most this often


class TrainerError(RuntimeError):
    """The trainer cannot go on (bad configuration, a version the engine refused, ...)."""


def _rng_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _set_rng_state(rng: random.Random, state: list) -> None:
    rng.setstate((state[0], tuple(state[1]), state[2]))


class Trainer:
    def __init__(self, config: TrainerConfig, *, router: str, model: ModelConfig, name: str = "trainer",
                 stop: threading.Event | None = None, progress: Callable[[], None] | None = None) -> None:
        self.cfg = config
        self.rl = config.rl_training
        self.router = router
        self.model_config = model
        self.name = name
        self.stop = stop or threading.Event()
        self.progress = progress or (lambda: None)
        self.step = 0
        self.version = 0
        self.totals: Counter[str] = Counter()
        self.staleness_hist: Counter[int] = Counter()
        self.resumed_from = ""
        self.last: dict[str, Any] = {}
        self.rng = random.Random(self.rl.seed)
        self._ctx = zmq.Context()
        self._phase_renewed = 0.0  # when the engine last heard that this trainer's update runs

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        self._check_config()
        self.task: Task = load_task(self.rl.task, self.rl.task_args)
        self.policy: Policy = load_policy(self.model_config, self.cfg.lora, seed=self.rl.seed)
        self._load_text()
        self.client = Client(self.router, timeout=self.cfg.server.timeout_s, identity=f"{self.name}-{os.getpid()}")
        self.plan = self._memory_plan()
        self.optimizer = optim.Adam(learning_rate=self.rl.learning_rate)
        self.optimizer.init(self.policy.model.trainable_parameters())
        loss_cfg = LossConfig(clip_low=self.rl.clip_low, clip_high=self.rl.clip_high, kl_coef=self.rl.kl_coef,
                              temperature=self.rl.temperature)
        self.updater = GRPOUpdater(self.policy.model, self.optimizer, loss_cfg, micro_batch=self.plan.micro_batch,
                                   max_grad_norm=self.rl.max_grad_norm, progress=self._micro_batch_done)
        self.task = with_reward_model(self.task, self.client, self.rl.reward_model, self.rl.task_reward_weight,
                                      self.rl.reward_model_weight)
        addrs = self.client.welcome.addresses
        self.publisher = AdapterPublisher(addrs["adapters"], ctx=self._ctx)
        self.status_out: Sender | None = None
        if addrs.get("training"):
            self.status_out = Sender(open_socket(self._ctx, zmq.PUSH, addrs["training"], bind=False, hwm=16))
        self.ckpt_dir = Path(self.cfg.checkpointing.dir)
        self.metrics_path = Path(self.cfg.checkpointing.metrics_file or self.ckpt_dir / "metrics.jsonl")
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        board = self.cfg.checkpointing.tensorboard_dir
        self.board: EventWriter | None = EventWriter(board) if board else None
        self._resume()
        served = int(self.client.policy().get(self.adapter, 0))
        self.version = max(self.version, served) + 1
        self._publish()
        if self.rl.rollout_source == "generate":
            self.source: GeneratedRollouts | SubscribedRollouts | AtroposRollouts = GeneratedRollouts(
                self.router, task=self.task, encode=self._encode, decode=self._decode, adapter=self.adapter,
                cfg=self.rl, timeout_s=self.cfg.server.timeout_s, rng=self.rng)
            self.source.start()
            for _ in range(self.rl.prefetch + 1):
                self.source.request()
        elif self.rl.rollout_source == "atropos":
            self.source = AtroposRollouts(self.rl.atropos_url, cfg=self.rl, decode=self._decode,
                                          score=self._score, version=lambda: self.version,
                                          checkpoint_dir=str(self.ckpt_dir), starting_step=self.step,
                                          timeout_s=self.cfg.server.timeout_s)
            self.source.register()
        else:
            self.source = SubscribedRollouts(addrs["rollouts"], adapter=self.adapter, decode=self._decode,
                                             group_size=self.rl.group_size,
                                             group_timeout_s=self.rl.subscribe_group_timeout_s, ctx=self._ctx)
        self.send_status("running")
        log.info("trainer ready: adapter %r version %d, %d trainable parameters, task %s%s", self.adapter,
                 self.version, self.policy.trainable_count(), self.rl.task,
                 f", resumed from {self.resumed_from}" if self.resumed_from else "")

    @property
    def adapter(self) -> str:
        return self.cfg.model.adapter

    def _micro_batch_done(self) -> None:
        """After every micro-batch of an update: the stage's heartbeat, and the update phase renewed."""
        self.progress()
        now = time.monotonic()
        if now - self._phase_renewed >= PHASE_RENEW_S:
            self.publisher.training_phase(self.name, True, PHASE_LEASE_S)
            self._phase_renewed = now

    def _check_config(self) -> None:
        rl = self.rl
        problems = []
        if rl.group_size < 2:
            problems.append("rl_training.group_size must be >= 2 (advantages are relative to the group)")
        if rl.prompts_per_step < 1:
            problems.append("rl_training.prompts_per_step must be >= 1")
        if rl.max_tokens < 1:
            problems.append("rl_training.max_tokens must be >= 1")
        if rl.temperature <= 0:
            problems.append("rl_training.temperature must be > 0 (GRPO needs sampled, not greedy, groups)")
        if rl.prefetch < 0:
            problems.append("rl_training.prefetch must be >= 0")
        if self.cfg.checkpointing.every_steps < 1 or self.cfg.checkpointing.keep_last < 1:
            problems.append("checkpointing.every_steps and keep_last must be >= 1")
        if not self.adapter:
            problems.append("model.adapter must name the adapter")
        if problems:
            raise TrainerError("; ".join(problems))

    def _memory_plan(self) -> MemoryPlan:
        """The memory plan (logged), micro_batch from the budget, per-layer checkpointing when planned."""
        mem = self.cfg.memory
        try:
            stats = self.client.stats()
            engine_kv = int(getattr(stats, "kv_capacity_tokens", 0)) * int(getattr(stats, "bytes_per_token", 0))
        except Exception as exc:  # noqa: BLE001 - the plan goes on without the engine's KV figure
            log.info("memory plan without the engine's KV (stats: %s)", exc)
            engine_kv = 0
        try:
            plan = make_plan(self.policy.model, trainable=self.policy.trainable_count(),
                             seq_len=mem.plan_seq_len or self.rl.max_tokens + 256, micro_batch=self.rl.micro_batch,
                             grad_checkpoint=mem.grad_checkpoint, budget_mb=mem.budget_mb, engine_kv=engine_kv)
        except TrainerMemoryError as exc:
            raise TrainerError(str(exc)) from None
        if plan.grad_checkpoint:
            checkpoint_layers(self.policy.model)
        log.info("memory plan (%s base): %s", self.policy.dtype, "; ".join(plan.lines()))
        return plan

    def _load_text(self) -> None:
        from transformers import AutoTokenizer

        from parallm.text.templating import Templater

        self.tokenizer = AutoTokenizer.from_pretrained(self.policy.source_path)
        self.templater = Templater(self.tokenizer, self.policy.max_model_len)

    def _encode(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt ids exactly as the server's tokenizer stage would make them."""
        submit = protocol.TextSubmit(rid="trainer", reply_to=b"", messages=messages, spec=protocol.RequestSpec(
            params=protocol.SamplingParams(max_tokens=self.rl.max_tokens)))
        return self.templater.encode(submit)

    def _decode(self, ids: Any) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _resume(self) -> None:
        if not self.cfg.checkpointing.resume:
            return
        found = checkpoint.latest(self.ckpt_dir)
        if found is None:
            return
        checkpoint.restore(found, self.policy.model, self.optimizer)
        self.step, self.version = found.step, found.version
        state = found.state
        if "rng" in state:
            _set_rng_state(self.rng, state["rng"])
        self.totals.update(state.get("totals", {}))
        self.staleness_hist.update({int(k): v for k, v in state.get("staleness_hist", {}).items()})
        self.resumed_from = str(found.path)
        self.totals["resumes"] += 1
        log.info("resumed from %s (step %d, version %d)", found.path, found.step, found.version)

    # ------------------------------------------------------------------ versions
    def _publish(self) -> None:
        """Publish the current weights as `self.version` and wait until the engine serves it."""
        t0 = time.perf_counter()
        self.publisher.publish(self.adapter, self.version, self.policy.adapter_weights(),
                               self.policy.adapter_config)
        deadline = time.monotonic() + VERSION_WAIT_S
        while True:
            served = int(self.client.policy().get(self.adapter, 0))
            if served >= self.version:
                break
            if time.monotonic() > deadline:
                raise TrainerError(f"the engine did not take {self.adapter!r} version {self.version} within "
                                   f"{VERSION_WAIT_S:.0f} s (it serves {served}; its log says why)")
            time.sleep(0.005)
        self.last_publish_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        """Train until `rl_training.steps` (0: until stopped); checkpoint on the way out."""
        try:
            while not self.stop.is_set() and (not self.rl.steps or self.step < self.rl.steps):
                t0 = time.perf_counter()
                groups = self._next_groups()
                if groups is None:
                    break
                self.train_step(groups, wait_s=time.perf_counter() - t0)
        except BaseException as exc:
            self.send_status("failed", f"{type(exc).__name__}: {exc}")
            raise
        else:
            if self.step and self.step % self.cfg.checkpointing.every_steps:
                self.save_checkpoint()
            self.send_status("stopped")
        finally:
            source = getattr(self, "source", None)
            if source is not None:
                source.close()
        return 0

    def _next_groups(self) -> list[Group] | None:
        if isinstance(self.source, GeneratedRollouts):
            while not self.stop.is_set():
                self.progress()
                try:
                    return self.source.get(timeout_s=0.5)
                except queue.Empty:
                    continue
            return None
        groups: list[Group] = []
        while len(groups) < self.rl.prompts_per_step and not self.stop.is_set():
            self.progress()
            groups += self.source.get(self.rl.prompts_per_step - len(groups), stop=self.stop)
        return groups or None

    def _keep_fresh(self, groups: list[Group]) -> list[Group]:
        """Drop completions sampled more than max_staleness versions ago; count every staleness."""
        limit = self.rl.max_staleness
        kept = []
        for group in groups:
            fresh = []
            for c in group.completions:
                staleness = max(0, self.version - c.oldest_version)
                if limit >= 0 and staleness > limit:
                    self.totals["rollouts_dropped_stale"] += 1
                    self.staleness_hist[staleness] += 1
                    continue
                self.staleness_hist[staleness] += 1
                fresh.append(c)
            if len(fresh) >= 2:
                group.completions = fresh
                kept.append(group)
            elif fresh:
                self.totals["rollouts_dropped_ungrouped"] += len(fresh)
        return kept

    def _samples(self, groups: list[Group]) -> tuple[list[Sample], list[float], int]:
        samples, rewards, flat = [], [], 0
        for group in groups:
            conversations = [group.messages + [{"role": "assistant", "content": c.text}] for c in group.completions]
            infos = [{**group.info, "finish_reason": c.finish_reason} for c in group.completions]
            group_rewards = group.scores if group.scores is not None else score_group(self.task, conversations, infos)
            advantages = group_advantages(group_rewards, scale=self.rl.scale_rewards)
            if max(group_rewards) == min(group_rewards):
                flat += 1
            for c, r, a in zip(group.completions, group_rewards, advantages):
                n = min(len(c.ids), len(c.logprobs))
                samples.append(Sample(prompt_ids=group.prompt_ids, completion_ids=c.ids[:n],
                                      sampler_logprobs=c.logprobs[:n], reward=r, advantage=a,
                                      version=c.oldest_version, text=c.text, finish_reason=c.finish_reason))
                rewards.append(r)
        return samples, rewards, flat

    def _score(self, ids: list[int], start: int) -> list[float]:
        """The server's teacher-forced logprobs of ids[start:] under the adapter being trained."""
        return self.client.score(ids, start=start, adapter=self.adapter)["logprobs"]

    def _reference_logprobs(self, samples: list[Sample]) -> None:
        for s in samples:
            if s.advantage == 0.0 or not s.completion_ids:
                continue
            ids = s.prompt_ids + s.completion_ids
            s.ref_logprobs = self.client.score(ids, start=len(s.prompt_ids))["logprobs"]

    def train_step(self, groups: list[Group], wait_s: float = 0.0) -> dict[str, Any]:
        t0 = time.perf_counter()
        received = sum(len(g.completions) for g in groups)
        generated_tokens = sum(g.tokens for g in groups)
        sampled_s = max((g.sampled_s for g in groups), default=0.0)
        groups = self._keep_fresh(groups)
        samples, rewards, flat = self._samples(groups)
        judged, judge_calls = self.task.take_scores() if isinstance(self.task, WithRewardModel) else ([], 0)
        if not any(s.advantage for s in samples):
            # nothing to learn from (every sample stale, or every group's rewards equal): no
            # optimizer step, no new version; ask for another batch
            self.totals["batches_without_signal"] += 1
            self.totals["rollouts_received"] += received
            if isinstance(self.source, GeneratedRollouts):
                self.source.request()
            log.info("batch without signal (%d groups kept from %d completions, %d with equal rewards); "
                     "sampling another", len(groups),
                     received, flat)
            self.send_status("running")
            return {}
        if self.rl.kl_coef:
            self._reference_logprobs(samples)
        self.progress()
        t_train = time.perf_counter()
        mx.reset_peak_memory()
        stats = StepStats()
        gap = (0.0, 0.0)
        self.publisher.training_phase(self.name, True, PHASE_LEASE_S)  # the engine leaves it its share
        self._phase_renewed = time.monotonic()
        try:
            for i in range(max(1, self.rl.updates_per_batch)):
                stats = self.updater.step(samples)
                if i == 0:  # before any update: the trainer's weights are the sampling version's (on-policy)
                    gap = (stats.logprob_gap_mean, stats.logprob_gap_max)
                self.progress()
        finally:
            self.publisher.training_phase(self.name, False)
        train_s = time.perf_counter() - t_train
        self.step += 1
        self.version += 1
        self._publish()
        if isinstance(self.source, GeneratedRollouts):
            self.source.request()
        self.totals["rollouts_received"] += received
        self.totals["rollouts_trained"] += len(samples)
        self.totals["tokens_trained"] += stats.tokens
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else 0.0
        lengths = [len(s.completion_ids) for s in samples]
        self.last = {
            "step": self.step, "version": self.version, "time": time.time(),
            "loss": stats.loss, "reward_mean": mean, "reward_std": std,
            "reward_model_mean": sum(judged) / len(judged) if judged else None,  # rl_training.reward_model's part
            "reward_model_batches": judge_calls,
            "kl": stats.kl if self.rl.kl_coef else None,
            "clip_fraction": stats.clip_fraction, "ratio_mean": stats.ratio_mean, "grad_norm": stats.grad_norm,
            "logprob_gap_mean": gap[0], "logprob_gap_max": gap[1], "dtype": self.policy.dtype,
            "peak_memory_mb": mx.get_peak_memory() / 2 ** 20, "micro_batch": self.plan.micro_batch,
            "samples": len(samples), "groups": len(groups), "groups_without_signal": flat,
            "completion_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "tokens_trained": stats.tokens, "generated_tokens": generated_tokens,
            "rollout_tokens_per_s": generated_tokens / sampled_s if sampled_s else 0.0,
            "train_tokens_per_s": stats.tokens / train_s if train_s else 0.0,
            "train_s": train_s, "publish_s": self.last_publish_s, "step_s": time.perf_counter() - t0,
            "rollout_wait_s": wait_s,
            "rollouts_dropped_stale": self.totals["rollouts_dropped_stale"],
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
        }
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(self.last) + "\n")
        if self.board is not None:
            self.board.add_scalars(self.step, scalars(self.last), wall_time=self.last["time"])
        log.info("step %d v%d: reward %.3f±%.3f%s loss %.4f%s len %.1f (%.1f s + %.1f s waiting for rollouts)",
                 self.step, self.version, mean, std,
                 f" (reward model {self.last['reward_model_mean']:.3f} over {len(judged)} in {judge_calls} batches)"
                 if judged else "", stats.loss, f" kl {stats.kl:.4f}" if self.rl.kl_coef else "",
                 self.last["completion_len_mean"], self.last["step_s"], wait_s)
        if self.step % self.cfg.checkpointing.every_steps == 0:
            self.save_checkpoint()
        self.send_status("running")
        return self.last

    # ------------------------------------------------------------------ checkpoints and status
    def save_checkpoint(self) -> Path:
        path = checkpoint.save(
            self.ckpt_dir, self.step, weights=self.policy.adapter_weights(),
            adapter_config={**self.policy.adapter_config, "base_model": self.policy.source_path},
            optimizer=self.optimizer, keep_last=self.cfg.checkpointing.keep_last,
            state={"version": self.version, "adapter": self.adapter, "rng": _rng_state(self.rng),
                   "totals": dict(self.totals),
                   "staleness_hist": {str(k): v for k, v in self.staleness_hist.items()}})
        log.info("checkpoint %s", path)
        return path

    def status(self, state: str, error: str = "") -> protocol.TrainingStatus:
        return protocol.TrainingStatus(
            trainer=self.name, adapter=self.adapter, state=state, step=self.step, version=self.version,  # type: ignore[arg-type]
            steps_planned=self.rl.steps, last=dict(self.last), totals=dict(self.totals),
            staleness_hist={str(k): v for k, v in sorted(self.staleness_hist.items())},
            resumed_from=self.resumed_from, error=error, updated_at=time.time())

    def send_status(self, state: str, error: str = "") -> None:
        if self.status_out is None:
            return
        self.status_out.send(self.status(state, error), block=False)

    def close(self) -> None:
        """Close every socket (a `run()` already closed the rollout source; closing twice is fine)."""
        source = getattr(self, "source", None)
        if source is not None:
            source.close()
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        publisher = getattr(self, "publisher", None)
        if publisher is not None:
            publisher.close(linger_ms=1000)
        if getattr(self, "board", None) is not None:
            self.board.close()
            self.board = None
        if getattr(self, "status_out", None) is not None:
            self.status_out.sock.close(linger=500)  # let the final "stopped" status leave
        self._ctx.destroy(linger=0)
