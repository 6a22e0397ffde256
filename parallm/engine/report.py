"""What the engine reports about itself: its stats, the load on its KV and the pressure it makes, the
steps run, and the integrity check the engine stage runs when idle. EngineReport is a base of Engine
(engine.py), which sets every attribute annotated below; none of it changes the engine."""

from __future__ import annotations

import msgspec

from parallm.adapters import AdapterManager
from parallm.config import AdaptersConfig, EngineConfig
from parallm.protocol import EngineStats

from .blocks import BlockManager
from .counters import StepCounters
from .memory import oom_retries
from .output import OutputProcessor
from .plan import KVBudget
from .prefix_tier import PrefixDiskTier
from .pressure import KVLoad, PressureGate, kv_load
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence
from .spec import SpecDecoder
from .trace import StepTracer


class EngineReport:
    scheduler: Scheduler
    blocks: BlockManager
    runner: ModelRunner
    budget: KVBudget
    adapters: AdapterManager
    output: OutputProcessor
    trace: StepTracer
    counters: StepCounters
    pressure: PressureGate
    disk_tier: PrefixDiskTier | None
    spec: SpecDecoder | None
    config: EngineConfig
    adapter_settings: AdaptersConfig
    kv_budget_bytes: int
    kv_capacity_tokens: int
    weight_dtype: dict[str, str] | None
    weights_version: int
    weights_updates: int
    _requests: dict[str, list[Sequence]]

    def kv_load(self) -> KVLoad:
        """Tokens live and waiting sequences hold or need, against the live KV (pressure.KVLoad)."""
        s = self.scheduler
        return kv_load(s.running + s.prefilling, s.waiting, self.budget.budget_tokens)

    @property
    def steps(self) -> int:
        """Steps run since start (or warm_up); ranks of a group compare it (distributed.py)."""
        return self.counters.steps

    def stats(self) -> EngineStats:
        s = self.scheduler
        b = self.blocks
        r = self.runner
        adapters = self.adapters.stats()
        swap_ms = self.output.swap_ms
        adapters.load_to_first_token_ms = sorted(swap_ms)[len(swap_ms) // 2] if swap_ms else None
        burst, last_burst = self.trace.stats()
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting), prefilling=len(s.prefilling),
            kv_blocks_total=b.num_blocks, kv_blocks_used=b.num_used, kv_blocks_free=b.num_free,
            kv_blocks_cached=b.num_cached,
            kv_budget_bytes=self.kv_budget_bytes, live_token_slots=self.budget.budget_tokens,
            prefix_queried_tokens=s.prefix_queried_tokens, prefix_hit_tokens=s.prefix_hit_tokens,
            prefix_partial_hits=s.partial_hits,
            prefix_evictions=b.evictions, preemptions=s.preemptions,
            priority_preemptions=s.priority_preemptions, admissions_delayed=s.delayed_steps,
            **self.counters.stats(),
            prompt_tokens_computed=self.output.prompt_computed,
            generated_tokens=self.output.generated, scored_tokens=self.output.scored,
            live_rows=r.live.rows, live_capacity=r.live.capacity, live_bytes=r.live.nbytes,
            pool_bytes=b.num_cached * b.block_size * r.live.bytes_per_token,
            bytes_per_token=r.live.bytes_per_token, penalty_state=r.penalties.active, adapters=adapters,
            compiled_decode=r.compiled.stats() if r.compiled else {},
            settings=msgspec.to_builtins(self.config), adapter_settings=msgspec.to_builtins(self.adapter_settings),
            weight_dtype=self.weight_dtype, weights_version=self.weights_version, weights_updates=self.weights_updates,
            recomputed_tokens=s.recomputed_tokens, oom_retries=oom_retries(), burst=burst, last_burst=last_burst,
            kv_copied_bytes=dict(r.live.copied),
            spec=self.spec.stats() if self.spec is not None else None,
            **self._kv_stats())

    def _kv_stats(self) -> dict:
        load = self.kv_load()
        return dict(kv_capacity_tokens=self.kv_capacity_tokens, kv_live_tokens=load.live_tokens,
                    kv_waiting_tokens=load.waiting_tokens, kv_utilization=load.utilization, kv_demand=load.demand,
                    kv_pressure=self.pressure.state(load),
                    kv_pressure_rejections=self.pressure.rejected,
                    kv_disk=self.disk_tier.stats() if self.disk_tier is not None else None)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        live = self.runner.live
        r, c = self.scheduler.shape
        assert (live.rows, live.capacity) == (r, c) or not self.scheduler.has_work(), \
            f"runner buffer {live.rows}x{live.capacity} differs from the plan {r}x{c}"
        for rid, seqs in self._requests.items():
            assert any(not s.is_finished for s in seqs), f"finished request {rid} still tracked"
