"""The configuration's schema: one typed struct per stage (each field's `Meta(description=...)` is its
documentation and its `--help` text), their defaults, and what the engine resolves for the machine
(`resolve_engine_config`); the trainer's structs are trainer_schema.py. How a Config is built from a
file, the environment and the command line: parallm/config/loading.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct

from .fields import described as _d
from .trainer_schema import (CheckpointConfig, LoRATrainConfig, RLTrainingConfig, TrainerConfig,  # noqa: F401
                             TrainerMemoryConfig, TrainerModelConfig, TrainerServerConfig)  # re-exported

__all__ = ["ENV_PREFIX", "AUTO", "ModelConfig", "EngineConfig", "auto_prefill_tokens",
           "auto_adapter_merge_mb", "ComputeDevice", "CUDA_UNFUSED_PREFILL_KEYS", "CUDA_PREFILL_TOKENS",
           "CUDA_PREFILL_ROWS", "PREFILL_ROWS", "resolve_engine_config",
           "TOOL_CALL_PARSERS",
           "TokenizerConfig", "ServerConfig", "TransportConfig", "SupervisorConfig", "AdaptersConfig",
           "DetokenizerConfig", "TrainerServerConfig", "TrainerModelConfig", "LoRATrainConfig",
           "RLTrainingConfig", "CheckpointConfig", "TrainerMemoryConfig", "TrainerConfig", "KVConfig", "SpecConfig",
           "PoliciesConfig", "Config", "serves_lm", "generates", "pooling_only_problems"]


ENV_PREFIX = "PARALLM_"
AUTO = "auto"  # the word that leaves an optional setting unset (decided for the machine)


class ModelConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    path: Annotated[str, _d("'default' (embedded SmolLM2-135M-Instruct), an MLX model directory, "
                            "a Hugging Face hub id from the local cache, or a .gguf file")] = "default"
    dtype: Annotated[Literal["float32", "float16", "bfloat16", "quantized"] | None,
                     _d("weight dtype; unset = float32 on MLX's CPU device, elsewhere as stored (a quantized "
                        "checkpoint: see quantized_weights)")] = None
    quantized_weights: Annotated[Literal["keep", "dequantize"] | None,
                                 _d("a quantized checkpoint's weights: keep = served quantized, dequantize = "
                                    "served in float32 on MLX's CPU device, bfloat16 on a GPU; unset (auto) = "
                                    "float32 on the CPU, on a CUDA GPU bfloat16 when its bfloat16 weights and the "
                                    "KV budget fit 0.9 of the device (MLX's CUDA quantized matmul does not scale "
                                    "with rows), else kept; on Metal kept (docs/models.md)")] = None
    served_name: Annotated[str, _d("model name in /v1/models; empty = derived from the path")] = ""
    max_model_len: Annotated[int, _d("context length limit in tokens; 0 = the model's own")] = 0
    cache_dir: Annotated[str, _d("where converted models are kept; empty = the user cache dir")] = ""
    chat_template: Annotated[str, _d("a Jinja chat template, or the path of a file holding one; empty = the "
                                     "model's own, else a plain role-prefixed default")] = ""
    trust_remote_code: Annotated[bool, _d("let transformers run the Python code a model repository ships for its "
                                          "tokenizer (as mlx_lm.server's --trust-remote-code)")] = False
    generation_config: Annotated[str | None, _d("sampling defaults of the OpenAI routes for fields a request omits "
                                                "(vLLM's --generation-config): unset (auto) = the model's "
                                                "generation_config.json (temperature, top_p, top_k, min_p, "
                                                "repetition_penalty; max_new_tokens as max_tokens), 'none' = none, "
                                                "or a directory holding a generation_config.json")] = None
    task: Annotated[Literal["generate", "embed", "reward", "classify"] | None,
                    _d("what model.path is served for (--task): generate (text generation), or embed, reward or "
                       "classify: a pooling model and no generator (the pooling routes answer; generation routes "
                       "answer 400 naming why); unset (auto) = a pooling task when model.path is an embedding, "
                       "reward or classifier model (an encoder, a *ForSequenceClassification head, a "
                       "sentence-transformers directory), else generate; with a pooling task, 'default' is the "
                       "embedded all-MiniLM-L6-v2")] = None
    pooling: Annotated[list[str], _d("pooling models served beside the generator, NAME=PATH or NAME:TASK=PATH "
                                     "(--pooling-model, repeatable): TASK embed, reward or classify (unset: from "
                                     "the model's config); PATH 'default' = the embedded all-MiniLM-L6-v2, a "
                                     "model directory or a hub id from the local cache")] = []


class EngineConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_num_seqs: Annotated[int, _d("most sequences decoded together (rows of the live batch)")] = 64
    max_prefill_tokens: Annotated[int | None, _d("prompt tokens prefilled per step (the chunk budget); unset = on "
                                                 "MLX's CPU device 128 with mixed passes, else 256; 2048 on "
                                                 "CUDA; 512 on Metal")] = None
    max_prefill_rows: Annotated[int | None, _d("sequences prefilled together in one pass; unset = 32 on CUDA, "
                                               "16 elsewhere")] = None
    prefill_pass_s: Annotated[float | None, _d("seconds a prefill pass's prompt chunks should take (besides the "
                                               "pass's fixed cost and a mixed pass's decode rows): the step's prefill "
                                               "budget shrinks below max_prefill_tokens by a cost model fitted to "
                                               "the last passes, so a short prompt never "
                                               "waits long behind a long one's chunks; 0 = off; unset = 0.25 on "
                                               "MLX's CPU device, off elsewhere (docs/scheduling.md)")] = None
    training_share: Annotated[float, _d("share of the device left to a trainer's update while one runs on the "
                                        "same device: after each step the engine rests step x s / (1 - s), "
                                        "only while a trainer says its update runs; 0 = never rest "
                                        "(docs/training.md, Sharing the device)")] = 0.0
    pooling_batch_tokens: Annotated[int, _d("padded tokens per batched pass of a pooling model (model.pooling); "
                                            "one pass runs between two generation steps: 512 held the generation drop "
                                            "to ~10 percent under an embeddings burst on the CPU, 8192 to 65 percent "
                                            "(perf/results/pooling-mixed-cpu.md)")] = 512
    max_constraint_bytes: Annotated[int, _d("largest grammar constraint a request may carry (its schema, choices, "
                                            "regex or grammar text), bytes; larger is a 400 naming the field")] = 65536
    constraint_timeout_s: Annotated[float, _d("seconds a request's grammar may take to compile (on a thread of its "
                                              "own, off the step loop) before the request is refused")] = 10.0
    kv_budget_mb: Annotated[float | None, _d("KV memory for live rows and the prefix cache, MiB; unset = a share "
                                             "of the memory available once the model is loaded")] = None
    buffer_cache_mb: Annotated[float | None, _d("memory MLX may keep in its cache of freed buffers, MiB; unset = on a "
                                                "CUDA GPU 0.8 of the device memory left free after the weights and "
                                                "the KV budget, elsewhere MLX's own limit")] = None
    prefix_pool_fraction: Annotated[float, _d("share of the KV block store that free prefix-cache blocks keep before "
                                              "the least recently used go ahead of never-used blocks")] = 0.25
    writeback_interval: Annotated[int, _d("a long-running sequence keys its new full blocks in the prefix cache "
                                          "every this many blocks; 0 = only when it ends")] = 16
    block_size: Annotated[int | None, _d("tokens per block of the KV block store (and prefix cache); unset = 32 on "
                                         "MLX's CPU device, 16 elsewhere (docs/performance.md)")] = None
    prefix_cache: Annotated[bool, _d("reuse the KV of shared prompt prefixes")] = True
    prefix_partial_blocks: Annotated[bool | None, _d("a prompt whose next block is not cached whole starts from a "
                                                     "copy of the cached block after the same prefix that shares "
                                                     "most of its leading tokens (a shared prefix is reused to the "
                                                     "token, not to the block); unset = on with MLX's CPU device, "
                                                     "whose 32-token blocks would recompute up to 31 tokens, off "
                                                     "elsewhere (the copy waits for the device; not measured on a "
                                                     "GPU)")] = None
    overlap: Annotated[bool | None, _d("build and launch step t+1 before reading step t's tokens; unset = on with "
                                       "a GPU, off on MLX's CPU device")] = None
    in_place_kv_mb: Annotated[float, _d("from this size of the live KV buffers (MiB) on, a pass that writes into "
                                        "them first waits for the pass still running: MLX copies a buffer that a "
                                        "running kernel holds before writing into it, so with overlap every step "
                                        "copied the whole live KV (H200, 256 rows: the same step time either way, "
                                        "3.5 GB less peak memory waiting); -1 = never wait")] = 256
    unfused_prefill_keys: Annotated[int | None, _d("a prefill pass whose rows attend at most this many key "
                                                   "positions computes attention as matmuls and a softmax instead "
                                                   "of MLX's fused kernel, whose CUDA version (cuDNN) builds a "
                                                   "graph for every new shape and stride; 0 = always the fused "
                                                   "kernel; unset = 4096 on a CUDA GPU (H200, c=256 served: "
                                                   "6,668 -> 7,702 tok/s), 0 elsewhere "
                                                   "(docs/performance.md)")] = None
    unfused_decode: Annotated[bool | None, _d("a decode pass of rows at different lengths (an array mask) computes "
                                              "attention as matmuls and a float32 softmax instead of MLX's own "
                                              "call, which on CUDA has no fused kernel for a masked decode and "
                                              "composes one; unset = on on a CUDA GPU (H200, c=256 served: ~4,000 "
                                              "-> 6,668 tok/s), off elsewhere (docs/performance.md)")] = None
    compile: Annotated[bool, _d("compile the sampler's elementwise kernels (the seeded Gumbel noise, the "
                                "penalties) with mx.compile")] = True
    fast_math: Annotated[bool | None, _d("exp without libm in the model's SwiGLU and attention softmax (float32, "
                                         "relative error <= 4e-7); unset = on on MLX's CPU device")] = None
    mixed_passes: Annotated[bool | None, _d("prefill prompt chunks in the same pass as the running rows' decode "
                                            "tokens (one read of the weights and one pass instead of two) where the "
                                            "model's layers allow it; unset = on on MLX's CPU device, off on a GPU "
                                            "(where a packed pass's ever-new shape costs more than the second "
                                            "pass)")] = None
    paged_decode: Annotated[Literal["gather", "gather_mm", "off"] | None,
                            _d("how a decode pass reads the KV block store: unset = the GPU's paged attention "
                               "kernel (CUDA; Metal on Apple silicon), mx.gather_mm over the store in place for "
                               "float32 on the CPU, else the rows' blocks gathered; gather / gather_mm force "
                               "those; off = attend over the rows' gathered K/V with the model's own attention "
                               "call (docs/engine.md, 'Decode attention through the block tables'); gather_mm "
                               "(the CPU's float32 default) also reads a long span's prompt chunks in place")] = None
    kv_preallocate: Annotated[bool | None, _d("allocate the KV block store at the whole budget when the engine starts "
                                              "(as vLLM does) instead of growing it by half as blocks are used, which "
                                              "copies the store and waits for the device each time; unset = on with a "
                                              "CUDA GPU, off elsewhere (the CPU's memory is the other processes' too)")] = None
    kv_write_in_place: Annotated[bool | None, _d("decode passes read through the CUDA paged-attention kernel store "
                                                 "their new K/V into the block store in place with a kernel of their "
                                                 "own, so they never wait for the pass in flight (a write made of MLX "
                                                 "ops into a store a running pass reads is a copy of the store, "
                                                 "engine.in_place_kv_mb); unset = on with a CUDA GPU (docs/engine.md, "
                                                 "'Writing the block store in place on CUDA')")] = None
    compiled_decode: Annotated[bool, _d("run pure-decode passes (no prompt chunk) under mx.compile, traced once per "
                                        "(rows bucket, key-span bucket), fewer kernel launches per step for small "
                                        "batches on a GPU; rows under an adapter and models it cannot trace run "
                                        "eagerly")] = False
    fused_projections: Annotated[bool | None, _d("compute each layer's q/k/v projections with one matmul and its "
                                                 "gate/up projections with another (the siblings' weights "
                                                 "concatenated, each projection's weight a view of them): fewer kernel "
                                                 "launches per pass where the model's forward is proven to call them "
                                                 "on the same input; off with engine.tensor_parallel > 1; unset = on "
                                                 "with a CUDA GPU, off on the CPU (no gain measured) and Metal "
                                                 "(docs/engine.md, 'Fused projections')")] = None
    prefill_buckets: Annotated[bool | None, _d("pad a prefill pass's chunk length up to a power of two from 16 (at "
                                               "most the prefill budget), so its pass shapes are few, and warm up "
                                               "each (rows, length) shape at start: a new shape builds its "
                                               "kernels on first use on MLX CUDA; models prefilled one row per "
                                               "pass are never padded; unset = off")] = None
    warm_decode_rows: Annotated[int | None, _d("at start, decode passes of every row count from 1 up to this many "
                                               "(at most max_num_seqs; one short request admitted per step), so no "
                                               "request pays a decode batch's first use (on MLX CUDA a decode "
                                               "pass of a row count not run before launched ~5 ms slower on the "
                                               "H200); 0 = none; unset = 0 (docs/performance.md)")] = None
    admit_delay_factor: Annotated[float | None, _d("while rows decode and less than a full prefill pass of prompts "
                                                   "waits, a new prompt waits up to this many times the last "
                                                   "prefill step's time for others to fill its pass (vLLM's "
                                                   "scheduler_delay_factor; a full pass is admitted at once, an idle "
                                                   "engine admits at once); 0 = admit what waits every step; unset = "
                                                   "0 (docs/scheduling.md)")] = None
    default_max_tokens: Annotated[int, _d("max_tokens when a request gives none")] = 256
    seed: Annotated[int, _d("seed for requests that give none")] = 0
    priority_aging_s: Annotated[float, _d("a waiting request's priority improves by one level per this many seconds "
                                          "of waiting, so low-priority work is never starved; 0 = strict "
                                          "priority")] = 10.0
    tensor_parallel: Annotated[int, _d("ranks the engine runs as, each holding a shard of the model (mx.distributed: "
                                       "the ring backend on CPUs, NCCL on CUDA GPUs, one GPU per rank); 1 = one "
                                       "process")] = 1
    hang_floor_s: Annotated[float, _d("an engine (a tensor-parallel group) whose step runs longer than this plus "
                                      "hang_factor x what its recent steps say it should take (it hangs alive: "
                                      "stopped, a device call that never returns, a rank stuck in a collective) is "
                                      "restarted and its requests end with a retryable 503; 0 = off, only "
                                      "supervisor.stall_after_s catches a hang (docs/operations.md, Faults)")] = 5.0
    hang_factor: Annotated[float, _d("how many times its expected time (the longest recent step, or its "
                                     "predicted work, plus calls the ranks replay and a new kind of step's first-use "
                                     "builds) an engine step may take on top of hang_floor_s")] = 10.0
    replicas: Annotated[int, _d("engine replicas behind the tokenizers (data parallel; one per GPU on a CUDA "
                                "host): each request goes to one, chosen by load and prefix-cache affinity")] = 1
    remote_replicas: Annotated[list[str], _d("engine replicas started on other machines (python -m "
                                             "parallm.launch.remote), numbered after engine.replicas: the tcp://"
                                             "HOST:PORT each one's requests socket binds (its adapters socket: PORT+1)"
                                             "; needs transport.kind tcp")] = []
    remote_client_key: Annotated[str, _d("on a remote engine replica: its CURVE key pair (NAME.key_secret) whose "
                                         "public key is in the server's transport.curve_clients")] = ""
    hostfile: Annotated[str, _d("MLX's hostfile (as mlx.launch --hostfile reads it: a JSON list of {\"ssh\": "
                                "HOST, \"ips\": [ADDRESS]}, one per tensor-parallel rank): the address each "
                                "rank's ring connection uses; every rank on this machine for now")] = ""


ComputeDevice = Literal["cpu", "cuda", "metal"]  # the backend MLX computes on (parallm.device.compute_device)


def auto_prefill_tokens(device: ComputeDevice, mixed: bool) -> int:
    """The prefill budget of `max_prefill_tokens` unset, once the engine knows whether its prompt
    chunks ride in the decode pass (`mixed`: then a chunk costs no extra read of the weights, so
    smaller chunks get first tokens out sooner for little throughput). Measured served on the
    2-core CPU with mixed passes, 16 chat streams: 256 -> 128 TTFT p50 0.75-0.98 -> 0.56-0.62 s,
    126-139 -> 123-131 tok/s; 32 streams: 1.07-1.09 -> 0.63-0.64 s, 174-178 -> 165-169 tok/s.

    On CUDA the block store's admissions copy no KV, so a step can admit more: 512 requests at c=256
    over HTTP on the H200 (llama-3.2-3b, 128 tokens, one call): 512 tokens / 16 rows 11,458 tok/s,
    TTFT p99 1.25 s; 2048 / 32 13,359 tok/s, 0.88 s; 4096 / 64 13,150 tok/s, 0.93 s
    (perf/results/serving-llama-3.2-3b-final37-*-h200.md). vLLM and SGLang chunk at 8192 on such GPUs."""
    if device == "cuda":
        return CUDA_PREFILL_TOKENS
    if device == "metal":
        return 512
    return 128 if mixed else 256


def auto_adapter_merge_mb(on_cpu: bool) -> int:
    """The merge budget of `adapters.merge_mb` unset (docs/adapters.md, Measured). On a GPU a
    small model's pass is spent launching kernels and the factored update adds kernels to every
    adapted layer: rank-16 q/v LoRA on the default model's shape, H100, 16-row decode at 0.95-0.97
    of the base model's throughput merged vs 0.61-0.78 factored. On MLX's CPU device the pass is
    matmul time, where the update costs less than the run-to-run noise, while the merge's
    weight-sized matmuls made a load 20.8 ms instead of 2.1 (2-core CPU, perf/bench_adapters.py)."""
    return 0 if on_cpu else 256


CUDA_UNFUSED_PREFILL_KEYS = 4096  # engine.unfused_prefill_keys unset on a CUDA GPU
CUDA_PREFILL_TOKENS = 2048  # engine.max_prefill_tokens unset on a CUDA GPU (auto_prefill_tokens says why)
CUDA_PREFILL_ROWS = 32  # engine.max_prefill_rows unset on a CUDA GPU
PREFILL_ROWS = 16  # engine.max_prefill_rows unset on the CPU and Metal
CPU_PREFILL_PASS_S = 0.25  # engine.prefill_pass_s unset on MLX's CPU device (docs/scheduling.md)
BLOCK_SIZE = 16  # engine.block_size unset on a GPU (the paged kernels' tiles)
CPU_BLOCK_SIZE = 32  # engine.block_size unset on MLX's CPU device: gather_mm reads fewer, longer tiles (docs/performance.md)


def resolve_engine_config(config: EngineConfig, device: ComputeDevice) -> EngineConfig:
    """The engine settings left unset decided for the device (the prefill budget is decided by the
    engine, `auto_prefill_tokens`, once it knows whether it can mix passes; the KV budget once
    the model is loaded).

    On MLX's CPU device the step's compute is the CPU itself, so launching step t+1 before reading
    step t hides little and costs every new request two steps of time to first token (its first
    token is read a step late, and a finished sequence's row is freed a step late); smaller prefill
    passes let the first prompts of a burst start decoding sooner. Measured on the 2-core CPU
    (docs/scheduling.md): 16 concurrent chat streams, TTFT p50 3.1 s -> 0.9 s, same throughput.

    On CUDA, masked decode and short prefills attend unfused (matmuls and a float32 softmax): MLX's
    CUDA vector kernel takes no array mask, so every multi-row decode ran its composed fallback
    (28 layers at 256 rows, H200: 13.9 ms masked vs 4.0 unfused), and its fused prefill kernel
    (cuDNN) builds a graph per new shape and stride. Served c=256 on the H200: ~4,000 tok/s with
    neither, 6,668 with unfused decode, 7,702 with both (docs/performance.md). Metal's vector
    kernel reads masks and the CPU has no fused kernel to avoid: both keep MLX's own calls.

    On the CPU the block store's decode reads (gather_mm over the store's tiles) take blocks of 32
    tokens faster than 16 at every batch measured (the default model, 128-token rows, three runs of
    alternated child processes: 1 / 16 / 64 rows 0.95-0.99 / 0.94-1.01 / 0.93-0.97x the time,
    perf/results/kv-layout-decode-128-{blocksize-s9,s9-third,block32-default}-cpu.md); the GPUs keep
    16, the paged kernels' tile.

    On CUDA a step admits up to 32 prompts and 2048 of their tokens (`auto_prefill_tokens` has the
    figures); the CPU and Metal keep 16 rows.
    """
    on_cpu, on_cuda = device == "cpu", device == "cuda"
    changes: dict[str, Any] = {}
    if config.overlap is None:
        changes["overlap"] = not on_cpu
    if config.fast_math is None:
        changes["fast_math"] = on_cpu
    if config.mixed_passes is None:
        changes["mixed_passes"] = on_cpu
    if config.prefill_pass_s is None:
        changes["prefill_pass_s"] = CPU_PREFILL_PASS_S if on_cpu else 0.0
    if config.prefill_buckets is None:
        changes["prefill_buckets"] = False  # a GPU default waits for `bash perf/gpu_runs.sh buckets`
    if config.warm_decode_rows is None:
        changes["warm_decode_rows"] = 0  # a GPU default waits for `bash perf/gpu_runs.sh lean37`
    if config.admit_delay_factor is None:
        changes["admit_delay_factor"] = 0.0  # no gain measured on the H200 (docs/scheduling.md)
    if config.kv_preallocate is None:
        changes["kv_preallocate"] = on_cuda
    if config.prefix_partial_blocks is None:
        changes["prefix_partial_blocks"] = on_cpu
    if config.unfused_decode is None:
        changes["unfused_decode"] = on_cuda
    if config.kv_write_in_place is None:
        changes["kv_write_in_place"] = on_cuda
    if config.unfused_prefill_keys is None:
        changes["unfused_prefill_keys"] = CUDA_UNFUSED_PREFILL_KEYS if on_cuda else 0
    if config.block_size is None:
        changes["block_size"] = CPU_BLOCK_SIZE if on_cpu else BLOCK_SIZE
    if config.max_prefill_rows is None:
        changes["max_prefill_rows"] = CUDA_PREFILL_ROWS if on_cuda else PREFILL_ROWS
    if config.tensor_parallel > 1 and config.fused_projections:
        changes["fused_projections"] = False  # a rank's q/k/v are column slices (sharded.py): never fused
    elif config.fused_projections is None:
        changes["fused_projections"] = on_cuda and config.tensor_parallel == 1
    return msgspec.structs.replace(config, **changes) if changes else config


class KVConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The KV store's tiers and admission by memory pressure (docs/engine.md, "Disk tier")."""

    disk_dir: Annotated[str, _d("directory of the disk tier for prefix-cache blocks (one file per block, keyed by "
                                "its chained hash, under a fingerprint of the model, dtype and KV layout): blocks "
                                "are read back on a prefix-cache miss instead of recomputed, across engine and "
                                "server restarts; empty = no disk tier")] = ""
    disk_policy: Annotated[Literal["evict_only", "write_through"],
                           _d("evict_only: a cached block goes to disk when the block store evicts it; "
                              "write_through: every block the prefix cache keys is written at once (survives a kill)")] = \
        "evict_only"
    disk_max_gb: Annotated[float, _d("GiB the disk tier may hold; the least recently used files go first")] = 10.0
    disk_ttl_s: Annotated[float, _d("seconds a block file is kept after it was last written or read; 0 = no "
                                    "limit")] = 7 * 24 * 3600.0
    disk_queue_blocks: Annotated[int, _d("blocks waiting for the disk writer thread; past it new ones are dropped "
                                         "and counted (the engine's step never waits for the disk)")] = 1024
    bits: Annotated[Literal[0, 4, 8], _d("bits per K/V element in the block store (live and cached blocks) and the disk tier: "
                                         "8 or 4 (quantized with mx.quantize: values plus a scale and bias per "
                                         "group, attention through MLX's quantized matmuls), 0 = the model's dtype")] = 0
    group_size: Annotated[Literal[32, 64, 128], _d("K/V elements sharing one scale and bias with kv.bits (must divide "
                                                   "the model's head dimension)")] = 64
    pressure_threshold: Annotated[float | None, _d("KV utilization (tokens live and waiting sequences hold or need, "
                                                   "over the tokens the live KV can hold) past which new requests get "
                                                   "a retryable 503 with Retry-After and /health says overloaded "
                                                   "(degraded from 0.9 of it); unset = no bound")] = None


class SpecConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding (docs/engine.md, "Speculative decoding"): proposed tokens verified by one target
    pass, every emitted token the target's own sample (its logprobs and versions unchanged)."""

    mode: Annotated[Literal["none", "ngram", "draft"],
                    _d("none; ngram: prompt lookup (the continuation of the earlier match of the sequence's "
                       "last tokens that extends furthest back, over prompt and output; no extra model); "
                       "draft: a smaller model (spec.draft_model) proposes, batched over the rows")] = "none"
    k: Annotated[int, _d("most tokens proposed per row and step; each row's k adapts to its acceptance. 0: the "
                         "mode's own (ngram 7, a verify pass of 8 tokens; draft 4, each drafted token a draft pass)")] = 0
    draft_model: Annotated[str, _d("the draft model for mode draft: any model spec (as model.path), loaded in the "
                                  "served model's dtype; refused at start unless it shares the served model's "
                                  "vocabulary")] = ""
    draft_acceptance: Annotated[Literal["coupled", "rejection"],
                                _d("how mode draft verifies a sampled row's proposal. coupled: the draft samples each "
                                   "position with the noise the target's sampler uses there (the request's seed and "
                                   "output position) and a proposal is accepted while it is the target's own sample, "
                                   "so every token is plain decoding's for that seed, whatever the batch; rejection: "
                                   "p/q rejection sampling with the residual max(0, p - q), higher acceptance, the "
                                   "target's distribution, but a seed's tokens differ from plain decoding's and "
                                   "depend on the batch")] = "coupled"
    disable_batch_size: Annotated[int, _d("no speculation in a step with more running rows than this (a verify pass "
                                          "pads every row to the longest proposal: B x (k + 1) tokens)")] = 4
    ngram_min: Annotated[int, _d("shortest suffix (tokens) the n-gram proposer matches (near a row's copy position, "
                                 "after an accepted run, its last token alone)")] = 2
    ngram_max: Annotated[int, _d("longest suffix (tokens) the n-gram proposer matches: of the occurrences of the last "
                                 "ngram_min tokens, the one whose match extends furthest back (up to this) is copied")] = 16
    verify_multiple: Annotated[int, _d("mode ngram: the most a row proposes (spec.k) is rounded down so its verify "
                                       "pass's length (1 + k) is a multiple of this (on the CPU a 4- or 8-token pass "
                                       "costs less than a 3-, 5- or 7-token one); a short match's one-token probe is "
                                       "a pass of 2 whatever this is; 1: any length. Mode draft rounds nothing (a "
                                       "drafted token costs a draft pass)")] = 4
    min_acceptance: Annotated[float, _d("a row whose recent acceptance rate falls below this stops "
                                        "speculating for a while (doubling, up to 64 steps)")] = 0.3


class TokenizerConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    replicas: Annotated[int, _d("tokenizer processes (requests fan out over them)")] = 1
    # image input (vision-language models, docs/vision.md): fetched, decoded and processed in this stage
    max_images: Annotated[int, _d("images one request may carry")] = 8
    max_image_bytes: Annotated[int, _d("bytes of one image's file (decoded from its data: URL or fetched)")] = 20 * 2**20
    max_image_pixels: Annotated[int, _d("pixels (width x height) of one decoded image; more is a 400 before "
                                        "decoding (decompression bombs)")] = 6000 * 6000
    image_fetch_hosts: Annotated[list[str], _d("hosts whose http(s) image URLs this server fetches; empty: "
                                               "remote images are refused (data: URLs only)")] = []
    image_fetch_timeout_s: Annotated[float, _d("seconds one image URL fetch may take")] = 10.0


# the tool-call parsers --server.tool-call-parser may name: mlx-lm's (parallm/text/assistant.py infers one
# from a chat template, in mlx-lm's order, and loads it) and Llama-3's JSON calls
TOOL_CALL_PARSERS: tuple[str, ...] = (
    "harmony", "minimax_m2", "gemma4", "function_gemma", "longcat", "glm47", "pythonic", "qwen3_coder", "kimi_k2",
    "minicpm5", "mistral", "muse_spark", "json_tools", "llama3_json", "laguna", "kimi_k3")


class ServerConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: Annotated[str, _d("HTTP bind address")] = "127.0.0.1"
    port: Annotated[int, _d("HTTP port")] = 8000
    api_keys: Annotated[list[str], _d("accepted Bearer keys; empty = no auth")] = []
    api_key_file: Annotated[str, _d("file with one accepted key per line")] = ""
    auth_exempt_paths: Annotated[list[str], _d("paths served without an API key when keys are set")] = \
        msgspec.field(default_factory=lambda: ["/livez", "/readyz", "/health", "/metrics", "/openapi.json"])
    max_concurrent_requests: Annotated[int, _d("requests in flight before 429")] = 256
    max_queued_requests: Annotated[int, _d("sequences waiting in the engine (for a row or KV memory) past "
                                           "which new requests get 503; 0 = no bound")] = 1024
    max_body_bytes: Annotated[int, _d("largest request body accepted (413 past it)")] = 8 << 20
    access_log: Annotated[bool, _d("log one line per HTTP request (method, route, status, duration, request id)")] = True
    coalesce_outputs: Annotated[bool, _d("a stream whose client reads slower than the engine produces gets what "
                                         "is waiting as one event (several tokens) instead of one event per step")] = True
    max_output_tokens: Annotated[int, _d("largest max_tokens accepted; 0 = context length")] = 0
    max_request_prompt_tokens: Annotated[int, _d("most prompt tokens one request may ask the engine to prefill: the "
                                                 "sum over its prompts (token ids counted, text estimated at 4 "
                                                 "characters a token) times n; 0 = no limit")] = 262144
    max_logprobs: Annotated[int, _d("most logprob alternatives a request may ask (logprobs, top_logprobs, "
                                    "prompt_logprobs), vLLM's --max-logprobs; -1 = the vocabulary size")] = 20
    tool_call_parser: Annotated[str, _d("how tool calls are read from a chat answer (tool_choice auto): a parser name "
                                        "(mlx-lm's, e.g. json_tools, qwen3_coder, mistral, plus llama3_json); "
                                        "empty = inferred from the model's chat template and vocabulary")] = ""
    responses_store_max: Annotated[int, _d("stored /v1/responses responses kept (least recently used evicted first); "
                                           "0 = none kept")] = 1024
    responses_store_mb: Annotated[int, _d("MiB the stored /v1/responses responses may take (their JSON); 0 = no "
                                          "bound but the count")] = 64
    first_token_timeout_s: Annotated[float, _d("seconds to the first token before 504; 0 = none")] = 0.0
    request_timeout_s: Annotated[float, _d("seconds for a whole request before 504; 0 = none")] = 0.0
    header_timeout_s: Annotated[float, _d("seconds a request's headers may take to arrive (from the connection or "
                                          "their first byte) before 408 and close; 0 = no limit")] = 10.0
    body_timeout_s: Annotated[float, _d("seconds a request's body may take to arrive after its headers before 408 "
                                        "and close; 0 = no limit")] = 120.0


class TransportConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    kind: Annotated[Literal["ipc", "tcp"], _d("ZeroMQ transport between stages")] = "ipc"
    run_dir: Annotated[str, _d("directory for ipc sockets: created if missing, else it must be an empty 0700 "
                               "directory of this user; empty = a fresh temporary one")] = ""
    tcp_host: Annotated[str, _d("host the tcp sockets bind to and clients reach")] = "127.0.0.1"
    tcp_base_port: Annotated[int, _d("first of the consecutive tcp ports the stages bind")] = 5550
    hwm: Annotated[int, _d("ZeroMQ high-water mark, messages per socket")] = 100_000
    max_message_mb: Annotated[int, _d("largest ZeroMQ message a stage accepts, MiB; a peer sending a larger "
                                      "one is disconnected")] = 512
    curve: Annotated[bool, _d("with tcp: encrypt and authenticate every socket with CurveZMQ (false only on a "
                              "network where every process may publish adapters, pause and read prompts)")] = True
    curve_server_key: Annotated[str, _d("with tcp: the server's CURVE key pair, a NAME.key_secret file "
                                        "(python -m parallm.keys new DIR NAME); empty = a fresh pair per start, "
                                        "its public key in <run dir>/server.key")] = ""
    curve_clients: Annotated[str, _d("with tcp: directory of the public key files (*.key) of raw clients and "
                                     "trainers allowed to connect")] = ""
    curve_keys: Annotated[list[str], _d("set by the supervisor for its stages (through the config pipe); "
                                        "leave empty")] = []


class SupervisorConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    heartbeat_s: Annotated[float, _d("seconds between stage heartbeats")] = 0.5
    dead_after_s: Annotated[float, _d("a stage whose heartbeat thread is silent this long is restarted")] = 10.0
    stall_after_s: Annotated[float, _d("a stage whose loop made no progress this long is restarted; 0 = never")] = 300.0
    ready_timeout_s: Annotated[float, _d("seconds a stage may take to report READY")] = 600.0
    restart_backoff_s: Annotated[float, _d("first restart delay; doubles per crash up to 30 s")] = 0.5
    drain_timeout_s: Annotated[float, _d("on SIGTERM, seconds in-flight requests get to finish")] = 30.0
    blas: Annotated[Literal["openblas", "none"] | None,
                    _d("BLAS preloaded for the engine on Linux when MLX computes on the CPU; unset = OpenBLAS if "
                       "installed")] = None
    allocator: Annotated[Literal["mimalloc", "system"] | None,
                         _d("malloc of the engine where it preloads OpenBLAS; unset = mimalloc if installed (the "
                            "environment variable PARALLM_NO_MIMALLOC=1 also keeps the system's)")] = None


class AdaptersConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The engine's adapter registry and how it admits requests that ask for a policy version."""

    history: Annotated[int, _d("versions kept per adapter name")] = 4
    merge_mb: Annotated[int | None, _d("an adapter version whose target layers are dense also keeps copies of their "
                                       "weights with its update folded in, when those copies take at most this "
                                       "many MiB: a pass where every row uses that version then costs what the "
                                       "base model's does; 0 = never; unset = 256 with a GPU, 0 on MLX's CPU "
                                       "device")] = None
    staleness_policy: Annotated[Literal["reject", "hold"],
                                _d("a request whose minimum policy version is not there yet: reject it (409) or "
                                   "hold it until the version is published")] = "reject"
    hold_timeout_s: Annotated[float, _d("with staleness_policy 'hold': seconds a request waits for its version")] = 120.0
    allowed_dirs: Annotated[list[str], _d("directories an adapter or a full-weight update may be loaded from by path "
                                          "(and everything under "
                                          "them); empty = the model's directory, the trainer's checkpoint "
                                          "directory (trainer.checkpointing.dir) and those of adapters.preload")] = []
    preload: Annotated[list[str], _d("NAME=PATH adapters loaded when the engine starts (--adapter, "
                                     "repeatable)")] = []
    weights_chunk_timeout_s: Annotated[float, _d("a full-weight update sent in chunks over the trainer's PUB socket "
                                                 "whose next chunk does not come within this many seconds is "
                                                 "dropped (the served weights stay as they were)")] = 60.0
    weights_staging_dir: Annotated[str, _d("where the chunks of a full-weight update wait until the last one has "
                                           "come (they take the update's size on disk); empty = a temporary "
                                           "directory")] = ""


class DetokenizerConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    rollout_hwm: Annotated[int, _d("rollout PUB high-water mark; past it rollouts are dropped and counted")] = 10_000


class PoliciesConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    models: Annotated[list[str], _d("NAME=PATH of a policy (a directory holding policy.json and weights.safetensors, "
                                    "docs/policies.md) served on /v1/rl/act and /v1/predict by the policy stage; "
                                    "repeatable")] = []
    lm: Annotated[bool | None, _d("serve the language model (model.path) too; unset = only when no policy model "
                                  "is given")] = None
    max_batch: Annotated[int, _d("most rows (observations) one policy forward takes; requests for the same "
                                 "model are stacked up to it")] = 256
    flush_us: Annotated[int, _d("microseconds a request may wait for others to batch with before its batch "
                                "runs anyway (0 = run what is there at once)")] = 200
    max_queued_rows: Annotated[int, _d("rows waiting for a forward past which new policy requests get 503 "
                                       "(retryable)")] = 65536
    episode_ttl_s: Annotated[float, _d("seconds an episode's server-side recurrent state is kept after its last "
                                       "step")] = 600.0
    max_episodes: Annotated[int, _d("episodes whose state the server keeps at most (least recently used "
                                    "dropped first)")] = 100_000


class Config(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    kv: KVConfig = KVConfig()
    spec: SpecConfig = SpecConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    detokenizer: DetokenizerConfig = DetokenizerConfig()
    server: ServerConfig = ServerConfig()
    transport: TransportConfig = TransportConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    trainer: TrainerConfig = TrainerConfig()
    trainers: Annotated[list[TrainerConfig], _d("several trainers at once: a file's [[trainer]] entries (each its "
                                                "own adapter, task and checkpoint directory)")] = []
    policies: PoliciesConfig = PoliciesConfig()
    log_level: Annotated[Literal["debug", "info", "warning", "error"], _d("log level of every stage")] = "info"
    log_format: Annotated[Literal["text", "json"], _d("log lines as text or one JSON object per line; lines about a "
                                                       "request carry its id either way")] = "text"

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> "Config":
        return msgspec.msgpack.decode(data, type=Config)


def serves_lm(config: Config) -> bool:
    """Whether the language-model stages run: policies.lm, or (unset) when no policy model is given."""
    return config.policies.lm if config.policies.lm is not None else not config.policies.models


def generates(config: Config) -> bool:
    """Whether a text generator is served: model.task generate, or unset (the supervisor resolves an unset
    task into generate or the pooling task of model.path before the stages start)."""
    return config.model.task in (None, "generate")


def pooling_only_problems(config: Config) -> list[str]:
    """What a server whose model.path is a pooling model (no generator) cannot do, by the setting that asks."""
    engine = config.engine
    asked = [("engine.replicas > 1", engine.replicas > 1), ("engine.remote_replicas", bool(engine.remote_replicas)),
             ("engine.tensor_parallel > 1", engine.tensor_parallel > 1), ("trainer.enabled", config.trainer.enabled),
             ("adapters.preload", bool(config.adapters.preload))]
    return [f"{name} needs a text generator; model.task {config.model.task} serves {config.model.path!r} as a "
            "pooling model only" for name, on in asked if on]
