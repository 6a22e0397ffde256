"""The trainer's parts without a server: tasks, advantages, the GRPO update, checkpoints, config."""

from __future__ import annotations

import json
from pathlib import Path
import random
import textwrap

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest

from parallm.config import ConfigError, LoRATrainConfig, ModelConfig, build_config, build_trainer_config
from parallm.training import checkpoint
from parallm.training.grpo import GRPOUpdater, LossConfig, Sample, group_advantages, make_batch, token_logprobs
from parallm.training.tasks import ArithmeticTask, JsonTask, LengthTask, TaskError, load_task, score_group


def convo(user: str, reply: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


# ----------------------------------------------------------------------------- tasks

def test_arithmetic_rewards_the_right_last_number_and_rebuilds_the_answer_from_the_prompt():
    task = ArithmeticTask(max_operand=9, operators="+-*")
    prompt = task.sample(random.Random(1))
    answer = prompt.info["answer"]
    user = prompt.messages[0]["content"]
    assert task.score([convo(user, f"It is {answer}"), convo(user, f"{answer + 1}"), convo(user, "no idea")],
                      [prompt.info] * 3) == [1.0, 0.0, 0.0]
    # a rollout from another client arrives without info: the question in the prompt text is enough
    assert task.score([convo("What is 7 * 6? Reply with the number only.", "42")], [{}]) == [1.0]


def test_length_task_peaks_at_the_target_and_gives_nothing_to_cut_off_replies():
    task = LengthTask(target_words=4)
    user = task.sample(random.Random(0)).messages[0]["content"]
    scores = task.score([convo(user, "one two three four"), convo(user, "one two"),
                         convo(user, "w " * 12), convo(user, "one two three four")],
                        [{}, {}, {}, {"finish_reason": "length"}])
    assert scores == [1.0, 0.5, 0.0, 0.0]


def test_json_task_exact_match_partial_for_other_json():
    task = JsonTask()
    prompt = task.sample(random.Random(3))
    user, expected = prompt.messages[0]["content"], prompt.info["expected"]
    exact = "```json\n" + json.dumps(expected) + "\n```"
    assert task.score([convo(user, exact), convo(user, '{"name": "x"}'), convo(user, "name: x")],
                      [{}, {}, {}]) == [1.0, 0.25, 0.0]


class ConstantTask:
    """A user task: module:attr with arguments."""

    def __init__(self, value: float = 1.0) -> None:
        self.value = value

    def sample(self, rng):
        from parallm.training.tasks import TaskPrompt

        return TaskPrompt([{"role": "user", "content": "hi"}])

    def score(self, conversations, infos):
        return [self.value] * len(conversations)


def test_load_task_builtin_callable_path_and_errors():
    assert isinstance(load_task("length", {"target_words": 3}), LengthTask)
    task = load_task(f"{__name__}:ConstantTask", {"value": 0.5})
    assert score_group(task, [convo("hi", "a")], [{}]) == [0.5]
    with pytest.raises(TaskError, match="unknown task"):
        load_task("chess")
    with pytest.raises(TaskError, match="No module named"):
        load_task("no_such_module_xyz:Task")
    with pytest.raises(TaskError, match="rejected its arguments"):
        load_task("length", {"bogus": 1})
    with pytest.raises(TaskError, match="lacks sample"):
        load_task("json:JSONDecoder")
    with pytest.raises(TaskError, match="non-finite"):
        score_group(load_task(f"{__name__}:ConstantTask", {"value": float("nan")}), [convo("a", "b")], [{}])


# ----------------------------------------------------------------------------- GRPO

def test_group_advantages_are_centred_and_scaled():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-3)
    assert group_advantages([0.5, 0.5]) == [0.0, 0.0]
    assert group_advantages([2.0, 0.0], scale=False) == [1.0, -1.0]


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def __call__(self, ids: mx.array) -> mx.array:
        return self.head(nn.gelu(self.proj(self.embed(ids))))


