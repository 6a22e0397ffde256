"""Rollouts from Atropos (NousResearch/atropos; atroposlib 0.4.0's run-api): the trainer side of its API.

`parallm-train --rl-training.rollout-source atropos` registers with the run-api (POST /register, as
Atropos' example trainer does) and polls GET /batch. A batch is a list of `ScoredData` groups that
Atropos environments posted: `tokens` (prompt + completion per sequence), `masks` (-100 on the
prompt, the token id where trained), `scores`, and optionally `inference_logprobs`. The
environments sample through any server (this one's /generate in the vllm or sglang shape, or the
OpenAI routes); the rewards are theirs, so the trainer's task is not used for scoring.

- sampler logprobs: a sequence's `inference_logprobs` when given (per token of `tokens`, or per
  completion token), else this server's teacher-forced logprobs under the policy being trained;
- policy versions: Atropos does not say which version sampled a group, so a batch counts as
  sampled by the version current when it arrives (staleness 0).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from parallm.config import RLTrainingConfig

from .rollouts import Completion, Decode, Group

log = logging.getLogger("parallm.trainer")

Score = Callable[[list[int], int], list[float]]   # (ids, start) -> logprobs of ids[start:]


class AtroposError(RuntimeError):
    pass


class AtroposRollouts:
    def __init__(self, url: str, *, cfg: RLTrainingConfig, decode: Decode, score: Score,
                 version: Callable[[], int], checkpoint_dir: str, starting_step: int = 0,
                 timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.cfg, self.decode, self.score, self.version = cfg, decode, score, version
        self.checkpoint_dir, self.starting_step, self.timeout_s = checkpoint_dir, starting_step, timeout_s
        self.batches = 0
        self.skipped = 0     # sequences without a trained token, or with another prompt than their group's
        self.uuid: int | None = None

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read() or b"null")

    def register(self, wait_s: float = 120.0) -> int:
        """POST /register once the run-api answers GET /info (it may still be starting)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._call("GET", "/info")
                break
            except (urllib.error.URLError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise AtroposError(f"the Atropos run-api at {self.url} did not answer within {wait_s:g} s: "
                                       f"{exc}") from None
                time.sleep(1.0)
        cfg = self.cfg
        reply = self._call("POST", "/register", {
            "wandb_group": "", "wandb_project": "", "batch_size": cfg.prompts_per_step * cfg.group_size,
            "max_token_len": cfg.max_tokens * 4 + 512, "checkpoint_dir": self.checkpoint_dir,
            "save_checkpoint_interval": 0, "starting_step": self.starting_step, "num_steps": cfg.steps or 10**9})
        self.uuid = int(reply["uuid"]) if isinstance(reply, dict) and "uuid" in reply else None
        log.info("registered with the Atropos run-api at %s (trainer %s)", self.url, self.uuid)
        return self.uuid or 0

    def get(self, groups: int, *, stop: threading.Event | None = None) -> list[Group]:
        """The next batch from the run-api (however many groups it holds), polling until one is
        ready or `stop` is set (then an empty list)."""
        while not (stop is not None and stop.is_set()):
            reply = self._call("GET", "/batch")
            batch = reply.get("batch") if isinstance(reply, dict) else None
            if isinstance(reply, dict) and reply.get("status") == "error":
                raise AtroposError(f"the Atropos run-api refused /batch: {reply.get('message')}")
            if batch:
                self.batches += 1
                return [g for g in (self._group(item) for item in batch) if g is not None]
            time.sleep(self.cfg.atropos_poll_s)
        return []

    def _group(self, data: dict[str, Any]) -> Group | None:
        tokens, masks, scores = data.get("tokens") or [], data.get("masks") or [], data.get("scores") or []
        inference = data.get("inference_logprobs") or [None] * len(tokens)
        prompt: list[int] | None = None
        completions, rewards = [], []
        for ids, mask, score, lps in zip(tokens, masks, scores, inference):
            start = next((i for i, m in enumerate(mask) if m != -100), len(ids))
            if start >= len(ids) or (prompt is not None and ids[:start] != prompt):
                self.skipped += 1
                continue
            prompt = list(ids[:start])
            completion = list(ids[start:])
            if lps is not None and len(lps) == len(ids):
                logprobs = [float(x) for x in lps[start:]]
            elif lps is not None and len(lps) == len(completion):
                logprobs = [float(x) for x in lps]
            else:
                logprobs = self.score(list(ids), start)
            completions.append(Completion(ids=completion, logprobs=logprobs, versions=[(0, self.version())],
                                          finish_reason="stop", text=self.decode(completion)))
            rewards.append(float(score))
        if prompt is None or len(completions) < 2:
            self.skipped += len(completions)
            return None
        messages = data.get("messages")
        conversation = messages[0] if isinstance(messages, list) and messages and isinstance(messages[0], list) \
            else [{"role": "user", "content": self.decode(prompt)}]
        return Group(messages=conversation[:-1] if conversation and conversation[-1].get("role") == "assistant"
                     else conversation, info={"env_id": data.get("env_id")}, prompt_ids=prompt,
                     completions=completions, scores=rewards)

    def close(self) -> None:
        pass
