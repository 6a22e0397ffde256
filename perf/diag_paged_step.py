"""Why a block-store decode step is slower than the dense rows' on a GPU (issue 41): per batch, the
engine as configured (paged decode checked on first use, paged_decode.check_paged_decode; where the
check turns it off, the same engine with its verdict forced on as well) and the engine reading the
gathered K/V (paged_decode off), each with what the check logged (its way and the logits' difference),
whether the paged read was used, the step time overlapped and synchronized, whether any step moved a
layer's store (a copy instead of an in-place write), and how many rows' greedy tokens agree with the
first engine's; at one batch also two stock attention ways over the same gathered K/V (the fused kernel
and the unfused matmuls): how far rounding alone moves a random-weight model's greedy tokens.

    python perf/diag_paged_step.py --shape llama-3.2-3b --batches 1,64,256 --tokenizer-dir DIR
        # -> $OUT/paged-step-diag-<device>.json
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _addresses(arrays: list[mx.array]) -> list[int] | None:
    try:
        import numpy as np

        out = []
        for a in arrays:
            view = np.asarray(memoryview(a))
            out.append(view.ctypes.data)
            del view
        return out
    except Exception:  # noqa: BLE001 - a backend whose arrays expose no host view
        return None


def run_variant(model: Any, batch: int, steps: int, prompt_len: int, force: bool,
                **settings: Any) -> tuple[dict[str, Any], dict[str, list[int]]]:
    from parallm.engine import runner as runner_module
    from perf.profile_decode import decoding_engine

    lines = _Lines()
    logging.getLogger("parallm.engine").addHandler(lines)
    logging.getLogger("parallm.engine").setLevel(logging.INFO)
    real_check = runner_module.check_paged_decode
    if force:
        runner_module.check_paged_decode = lambda *a, **k: (real_check(*a, **k), True)[1]
    try:
        engine = decoding_engine(model, batch, steps * 2 + 4, prompt_len, **settings)
    finally:
        runner_module.check_paged_decode = real_check
        logging.getLogger("parallm.engine").removeHandler(lines)
    runner, live = engine.runner, engine.runner.live
    mx.synchronize()
    before = _addresses(live.arrays())
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    mx.synchronize()
    overlapped = (time.perf_counter() - start) / steps
    after = _addresses(live.arrays())
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        mx.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    tokens = {s.rid: list(s.output_ids) for s in engine.scheduler.running} \
        if hasattr(engine, "scheduler") else {}
    out = {
        "batch": batch, "forced": force, "asked": settings,
        "paged_way": runner.paged_way, "pages_decode": runner.pages_decode,
        "keys_transposed": getattr(live, "keys_transposed", False),
        "store_mb": sum(a.nbytes for a in live.arrays()) / 2**20,
        "settings": {k: getattr(engine.config, k, None) for k in
                     ("kv_preallocate", "unfused_decode", "unfused_prefill_keys", "paged_decode", "kv_budget_mb")},
        "log": [ln for ln in lines.lines if "paged" in ln],
        "overlapped_step_ms": 1000 * overlapped,
        "synced_step_ms_median": 1000 * times[len(times) // 2],
        "synced_step_ms_min": 1000 * times[0],
        "stores_moved": None if before is None or after is None else sum(a != b for a, b in zip(before, after)),
        "stores": len(live.arrays()),
    }
    del engine, runner, live
    gc.collect()
    mx.clear_cache()
    return out, tokens


def agreeing(want: dict[str, list[int]], got: dict[str, list[int]]) -> tuple[int, int]:
    """(rows whose greedy tokens are the same in both, rows compared)."""
    return sum(got.get(k) == v for k, v in want.items()), len(want)


def main(argv: list[str] | None = None) -> int:
    from mlx_lm.utils import load_model

    from perf.bench_gpu import build_model_dir
    from perf.harness import Results, add_results_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-3b")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/parallm-bench-gpu"))
    add_results_options(parser, default_help="paged-step-diag")
    args = parser.parse_args(argv)
    model, _ = load_model(build_model_dir(args.shape, args.work_dir / args.shape, args.tokenizer_dir))
    results = Results.from_args("paged-step-diag", args, argv, experiment=args.shape)
    report: dict[str, Any] = {"shape": args.shape, "runs": []}
    batches = [int(b) for b in args.batches.split(",")]
    yardstick_batch = 64 if 64 in batches else batches[-1]
    for batch in batches:
        checked, want = run_variant(model, batch, args.steps, args.prompt_len, force=False)
        print(checked, flush=True)
        report["runs"].append(checked)
        if not checked["pages_decode"]:
            forced, got = run_variant(model, batch, args.steps, args.prompt_len, force=True)
            forced["same_tokens_rows"], forced["rows_compared"] = agreeing(want, got)
            print(forced, flush=True)
            report["runs"].append(forced)
        gathered, tokens = run_variant(model, batch, args.steps, args.prompt_len, force=False, paged_decode="off")
        gathered["same_tokens_rows"], gathered["rows_compared"] = agreeing(want, tokens)
        print(gathered, flush=True)
        report["runs"].append(gathered)
        if batch == yardstick_batch:  # two stock ways of attention over the same gathered K/V
            fused, other = run_variant(model, batch, args.steps, args.prompt_len, force=False, paged_decode="off",
                                       unfused_decode=False)
            fused["same_tokens_rows"], fused["rows_compared"] = agreeing(tokens, other)
            fused["compared_with"] = "paged_decode off, unfused_decode on"
            print(fused, flush=True)
            report["runs"].append(fused)
    results.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
