"""The trainer's part of the configuration schema (`[trainer]` and `[[trainer]]`: parallm-train, or a
supervised trainer stage): the server it talks to, the model and adapter it trains, LoRA, the RL
loop, checkpoints and its memory budget."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct

from .fields import described as _d

__all__ = ["TrainerServerConfig", "TrainerModelConfig", "LoRATrainConfig", "RLTrainingConfig", "CheckpointConfig",
           "TrainerMemoryConfig", "TrainerConfig"]


class TrainerServerConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    router: Annotated[str, _d("the server's ZeroMQ router (e.g. tcp://127.0.0.1:5552 or ipc://RUN_DIR/router.sock); "
                              "empty when the supervisor starts the trainer")] = ""
    timeout_s: Annotated[float, _d("seconds a rollout request may take before the step fails")] = 600.0
    curve_server_key: Annotated[str, _d("a tcp:// server's public CURVE key file (its NAME.key, or <run dir>/server.key)"
                                        "; with curve_client_key")] = ""
    curve_client_key: Annotated[str, _d("this trainer's CURVE key pair, a NAME.key_secret file whose public key the "
                                        "server allows (transport.curve_clients)")] = ""


class TrainerModelConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    path: Annotated[str, _d("base model the trainer loads (must be the one served); empty = the server's "
                            "model.path, or 'default' when run standalone")] = ""
    dtype: Annotated[Literal["float32", "float16", "bfloat16", "quantized"] | None,
                     _d("precision of the trainer's base weights; unset = the served precision (the server's "
                        "model.dtype, resolved by the same policy: float32 on MLX's CPU device, elsewhere as "
                        "stored); 'quantized' keeps a quantized model quantized and trains LoRA/DoRA over its "
                        "quantized layers (QLoRA)")] = None
    adapter: Annotated[str, _d("adapter name the trainer publishes its versions under")] = "policy"


class LoRATrainConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    fine_tune_type: Annotated[Literal["lora", "dora"], _d("adapter kind (mlx-lm's fine_tune_type)")] = "lora"
    rank: Annotated[int, _d("LoRA rank")] = 8
    scale: Annotated[float, _d("LoRA scale (mlx-lm's; PEFT's alpha / rank)")] = 20.0
    dropout: Annotated[float, _d("LoRA dropout while training")] = 0.0
    keys: Annotated[list[str], _d("modules adapted in each layer")] = \
        msgspec.field(default_factory=lambda: ["self_attn.q_proj", "self_attn.v_proj"])
    num_layers: Annotated[int, _d("adapt the last N transformer layers; -1 = all")] = 8


class RLTrainingConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    task: Annotated[str, _d("built-in task (arithmetic, length, json) or 'module:callable' returning a Task")] = "length"
    task_args: Annotated[dict[str, Any], _d("keyword arguments for the task's constructor")] = {}
    reward_model: Annotated[str, _d("a reward model the server serves (model.pooling, task reward), by name: its "
                                    "score of each conversation is part of the reward; empty = the task's only")] = ""
    reward_model_weight: Annotated[float, _d("weight of the reward model's score in the reward")] = 1.0
    task_reward_weight: Annotated[float, _d("weight of the task's own score in the reward (0: the reward model's "
                                            "only; the task still gives the prompts)")] = 1.0
    steps: Annotated[int, _d("optimizer steps to run; 0 = until stopped")] = 0
    prompts_per_step: Annotated[int, _d("groups (distinct prompts) per step")] = 4
    group_size: Annotated[int, _d("completions sampled per prompt (GRPO's G)")] = 8
    max_tokens: Annotated[int, _d("completion length limit")] = 64
    temperature: Annotated[float, _d("sampling temperature of rollouts (the loss uses the same)")] = 1.0
    top_p: Annotated[float, _d("nucleus sampling of rollouts")] = 1.0
    learning_rate: Annotated[float, _d("Adam learning rate")] = 1e-4
    max_grad_norm: Annotated[float, _d("gradient norm clip; 0 = none")] = 1.0
    clip_low: Annotated[float, _d("importance ratio clipped below at 1 - clip_low")] = 0.2
    clip_high: Annotated[float, _d("importance ratio clipped above at 1 + clip_high")] = 0.28
    kl_coef: Annotated[float, _d("weight of the KL to the base model (teacher-forced scoring by the server); "
                                 "0 = no KL, no scoring")] = 0.0
    scale_rewards: Annotated[bool, _d("divide group-centred rewards by the group's std (GRPO); off = Dr. GRPO")] = True
    updates_per_batch: Annotated[int, _d("optimizer steps on each batch of rollouts (PPO epochs)")] = 1
    micro_batch: Annotated[int, _d("sequences per forward/backward pass (gradients accumulate)")] = 8
    rollout_source: Annotated[Literal["generate", "subscribe", "atropos"],
                              _d("'generate': the trainer requests its rollouts; 'subscribe': it trains on "
                                 "rollouts other clients produce, from the rollout PUB stream; 'atropos': it "
                                 "registers with an Atropos run-api and trains on the scored batches its "
                                 "environments post (rewards are theirs)")] = "generate"
    atropos_url: Annotated[str, _d("atropos mode: the run-api's base URL")] = "http://127.0.0.1:8000"
    atropos_poll_s: Annotated[float, _d("atropos mode: wait between GET /batch polls while none is ready")] = 0.5
    prefetch: Annotated[int, _d("rollout batches generated ahead while training (each adds one version of "
                                "staleness); 0 = strictly on-policy")] = 0
    max_staleness: Annotated[int, _d("rollouts whose oldest token is more versions behind are not trained on "
                                     "(counted); -1 = no limit")] = 4
    subscribe_group_timeout_s: Annotated[float, _d("subscribe mode: a group still incomplete after this long "
                                                   "is trained on as it is (if it has 2+ samples)")] = 30.0
    seed: Annotated[int, _d("seed of prompt sampling and of rollouts")] = 0


class CheckpointConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    dir: Annotated[str, _d("checkpoint directory (mlx-lm adapter format, one folder per checkpoint)")] = \
        "checkpoints/policy"
    every_steps: Annotated[int, _d("checkpoint every N optimizer steps")] = 10
    keep_last: Annotated[int, _d("checkpoints kept; older ones are deleted")] = 3
    resume: Annotated[bool, _d("resume from the latest checkpoint in dir when there is one")] = True
    metrics_file: Annotated[str, _d("JSON lines of per-step metrics; empty = DIR/metrics.jsonl")] = ""
    tensorboard_dir: Annotated[str, _d("also write every step's metrics as TensorBoard event files here "
                                       "(`tensorboard --logdir`; no extra package needed); empty = none")] = ""


class TrainerMemoryConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The trainer's memory (parallm/training/memory.py): a plan logged at start, micro-batches from a budget."""

    budget_mb: Annotated[float, _d("memory the trainer may use, MiB (weights, adapter + Adam, one micro-batch's "
                                   "activations): rl_training.micro_batch is lowered to what fits, and a budget "
                                   "that holds not even one sequence stops the start naming the plan; 0 = no "
                                   "bound")] = 0.0
    grad_checkpoint: Annotated[bool | None, _d("recompute each transformer layer's forward in the backward pass "
                                               "instead of keeping its activations; unset = on from 1B base "
                                               "parameters")] = None
    plan_seq_len: Annotated[int, _d("sequence length (prompt + completion tokens) the plan and the budget assume; "
                                    "0 = rl_training.max_tokens + 256")] = 0


class TrainerConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`parallm-train`'s settings: the [trainer] section of a launch config, or the top level of its own file."""

    enabled: Annotated[bool, _d("parallm-launch starts and supervises a trainer")] = False
    name: Annotated[str, _d("the trainer's name in /v1/training/status and the metrics' trainer label; empty = "
                            "its adapter's name ('trainer' for the default adapter 'policy')")] = ""
    server: TrainerServerConfig = TrainerServerConfig()
    model: TrainerModelConfig = TrainerModelConfig()
    lora: LoRATrainConfig = LoRATrainConfig()
    rl_training: RLTrainingConfig = RLTrainingConfig()
    checkpointing: CheckpointConfig = CheckpointConfig()
    memory: TrainerMemoryConfig = TrainerMemoryConfig()
    log_level: Annotated[Literal["debug", "info", "warning", "error"], _d("trainer log level")] = "info"
