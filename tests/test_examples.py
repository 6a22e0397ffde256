"""Every example configuration in examples/ loads through parallm.config as a user's file would,
and says what its comments say it does: a renamed or removed setting fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallm.config import Config, TrainerConfig, build_config, build_trainer_config
from parallm.training.tasks import load_task

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LAUNCH_FILES = sorted(p for p in EXAMPLES.glob("*.toml") if not p.name.startswith("trainer_"))
TRAINER_FILES = sorted(EXAMPLES.glob("trainer_*.toml"))


def launch_config(name: str) -> Config:
    return build_config(file=EXAMPLES / name, environ={})


def test_the_examples_are_there_and_listed_in_their_readme():
    names = {p.name for p in EXAMPLES.glob("*.toml")}
    assert {"serve_mac.toml", "serve_cuda.toml", "serve_cpu.toml", "train_length_cpu.toml",
            "train_arithmetic_gpu.toml", "trainer_standalone.toml"} <= names
    readme = (EXAMPLES / "README.md").read_text()
    assert [n for n in sorted(names) if f"`{n}`" not in readme] == []


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_launch_example_loads_and_its_trainer_section_too(path):
    config = build_config(file=path, environ={})
    assert isinstance(config, Config)
    if config.trainer.enabled:  # parallm-train reads the same file's [trainer] section
        trainer = build_trainer_config(file=path, environ={})
        assert trainer == config.trainer
        load_task(trainer.rl_training.task, trainer.rl_training.task_args)  # the task takes these arguments


@pytest.mark.parametrize("path", TRAINER_FILES, ids=lambda p: p.name)
def test_trainer_example_loads_as_a_standalone_trainer_file(path):
    trainer = build_trainer_config(file=path, environ={})
    assert isinstance(trainer, TrainerConfig)
    assert trainer.server.router, "a standalone trainer needs the server's router"
    load_task(trainer.rl_training.task, trainer.rl_training.task_args)


def test_auto_leaves_settings_to_the_machine():
    cpu, mac = launch_config("serve_cpu.toml"), launch_config("serve_mac.toml")
    assert (cpu.model.dtype, cpu.engine.max_prefill_tokens, cpu.engine.fast_math, cpu.engine.overlap) == (None,) * 4
    assert (cpu.supervisor.blas, cpu.supervisor.allocator) == (None, None)
    assert (mac.engine.kv_budget_mb, mac.adapters.merge_mb) == (None, None)


def test_gpu_examples_batch_wide_and_the_trainers_train():
    cuda = launch_config("serve_cuda.toml")
    assert cuda.engine.max_num_seqs == 256 and cuda.tokenizer.replicas == 2
    gpu_trainer = launch_config("train_arithmetic_gpu.toml")
    assert gpu_trainer.trainer.enabled and gpu_trainer.trainer.rl_training.task == "arithmetic"
    assert gpu_trainer.detokenizer.rollout_hwm == 10_000 and gpu_trainer.adapters.history == 4
    length = launch_config("train_length_cpu.toml")
    assert length.trainer.enabled and length.model.path == "default"
    from parallm.config import enabled_trainers

    two = enabled_trainers(launch_config("train_two_cpu.toml"))
    assert [(t.name, t.rl_training.task) for t in two] == [("trainer-short", "length"), ("trainer-arith", "arithmetic")]
    for t in two:
        load_task(t.rl_training.task, t.rl_training.task_args)
