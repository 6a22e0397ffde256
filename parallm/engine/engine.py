"""The engine core: continuous batching of an mlx-lm model, driven by `step()`.

No sockets, threads or asyncio: the engine stage (and the tests) call `add_request`, `abort`,
`step`, `score` and `stats` from one loop. See docs/engine.md and docs/scheduling.md.
"""

from __future__ import annotations

import time
from typing import Callable, get_args

import mlx.core as mx
import msgspec

from parallm.adapters import AdapterError, AdapterManager, LoadedAdapter, VersionPolicy
from parallm.adapters.lora import packable
from parallm.engine.weights import Applied, WeightsError, WeightSwapper, rebase_adapters
from parallm.config import Config, auto_adapter_merge_mb, auto_prefill_tokens, resolve_engine_config
from parallm.device import compute_device
from parallm.protocol import FinishReason
from parallm.text.grammar import check_size

from .blocks import BlockManager
from .constraints import Constraints, GrammarError, tokenizer_from_file
from .counters import StepCounters
from .think_gate import thinking_from_file
from .compat import check_model, kv_format_for
from .faults import PassState, log, prefill_passes
from .memory import (auto_kv_budget_bytes, bound_cuda_cache, fit_state_rows, limit_buffer_cache, set_wired_limit,
                     store_blocks, weight_bytes)
from .images import attach_images
from .model import EngineModel
from .pacing import PrefillPacer, context_weight
from .output import OutputProcessor, StepOutputs, unseen_versions
from .plan import KVBudget, Plan, PrefillWork
from .prefix_tier import PrefixDiskTier, open_disk_tier
from .pressure import PressureGate
from .report import EngineReport
from .scoring import EngineScoring
from .request import Request, RequestRejected, ScoreResult, SeqOutput, validate
from .runner import Launch, ModelRunner
from .sampling import splitmix64
from .scheduler import Scheduler
from .spec import SpecDecoder, spec_decoder
from .trace import StepTracer
from .sequence import Sequence
from .warmup import warm_up

Output = SeqOutput | ScoreResult
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


def _model_dir(config: Config):
    """The served model's directory (its tokenizer.json compiles grammar constraints)."""
    from parallm.models import resolve_model

    return resolve_model(config.model).path


