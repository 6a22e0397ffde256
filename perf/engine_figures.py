"""The engine's own figures for one served benchmark run: what its steps ran and where the time went.

A served run's client-side numbers (tok/s, TTFT, ITL) say that something was slow, not what.
`snapshot(router)` reads the engine's stats over the raw ZeroMQ client before and after a run;
`figures(before, after)` keeps what explains the run: the counters' increase (preemptions and the
tokens they threw away, OOM retries, mixed passes, prompt tokens computed), the KV budget and the
live buffer's shape, the settings that shape a step, and the run's burst of steps
(parallm/engine/trace.py: steps by kind, step-time percentiles, prefill tokens per pass, row
operations, first-seen pass shapes, the slowest steps with their phases). `lines(figures)` is its
markdown.

The burst is the engine's last one, so `snapshot` waits out the engine's idle gap first; a run's
burst starts at its first step only if the engine was idle that long before it (`settle`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

COUNTERS = ("steps", "preemptions", "priority_preemptions", "recomputed_tokens", "oom_retries", "mixed_passes",
            "prompt_tokens_computed", "generated_tokens", "prefix_hit_tokens", "prefix_partial_hits",
            "admissions_delayed")
SETTINGS = ("max_num_seqs", "max_prefill_tokens", "max_prefill_rows", "mixed_passes", "overlap", "fast_math",
            "prefix_cache", "prefix_partial_blocks", "kv_budget_mb", "buffer_cache_mb", "unfused_decode",
            "unfused_prefill_keys", "admit_delay_factor", "prefill_buckets")


def settle() -> None:
    """Wait out the engine's idle gap, so that its next burst of steps is the next run's alone."""
    from parallm.engine.trace import BURST_GAP_S

    time.sleep(BURST_GAP_S + 0.2)


def snapshot(router: str) -> dict[str, Any]:
    """The engine's stats as plain data (EngineStats), {} if it did not answer."""
    from parallm.client import AsyncClient

    async def ask() -> Any:
        async with AsyncClient(router, timeout=30.0) as client:
            return await client.stats("engine")

    try:
        return msgspec.to_builtins(asyncio.run(ask()))
    except Exception as exc:  # noqa: BLE001 - the figures explain a run; their absence must not fail it
        return {"error": f"{type(exc).__name__}: {exc}"}


def figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What explains the run between two snapshots (module docstring)."""
    if not after or "error" in after:
        return {"error": after.get("error", "no stats")}
    settings = after.get("settings") or {}
    burst = after.get("last_burst") or after.get("burst") or {}
    return {
        "counters": {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS},
        "kv_budget_mib": round(after.get("kv_budget_bytes", 0) / (1 << 20), 1),
        "live_token_slots": after.get("live_token_slots", 0),
        "live": {"rows": after.get("live_rows", 0), "capacity": after.get("live_capacity", 0),
                 "mib": round(after.get("live_bytes", 0) / (1 << 20), 1)},
        "pool_mib": round(after.get("pool_bytes", 0) / (1 << 20), 1),
        "kv_copied_bytes": {k: v - (before.get("kv_copied_bytes") or {}).get(k, 0)
                            for k, v in (after.get("kv_copied_bytes") or {}).items()},
        "weight_dtype": after.get("weight_dtype"),
        "settings": {k: settings.get(k) for k in SETTINGS},
        "loop_ms_mean": (after.get("loop") or {}).get("ms_mean", {}),
        "burst": burst,
    }


def _step(r: dict[str, Any]) -> str:
    phases = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.get("phase_ms", {}).items(), key=lambda kv: -kv[1])
                       if v >= 0.5)
    ops = ", ".join(f"{k} {v}" for k, v in r.get("ops", {}).items())
    prefill = f", prefill {r['prefill_rows']}x{r['prefill_length']} ({r['prefill_tokens']} tokens, span " \
        f"{r.get('prefill_span', 0)}{', a new prefill shape' if r.get('new_prefill_shape') else ''})" \
        if r.get("prefill_rows") else ""
    return (f"step {r['step']}: {r['ms']:.0f} ms {r['kind']}, {r['decode_rows']} decode rows{prefill}"
            f"{', first of its shape' if r.get('new_shape') else ''}; ms: {phases}" + (f"; ops: {ops}" if ops else ""))


def lines(label: str, f: dict[str, Any]) -> list[str]:
    """Markdown lines for one run's figures."""
    if "error" in f:
        return [f"- {label}: no engine figures ({f['error']})"]
    c, b, live = f["counters"], f["burst"], f["live"]
    out = [f"- {label}: {c['steps']} steps, passes {b.get('passes', {})}; step ms p50 {b.get('step_ms_p50', 0):.0f}, "
           f"p99 {b.get('step_ms_p99', 0):.0f}, max {b.get('step_ms_max', 0):.0f}; prefill passes "
           f"{b.get('prefill_passes', 0)} ({b.get('prefill_tokens_per_pass', 0):.0f} tokens, "
           f"{b.get('prefill_padded_per_pass', 0):.0f} padded a pass); preempted {c['preemptions']} "
           f"({c['recomputed_tokens']} tokens recomputed); OOM retries {c['oom_retries']}; mixed passes "
           f"{c['mixed_passes']}; steps that delayed admissions {c.get('admissions_delayed', 0)}; "
           f"first-seen pass shapes {b.get('new_shapes', 0)} ({b.get('new_shape_ms', 0):.0f} ms); "
           f"KV budget {f['kv_budget_mib']} MiB ({f['live_token_slots']} live slots), live {live['rows']}x"
           f"{live['capacity']} ({live['mib']} MiB); row ops {b.get('ops', {})}; KV bytes copied "
           f"{f.get('kv_copied_bytes', {})}; step phases ms "
           f"{ {k: round(v) for k, v in b.get('phase_ms', {}).items()} }"
           + (f"; weights served {f['weight_dtype']['served']}" if f.get("weight_dtype") else "")]
    new, known = b.get("new_prefill_shapes", 0), b.get("known_prefill_passes", 0)
    if new or known:
        out.append(f"  - prefill passes of a new (rows, L, span, capacity): {new}, {b.get('new_prefill_ms', 0) / max(new, 1):.1f} ms "
                   f"each; of a known one: {known}, {b.get('known_prefill_ms', 0) / max(known, 1):.1f} ms each")
    out += [f"  - {_step(r)}" for r in b.get("slowest", [])[:5]]
    return out