def test_make_batch_aligns_targets_with_completion_tokens():
    batch = make_batch([Sample([1, 2, 3], [4, 5], [-0.1, -0.2], advantage=1.0),
                        Sample([1], [6, 7, 8], [-1.0, -2.0, -3.0], advantage=-1.0)])
    assert batch.inputs.tolist() == [[1, 2, 3, 4], [1, 6, 7, 0]]
    assert batch.targets.tolist() == [[2, 3, 4, 5], [6, 7, 8, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert batch.old_logprobs.tolist()[1][:3] == pytest.approx([-1.0, -2.0, -3.0])


def test_grpo_step_raises_the_logprob_of_the_rewarded_completion():
    mx.random.seed(0)
    model = TinyLM()
    mx.eval(model.parameters())
    prompt = [1, 2]
    good, bad = [3, 4, 5], [6, 7, 8]

    def logprob(ids: list[int]) -> float:
        full = prompt + ids
        lp = token_logprobs(model, mx.array([full[:-1]]), mx.array([full[1:]]))
        return lp[0, len(prompt) - 1:].sum().item()

    def sampler_lps(ids: list[int]) -> list[float]:
        full = prompt + ids
        return token_logprobs(model, mx.array([full[:-1]]), mx.array([full[1:]]))[0, len(prompt) - 1:].tolist()

    before = logprob(good) - logprob(bad)
    updater = GRPOUpdater(model, optim.Adam(learning_rate=1e-2), LossConfig(), micro_batch=1)
    for _ in range(5):
        samples = [Sample(prompt, good, sampler_lps(good), reward=1.0), Sample(prompt, bad, sampler_lps(bad), reward=0.0)]
        for s, a in zip(samples, group_advantages([s.reward for s in samples])):
            s.advantage = a
        stats = updater.step(samples)
        assert stats.tokens == 6 and stats.ratio_mean == pytest.approx(1.0, abs=1e-4)
    assert logprob(good) - logprob(bad) > before + 1.0


def test_ratio_is_clipped_for_stale_samples():
    """A sample whose sampler logprobs are far below the current model's: its ratio is clipped
    (positive advantage, ratio > 1 + clip_high), so it contributes no gradient and is counted."""
    mx.random.seed(1)
    model = TinyLM()
    mx.eval(model.parameters())
    s = Sample([1, 2], [3, 4], [-30.0, -30.0], advantage=1.0)
    stats = GRPOUpdater(model, optim.SGD(learning_rate=0.1), LossConfig()).step([s])
    assert stats.clip_fraction == 1.0
    assert stats.grad_norm == 0.0


# ----------------------------------------------------------------------------- checkpoints

@pytest.mark.slow  # 14 s: make test's 10-minute budget (clean clone, 2-core CI host)
def test_checkpoints_load_in_mlx_lm_and_restore_and_prune(tmp_path):
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model as mlx_lm_load

    from parallm.training.policy import load_policy

    lora = LoRATrainConfig(rank=4, num_layers=2)
    policy = load_policy(ModelConfig(path="default"), lora)
    # give the adapter a visible effect (B starts at zero)
    for name, value in policy.adapter_weights().items():
        if name.endswith("lora_b"):
            policy.model.load_weights([(name, mx.random.normal(value.shape) * 0.05)], strict=False)
    optimizer = optim.Adam(learning_rate=1e-3)
    optimizer.init(policy.model.trainable_parameters())
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, weights=policy.adapter_weights(), adapter_config=policy.adapter_config,
                        optimizer=optimizer, state={"version": step + 10}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]
    found = checkpoint.latest(tmp_path)
    assert found.step == 4 and found.version == 14

    ids = mx.array([[1, 504, 3458, 282]])
    ours = policy.model(ids)
    model, _ = mlx_lm_load(Path(policy.source_path))
    from parallm.models.dtype import apply_dtype

    apply_dtype(model, "float32")
    load_adapters(model, str(found.path))
    assert mx.allclose(model(ids), ours, atol=1e-4).item()

    fresh = load_policy(ModelConfig(path="default"), lora)
    checkpoint.restore(found, fresh.model, optim.Adam(learning_rate=1e-3))
    assert mx.allclose(fresh.model(ids), ours, atol=1e-5).item()
    other = load_policy(ModelConfig(path="default"), LoRATrainConfig(rank=8, num_layers=2))
    with pytest.raises(ValueError, match="does not fit"):
        checkpoint.restore(found, other.model, optim.Adam(learning_rate=1e-3))


# ----------------------------------------------------------------------------- config

def test_trainer_config_from_its_own_file_or_a_launch_file(tmp_path):
    own = tmp_path / "train.toml"
    own.write_text(textwrap.dedent("""
        [server]
        router = "tcp://127.0.0.1:5552"
        [rl_training]
        task = "arithmetic"
        task_args = { max_operand = 5 }
        group_size = 4
        [checkpointing]
        dir = "ck"
    """))
    config = build_trainer_config(file=own, environ={"PARALLM_TRAINER__RL_TRAINING__STEPS": "7"})
    assert (config.server.router, config.rl_training.task, config.rl_training.task_args) == \
        ("tcp://127.0.0.1:5552", "arithmetic", {"max_operand": 5})
    assert config.rl_training.steps == 7 and config.checkpointing.dir == "ck"

    launch = tmp_path / "launch.toml"
    launch.write_text(textwrap.dedent("""
        [engine]
        max_num_seqs = 8
        [trainer]
        enabled = true
        [trainer.lora]
        rank = 16
        keys = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    """))
    assert build_trainer_config(file=launch, environ={}).lora.rank == 16
    full = build_config(file=launch, environ={})
    assert full.trainer.enabled and full.trainer.lora.keys[1] == "self_attn.k_proj"
    bad = tmp_path / "bad.toml"
    bad.write_text("[rl_training]\ngroup_size = 'many'\n")
    with pytest.raises(ConfigError, match="group_size"):
        build_trainer_config(file=bad, environ={})


def test_several_trainers_from_trainer_array_entries_each_named_and_apart(tmp_path):
    from parallm.config import enabled_trainers

    launch = tmp_path / "two.toml"
    launch.write_text(textwrap.dedent("""
        [[trainer]]
        enabled = true
        model = { adapter = "len" }
        rl_training = { task = "length" }
        checkpointing = { dir = "ck/len" }
        [[trainer]]
        enabled = true
        name = "arith"
        model = { adapter = "arith" }
        rl_training = { task = "arithmetic" }
        checkpointing = { dir = "ck/arith" }
        [[trainer]]
        model = { adapter = "off" }
    """))
    config = build_config(file=launch, environ={})
    assert not config.trainer.enabled and len(config.trainers) == 3
    names = [(t.name, t.model.adapter, t.rl_training.task) for t in enabled_trainers(config)]
    assert names == [("trainer-len", "len", "length"), ("arith", "arith", "arithmetic")]
    with pytest.raises(ConfigError, match="3 \\[\\[trainer\\]\\] entries"):
        build_trainer_config(file=launch, environ={})
    clash = tmp_path / "clash.toml"
    clash.write_text(textwrap.dedent("""
        [trainer]
        enabled = true
        [[trainers]]
        enabled = true
        checkpointing = { dir = "checkpoints/policy" }
    """))
    with pytest.raises(ConfigError, match="share model.adapter 'policy'.*share checkpointing.dir"):
        build_config(file=clash, environ={})