class Engine(EngineReport, EngineScoring):
    def __init__(self, model: EngineModel, config: Config) -> None:
        """The engine over `model`, with the `engine` and `adapters` sections of `config`. Every
        setting left unset is resolved here, once, and reported in stats (`settings`)."""
        self.model = model.module
        self.vision = model.vision  # a vision-language model's encoder (parallm/vision), or None
        self.draft_model = model.draft  # spec.mode draft's model, or None
        choice = model.dtype_choice  # the weights' dtype policy's decision (models/dtype.py), for stats
        self.weight_dtype = None if choice is None else {"stored": choice.stored, "served": choice.served,
                                                         "reason": choice.reason}
        device = compute_device()
        on_cpu = device == "cpu"
        settings = resolve_engine_config(config.engine, device)
        limit_buffer_cache(settings.buffer_cache_mb)
        info = check_model(self.model)
        if info.has_state:  # the recurrent state after a prefix is not in its KV blocks (engine/state.py)
            settings = msgspec.structs.replace(settings, prefix_cache=False)
        if info.prefill_alone:  # its recurrent scan would run over a padded row's pad tokens (compat.py)
            settings = msgspec.structs.replace(settings, max_prefill_rows=1)
        self.model_type = info.model_type
        self.vocab_size = model.resolved_vocab_size()
        self.eos_token_ids = [int(t) for t in model.eos_token_ids]
        self.max_model_len = int(model.max_model_len)
        set_wired_limit()  # Apple silicon only
        self.kv_budget_bytes = (int(settings.kv_budget_mb * (1 << 20)) if settings.kv_budget_mb
                                else auto_kv_budget_bytes(weight_bytes(self.model)))
        if info.has_state:
            settings = msgspec.structs.replace(settings, max_num_seqs=fit_state_rows(
                self.kv_budget_bytes, info.layout.state_bytes_per_row, settings.max_num_seqs))
        bs = settings.block_size
        self.kv_format = kv_format_for(self.model, info, config.kv.bits, config.kv.group_size)  # kv.bits: kv_format.py
        # one block store holds the live sequences and the prefix cache (cache.LiveKV, blocks.py)
        num_blocks = store_blocks(self.kv_budget_bytes, self.kv_format.bytes_per_token(info.shapes),
                                  info.state_bytes_per_row, settings)
        merge_mb = config.adapters.merge_mb
        self.adapter_settings = msgspec.structs.replace(
            config.adapters, merge_mb=auto_adapter_merge_mb(on_cpu) if merge_mb is None else merge_mb)
        self.adapters = AdapterManager(self.model, history=self.adapter_settings.history,
                                       merge_mb=self.adapter_settings.merge_mb)
        self.versions = VersionPolicy(self.adapters)
        self.weights = WeightSwapper(self.model)
        self.max_logprobs = config.server.max_logprobs  # logprob alternatives a request may ask (-1: the vocabulary)
        self.weights_version = 0   # the base model's policy version: full-weight updates applied (weights.py)
        self.weights_updates = 0
        self.runner = ModelRunner(self.model, info, vocab_size=self.vocab_size, num_blocks=num_blocks, block_size=bs,
                                  eos_ids=self.eos_token_ids, lora=self.adapters.router, compile=settings.compile,
                                  fast_math=bool(settings.fast_math), compiled_decode=settings.compiled_decode,
                                  in_place_kv_mb=settings.in_place_kv_mb,
                                  unfused_prefill_keys=settings.unfused_prefill_keys,
                                  unfused_decode=settings.unfused_decode, vision=self.vision,
                                  kv_format=self.kv_format, paged_decode=settings.paged_decode or "auto",
                                  write_in_place=bool(settings.kv_write_in_place),
                                  fused_projections=bool(settings.fused_projections))
        # fused_projections reports what runs: off where no group of the model could be fused
        resolved: dict = {"kv_budget_mb": self.kv_budget_bytes / (1 << 20),
                          "fused_projections": self.runner.fused is not None}
        if settings.buffer_cache_mb is None and (cap := bound_cuda_cache(self.kv_budget_bytes,
                                                                         weight_bytes(self.model))) is not None:
            resolved["buffer_cache_mb"] = cap / (1 << 20)
        if settings.max_prefill_tokens is None:
            resolved["max_prefill_tokens"] = auto_prefill_tokens(device, settings.mixed_passes and self.runner.can_pack)
        self.config = settings = msgspec.structs.replace(settings, **resolved)
        self.budget = KVBudget(budget_tokens=num_blocks * bs, max_rows=settings.max_num_seqs,
                               max_len=self.max_model_len + settings.max_prefill_tokens + 1)
        # free blocks keep their prefix-cache key until a new block is needed; past this share of the
        # store, the least recently used of them go before never-used blocks do (the store grows less)
        cached = int(num_blocks * settings.prefix_pool_fraction) if settings.prefix_cache else 0
        self.blocks = BlockManager(num_blocks, bs, max_cached=cached)
        self.pacer = PrefillPacer(settings.prefill_pass_s or 0.0, settings.max_prefill_tokens, context_weight(self.model))
        self.scheduler = Scheduler(budget=self.budget, max_prefill_tokens=settings.max_prefill_tokens, pacer=self.pacer,
                                   blocks=self.blocks, block_size=bs, max_prefill_rows=settings.max_prefill_rows,
                                   prefix_cache=settings.prefix_cache,
                                   partial_blocks=settings.prefix_cache and bool(settings.prefix_partial_blocks),
                                   writeback_interval=settings.writeback_interval,
                                   priority_aging_s=settings.priority_aging_s,
                                   prefill_buckets=bool(settings.prefill_buckets) and not info.prefill_alone,
                                   admit_delay_factor=settings.admit_delay_factor or 0.0)
        self.kv_capacity_tokens = num_blocks * bs  # the block store's tokens (live and cached alike)
        if settings.kv_preallocate:
            self.runner.live.ensure(num_blocks)  # the whole budget now: the store never grows (never copies itself)
        self.pressure = PressureGate(config.kv.pressure_threshold)
        self.disk_tier: PrefixDiskTier | None = None
        if config.kv.disk_dir and settings.prefix_cache:
            if settings.tensor_parallel > 1:
                log.warning("kv.disk_dir is ignored with engine.tensor_parallel > 1 (each rank holds a shard)")
            else:
                self.disk_tier = open_disk_tier(config.kv, config.model.path, self.model, self.kv_format, info.shapes,
                                                bs, self.runner, self.blocks)
        self.constraints = Constraints(self.vocab_size, self.eos_token_ids, lambda: tokenizer_from_file(
            _model_dir(config) / "tokenizer.json", self.vocab_size, self.eos_token_ids),
            thinking=lambda: thinking_from_file(_model_dir(config) / "tokenizer.json"),
            max_bytes=settings.max_constraint_bytes)
        self.runner.constraints = self.constraints
        self._requests: dict[str, list[Sequence]] = {}
        self.output = OutputProcessor(self.scheduler, self.eos_token_ids, self._requests, self._execute)
        self._launches: list[Launch] = []
        self._owed: list[Output] = []  # outputs of steps that score() ran, for the next step()
        self._score_counter = 0
        self._seq_counter = 0
        self._seed_counter = 0
        self.counters = StepCounters()  # steps, decode batch sizes, seconds by phase (counters.py)
        self.failed_rows = 0  # requests ended by a pass that failed for them alone (faults.py)
        self.trace = StepTracer()  # what each step ran and where its time went, a burst at a time (trace.py)
        self.spec: SpecDecoder | None = spec_decoder(config.spec, settings, info, self)  # speculative decoding

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        try:
            request.prompt_ids = [int(t) for t in request.prompt_ids]
        except (TypeError, ValueError):
            raise RequestRejected("prompt token ids must be integers", "prompt") from None
        if request.rid in self._requests:
            raise RequestRejected(f"request id {request.rid!r} is already in use", "rid")
        validate(request, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                 max_num_seqs=self.config.max_num_seqs, max_logprobs=self.max_logprobs)
        spec = request.spec
        p, n, P = spec.params, spec.n, len(request.prompt_ids)
        if not self.scheduler.fits_alone(P + p.max_tokens + 1) or not self.scheduler.fits_alone(
                P + self.scheduler.headroom, n):
            raise RequestRejected(
                f"the request needs more KV memory than the engine has ({self.budget.budget_tokens} token slots "
                f"in the block store); shorten the prompt, max_tokens or n", "max_tokens")
        self.pressure.admit(self.kv_load(), P * n)  # past kv.pressure_threshold: a retryable 503
        try:
            lora = self.versions.resolve(spec.adapter, spec.adapter_version, spec.min_version, spec.max_staleness)
        except AdapterError as exc:
            raise RequestRejected(exc.message, "adapter", status=exc.status, code=exc.code) from None
        if p.seed is not None:
            base = p.seed
        else:
            base = splitmix64((self.config.seed << 32) ^ self._seed_counter)
            self._seed_counter += 1
        images = attach_images(request.prompt_ids, request.images, self.vision)
        seqs = []
        for i in range(n):
            self._seq_counter += 1
            seqs.append(Sequence(seq_id=self._seq_counter, rid=request.rid, index=i,
                                 prompt_ids=list(request.prompt_ids), params=p, seed=base + i,
                                 adapter=self._cache_key(lora), adapter_name=lora.name if lora else "",
                                 adapter_version=lora.version if lora else self.weights_version, lora=lora,
                                 pinned=bool(spec.adapter_version), priority=spec.priority, images=images))
        if p.constraint is not None:
            try:
                check_size(p.constraint, self.config.max_constraint_bytes)
                self.constraints.attach(seqs, p.constraint)
            except GrammarError as exc:
                raise RequestRejected(f"constraint: {exc}", "constraint") from None
        self._requests[request.rid] = seqs
        self.scheduler.add(seqs)

    def abort(self, rid: str, reason: str = "abort", index: int | None = None) -> bool:
        """Stop request `rid` (or only its sample `index`); its sequences end with finish_reason
        `reason` (one of protocol.FinishReason: it goes into the step's outputs, which a receiver
        would reject whole for another value) in the next step's outputs, keeping the tokens already
        sampled."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"abort reason {reason!r} is not one of {', '.join(FINISH_REASONS)}")
        seqs = self._requests.get(rid)
        if not seqs:
            return False
        live = [s for s in seqs if not s.is_finished and (index is None or s.index == index)]
        if not live:
            return False
        self.scheduler.abort(live)
        self.runner.execute(self.scheduler.take_ops(), self.blocks.peak)
        self.output.defer_abort(live, reason)
        return True

    def request_ids(self) -> list[str]:
        """Ids of the requests with a sequence not yet finished."""
        return list(self._requests)

    @property
    def last_batch_size(self) -> int:
        return self.counters.last_batch

    def owes_outputs(self) -> bool:
        """Outputs are decided but not yet returned (aborted sequences, launched steps)."""
        return bool(self.output.aborted or self._launches or self._owed)

    def flush(self) -> list[Output]:
        """What is owed without starting new work: a paused engine still reports its aborts and
        the tokens of steps it had launched."""
        out = StepOutputs()
        self.output.report_aborts(out)
        while self._launches:
            self.output.read(self._launches.pop(0), out)
        return self._with_owed(out)

    def has_work(self) -> bool:
        return bool(self.scheduler.has_work() or self._launches or self.output.aborted or self._owed)

    def _with_owed(self, out: StepOutputs) -> list[Output]:
        if not self._owed:
            return out.items()
        items, self._owed = self._owed + out.items(), []
        return items

    # ------------------------------------------------------------------ the loop
    def step(self, emit: Callable[[list[Output]], None] | None = None,
             arrivals: Callable[[], None] | None = None) -> list[Output]:
        """One scheduling round: admissions, at most one prefill pass, one decode pass, and the
        tokens read back: one SeqOutput per sequence that got tokens or finished, and a
        ScoreResult per score request finished. The prefill pass samples the first token of every
        prompt it finishes and finishes the scores it completes; with `emit`, those outputs are
        handed to it as soon as the prefill pass is read (before the decode pass runs) instead of
        being returned with the rest. Where the runner can pack them (`engine.mixed_passes`), the
        prompt chunks and the decode rows share one pass. `arrivals`, called between the prefill
        pass and the decode pass, may add requests (add_request): those that arrived while the
        prefill pass ran join the decode pass as a mixed one (`_join`) instead of waiting for the
        next step."""
        t0 = time.perf_counter()
        self.trace.begin(self.counters.begin())
        out = StepOutputs()
        self.output.report_aborts(out)
        plan = self._schedule(t0)
        kind = self._run(plan, out, emit, arrivals)  # each pass's tokens go through self.output as it is read
        self.trace.end(kind, self.has_work())
        return self._with_owed(out)

    def _schedule(self, t0: float) -> Plan:
        plan = self.scheduler.schedule()
        self.trace.plan(len(plan.admitted), len(plan.preempted))
        self._execute(plan.ops)
        self.scheduler.ops_ran()
        self._phase("schedule", time.perf_counter() - t0)
        return plan

    def _execute(self, ops: list) -> None:
        self.trace.ops(ops)
        self.runner.execute(ops, self.blocks.reach(self.scheduler.blocks_ahead()))

    def _run(self, plan: Plan, out: StepOutputs, emit: Callable[[list[Output]], None] | None,
             arrivals: Callable[[], None] | None = None) -> str:
        """Run the step's passes; what they were (a StepRecord kind, trace.py)."""
        t1 = time.perf_counter()
        work = plan.prefill
        if work is not None:
            self.trace.prefill(len(work.seqs), sum(work.lengths), work.length, max(work.starts) + work.length,
                               self.runner.live.capacity)
        if work is not None and self._can_mix(work):
            if self._mixed_pass(work, out, emit, t1):
                return "mixed"
        if work is not None:
            self._prefill(work, out, emit)
            self._observe_padded(time.perf_counter() - t1, work)
            if arrivals is not None:
                self._phase("prefill", time.perf_counter() - t1)
                if self._join(arrivals, out, emit):  # records its own phases
                    return "prefill+mixed"
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        verified = self.spec is not None and self.spec.step(out)  # speculated: verify pass read
        launched = not verified and self._launch()
        t3 = time.perf_counter()
        # overlap keeps the pass just launched in flight and reads it next step, after launching
        # the following one; a pass sampling the first token of a newly loaded adapter version is
        # read now instead, so that token (what a trainer waits for) is not held back by a launch
        # (a grammar-constrained row's next mask reads this pass's token once the next forward is launched)
        keep = 1 if (launched and self.config.overlap and not self._launches[-1].fresh) else 0
        while len(self._launches) > keep:
            self.output.read(self._launches.pop(0), out)
        t4 = time.perf_counter()
        for name, seconds in (("prefill", t2 - t1), ("launch", t3 - t2), ("read", t4 - t3)):
            self._phase(name, seconds)
        return "+".join(k for k, ran in (("prefill", work is not None), ("decode", launched or verified)) if ran) or "read"

    def _mixed_pass(self, work: PrefillWork, out: StepOutputs, emit: Callable[[list[Output]], None] | None,
                    t1: float) -> bool:
        contexts = [s.num_computed for s in self.scheduler.running]  # decoded in the same pass
        if not self._mixed(work, out, emit):
            return False
        self._phase("mixed", seconds := time.perf_counter() - t1)
        self.pacer.observe(seconds, work.starts, work.lengths, contexts)
        return True

    def _join(self, arrivals: Callable[[], None], out: StepOutputs,
              emit: Callable[[list[Output]], None] | None) -> bool:
        """After a prefill pass that finished every prompt in the prefill region: the requests that
        `arrivals` adds (those that arrived while the pass ran) are scheduled now and their prompts
        ride in the decode pass, run as a mixed one. A short request that arrives while another's
        prompt is prefilled then gets its first token at the end of this step rather than after this
        step's decode pass and the next step's prefill pass (issue 30: beside a client that sends short
        constrained requests back to back, a canary's p99 was 2.2x its idle p99 on a CPU, two steps where
        an idle one takes one). True if the step's decode rows ran in that mixed pass; False if nothing
        joined or the prompts cannot ride in it (they were prefilled apart: the decode pass follows)."""
        if not (self.config.mixed_passes and self.runner.can_pack) or self.scheduler.prefilling or \
                not self._wants_decode():
            return False  # a prompt still being chunked keeps its share of the steps (fair prefill)
        arrivals()
        if not self.scheduler.waiting:
            return False
        t1 = time.perf_counter()
        work = self._schedule(t1).prefill
        if work is None:
            return False
        t2 = time.perf_counter()
        if self._can_mix(work) and self._mixed_pass(work, out, emit, t2):
            return True
        self._prefill(work, out, emit)
        self._phase("prefill", seconds := time.perf_counter() - t2)
        self._observe_padded(seconds, work)
        return False

    def _observe_padded(self, seconds: float, work: PrefillWork) -> None:
        """A padded prefill pass to the pacer: each row's L positions attend over the pass's whole span, so
        each counts as a chunk from the furthest start (a short prompt beside a long one costs as much as
        the long one's chunk)."""
        self.pacer.observe(seconds, [max(work.starts)] * len(work.seqs), [work.length] * len(work.seqs))

    def _phase(self, name: str, seconds: float) -> None:
        self.counters.phase_s[name] += seconds
        self.trace.phase(name, seconds)

    def _wants_decode(self) -> bool:
        seqs = self.scheduler.running
        return bool(seqs) and not all(s.scheduled_outputs >= s.params.max_tokens for s in seqs)

    def _launch(self) -> bool:
        if not self._wants_decode():
            return False
        seqs = self.scheduler.running
        launch = self.runner.decode(seqs, self._decode_inputs(seqs), [s.scheduled_outputs for s in seqs],
                                    self._launches[-1] if self._launches else None)
        self._launched(seqs, launch)
        return True

    def _decode_inputs(self, seqs: list[Sequence]) -> mx.array:
        return self.runner.decode_inputs(seqs, self._launches[-1] if self._launches else None)

    def _launched(self, seqs: list[Sequence], launch: Launch) -> None:
        if self.adapters.published:
            launch.fresh = unseen_versions(seqs)
        for s in seqs:
            s.num_computed += 1
            s.inflight += 1
        self._launches.append(launch)
        self.trace.decode(len(seqs))
        self.counters.decoded(len(seqs))

    def _can_mix(self, work: PrefillWork) -> bool:
        """Whether this step's prefill chunks can ride in the decode pass (runner.mixed): rows
        to decode, fast-math kernels that read packed passes, no prompt logprobs asked for, and
        adapters that can share a packed pass (lora.packable: any mix without expert-layer updates)."""
        if not self.config.mixed_passes or not self._wants_decode():
            return False
        rows = self.scheduler.running + work.seqs
        if any(s.prompt_logprobs is not None or s.images is not None for s in work.seqs):
            return False
        return packable([s.lora for s in rows]) and self.runner.can_pack

    def _mixed(self, work: PrefillWork, out: StepOutputs, emit: Callable[[list[Output]], None] | None) -> bool:
        """Decode every running row and prefill this step's chunks in one pass, then account
        both as a prefill pass and a decode pass would be (the prompts first: a finish read from
        the decode rows moves rows, and those moves copy what the prompts' rows have computed).
        False if the pass raised: it is undone and the step runs them as separate passes (faults.py)."""
        seqs = self.scheduler.running
        before = PassState.of(self.runner)
        try:
            launch, first = self.runner.mixed(seqs, self._decode_inputs(seqs), [s.scheduled_outputs for s in seqs],
                                              work, self._launches[-1] if self._launches else None)
        except Exception as exc:  # noqa: BLE001 - undone; the separate passes tell whose failure it is
            before.restore(self.runner)
            log.warning("a mixed pass failed (%s: %s); running its prompts and decode rows apart",
                        type(exc).__name__, exc)
            return False
        self._launched(seqs, launch)
        self.counters.mixed_passes += 1
        firsts = StepOutputs() if emit is not None else out
        self.output.prefill_done(work, {}, first, firsts)
        if emit is not None and firsts:
            emit(firsts.items())
        while self._launches:
            self.output.read(self._launches.pop(0), out)
        return True

    def _prefill(self, work: PrefillWork, out: StepOutputs, emit: Callable[[list[Output]], None] | None) -> None:
        """Run a prefill pass; the first tokens it samples go to `emit`, else into `out`. A pass that
        raises ends only its own prompts (faults.prefill_passes)."""
        firsts = StepOutputs() if emit is not None else out
        for done, prompt_lps, first in prefill_passes(self, work):
            self.output.prefill_done(done, prompt_lps, first, firsts)
        if emit is not None and firsts:
            emit(firsts.items())

    # ------------------------------------------------------------------ start-up
    def warm_up(self) -> float:
        """Build what MLX builds on first use before the first real request (warmup.py); leaves no
        request, cached block or counter behind. Returns the seconds it took.

        It also decides whether prompt chunks attend over the block store in place (its probe pass,
        paged_decode.check_paged_prefill): the warm-up's prompts are under one block, so no chunk of theirs
        follows a prefix hit, and the probe ran inside the first real step whose chunk did. Served on the
        2-core CPU that was a 1.2-1.6 s step of the second 64 KiB tool request (a 2-token chunk after a
        32-token hit), which every running request waited for (issue 30, perf/results/isolation-tool16-cpu.md)."""
        if self.has_work():
            raise RuntimeError("warm_up() must run before any request")
        tier, self.runner.kv_tier = self.runner.kv_tier, None  # warm-up prompts are not the disk tier's
        if self.blocks is not None:
            self.blocks.tier = None
        grammar = self.constraints.prepare()  # the grammars' tokenizer, built on the compile thread meanwhile

        def grammars() -> bool:
            try:
                grammar.result()
            except GrammarError:
                return False  # no grammar constraints on this model: their requests are refused with a 400
            return True

        try:
            seconds = warm_up(self, grammars)
            self.constraints.forget()  # the grammar its rows compiled, if any
            t0 = time.perf_counter()
            _ = self.runner.prefills_in_place  # its probe on a scratch store of its own: nothing to reset
            seconds += time.perf_counter() - t0
        finally:
            self.runner.kv_tier = tier
            if self.blocks is not None:
                self.blocks.tier = tier
        self._reset_counters()
        return seconds

    def close(self, timeout: float = 30.0) -> None:
        """Write the disk tier's queued blocks (up to `timeout`) and stop its writer thread. The row ops
        still pending run first, so the blocks keyed since the last step go too (write_through);
        with evict_only every cached block leaves memory now, so it is written too."""
        if self.disk_tier is None:
            return
        self._execute(self.scheduler.take_ops())
        end = time.monotonic() + timeout
        if self.disk_tier.policy == "evict_only":
            spilled = self.disk_tier.spill(timeout)
            log.info("disk tier: %d cached blocks written at shutdown", spilled)
        self.disk_tier.disk.close(max(0.0, end - time.monotonic()))

    def _reset_counters(self) -> None:
        self.counters.reset()
        self.output.prompt_computed = self.output.generated = self.output.scored = 0
        self.trace.reset()
        self._seq_counter = self._seed_counter = self._score_counter = 0
        self.scheduler.prefix_queried_tokens = self.scheduler.prefix_hit_tokens = self.scheduler.partial_hits = 0
        self.runner.live.copied.clear()
        if self.spec is not None:
            self.spec.reset()

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, name: str, *, config: dict | None = None, weights: bytes | dict | None = None,
                     path: str = "", format: str = "auto", version: int = 0) -> LoadedAdapter:
        """Add a version of adapter `name` (raises parallm.adapters.AdapterError, changing nothing).
        Called between steps, it is used from the next pass on: new requests get it unless they pin
        another version; running sequences keep theirs (see follow_latest)."""
        return self.adapters.load(name, config=config, weights=weights, path=path, fmt=format, version=version)

    def unload_adapter(self, name: str) -> int:
        """Forget adapter `name`: new requests for it are refused; running ones finish under theirs."""
        return self.adapters.unload(name)

    def policy(self) -> dict[str, int]:
        return self.adapters.policy()

    def set_default_adapter(self, name: str) -> None:
        """Requests that name no adapter use adapter `name` from now on ("": the base model)."""
        self.adapters.set_default(name)

    def drop_cached_blocks(self) -> int:
        """Forget every cached prefix block no sequence holds (ResetPrefixCache); returns how many."""
        return self.blocks.drop_cached() if self.blocks is not None else 0

    # ------------------------------------------------------------------ full-weight updates
    def _cache_key(self, lora: LoadedAdapter | None) -> str:
        """A sequence's prefix-cache key: its adapter version and, after a full-weight update, the base
        weights' version (so KV computed under other weights is never hit)."""
        key = lora.identity if lora else ""
        return f"{key}#w{self.weights_version}" if self.weights_version else key

    def update_weights(self, *, path: str = "", tensors: dict | None = None, version: int = 0,
                       complete: bool = True) -> Applied:
        """New base-model weights from a safetensors directory or tensors, applied now (call it between
        steps), one layer at a time (weights.py). With `complete` (the last chunk of an update) the base
        model becomes policy version `version` (0: current + 1): running base-model sequences carry it
        from their next token, and requests admitted from then on use a new prefix-cache key (the
        blocks cached under the old weights are dropped). Loaded adapters keep applying on top of the
        new weights (weights.rebase_adapters). Raises WeightsError, which leaves the weights as they
        were (a directory or a chunk is checked whole before any is applied)."""
        if version and version <= self.weights_version:
            raise WeightsError(f"version {version} is not newer than the base model's {self.weights_version}",
                               status=409, code="version_conflict")
        applied = self.weights.apply_dir(path) if path else self.weights.apply(tensors or {})
        rebase_adapters(self.adapters)  # loaded adapters keep applying on top of the new weights (as vLLM's)
        if complete:
            self.weights_version = version or self.weights_version + 1
            self.weights_updates += 1
            self.blocks.drop_cached()
            for seqs in self._requests.values():
                for seq in seqs:
                    if seq.lora is None:
                        seq.adapter_version = self.weights_version
        return applied

    def follow_latest(self) -> int:
        """Move every running, unpinned adapter sequence to its adapter's latest version (the
        Pause(keep)/Resume semantics, adapters.VersionPolicy); returns how many moved. Passes
        already launched keep the version they were built with, and their tokens report it."""
        return self.versions.follow_latest(s for seqs in self._requests.values() for s in seqs)
