"""When MLX writes into a KV block store in place and when it copies the whole store first (issue 41).

A pass writes each new token's K/V into the store with one Scatter (`store[heads, slots] = x`,
parallm.engine.pass_view.scatter). MLX runs that Scatter in place only when the store's buffer has no
other holder when the graph is evaluated ("donation"); otherwise it copies the whole buffer and
writes into the copy, so a step costs a store's worth of memory traffic per layer. Per store size
(one layer's K: [3 heads, slots, 64] float32, the default model's shape), the time of one write of
64 tokens and whether the buffer moved, in each case:

- `alone`: nothing else holds the store: in place;
- `read`: the same graph reads the store after the write (a pass's attention): in place;
- `held`: another array sharing the buffer is alive at the write (a slice kept across passes, a
  view a caller did not drop): copied;
- `pipelined`: the next write is launched (mx.async_eval) while the previous graph may still be
  running (the engine's overlapped schedule): copied whenever the previous graph has not finished;
- `pipelined+sync`: the same, waiting for the work in flight first (mx.synchronize, what
  LiveKV.settle does above engine.in_place_kv_mb): in place.

    python -m perf.bench_store_writes                 # -> perf/results/store-writes-cpu.{json,md}
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from perf.harness import Results, add_results_options, describe

CASES = ("alone", "read", "held", "pipelined", "pipelined+sync")
HEADS, DIM, TOKENS = 3, 64, 64


def address(a) -> int:
    """Where an evaluated array's data lives (the view is dropped at once: a live one would hold it)."""
    import numpy as np

    view = np.asarray(memoryview(a))
    try:
        return int(view.ctypes.data)
    finally:
        del view


def measure(case: str, slots: int, writes: int) -> dict[str, Any]:
    """ms per write (median, fastest) of `writes` writes of TOKENS tokens, and how many moved the store."""
    import mlx.core as mx

    store = mx.zeros((HEADS, slots, DIM))
    x = mx.ones((HEADS, TOKENS, DIM))
    heads = mx.broadcast_to(mx.arange(HEADS, dtype=mx.int32)[:, None], (HEADS, TOKENS))
    mx.eval(store, x, heads)
    # every write's slots made first: evaluating them inside the loop would wait for the write in flight
    slot_list = [mx.broadcast_to((mx.arange(TOKENS, dtype=mx.int32) + (i * TOKENS) % (slots - TOKENS))[None],
                                 (HEADS, TOKENS)) for i in range(writes)]
    mx.eval(slot_list)
    times, moved, pending, held = [], 0, None, None
    where = address(store)
    for slot in slot_list:
        if case == "held":
            held = store[:, :]  # shares the buffer
            mx.eval(held)
        t0 = time.perf_counter()
        if case == "pipelined+sync":
            mx.synchronize()
        store[heads, slot] = x
        if case in ("alone", "held"):
            mx.eval(store)
        else:
            read = mx.take(store, slot[0], axis=1).sum()
            if case == "read":
                mx.eval(store, read)
            else:
                mx.async_eval(store, read)
                if pending is not None:
                    mx.eval(pending)
                pending = read
        times.append(1000 * (time.perf_counter() - t0))
        if case.startswith("pipelined"):
            continue  # reading the address would wait for the write
        now = address(store)
        moved += now != where
        where = now
    mx.synchronize()
    del held
    return {"ms_median": statistics.median(times), "ms_fastest": min(times),
            "moved": moved if not case.startswith("pipelined") else None}


def markdown(res: dict[str, Any]) -> str:
    lines = ["# Writes into a KV block store: in place or a copy of the whole store (CPU)", "",
             f"Machine: {describe(res['machine'])}.  ", f"Command: `{res['command']}`  ",
             f"Load average at start {res['loadavg_start']}, at end {res['loadavg_end']}.", "",
             f"One write of {TOKENS} tokens into one layer's K store [{HEADS}, slots, {DIM}] float32, "
             f"{res['writes']} writes: median ms (fastest), and how many moved the store's buffer (a copy):", "",
             "| case | " + " | ".join(f"{s['mib']:.0f} MiB" for s in res["sizes"]) + " |",
             "|---|" + "---:|" * len(res["sizes"])]
    for case in res["cases"]:
        cells = []
        for s in res["sizes"]:
            r = s["cases"][case]
            moved = "" if r["moved"] is None else f", moved {r['moved']}"
            cells.append(f"{r['ms_median']:.2f} ({r['ms_fastest']:.2f}){moved}")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_results_options(parser)
    parser.add_argument("--slots", type=int, nargs="+", default=[1 << 14, 1 << 18, 1 << 20],
                        help="store sizes in slots (tokens) per head")
    parser.add_argument("--writes", type=int, default=20)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    args = parser.parse_args(argv)
    from parallm import blas

    blas.reexec_with_openblas()
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    files = Results.from_args("store-writes", args, argv)
    res: dict[str, Any] = {"command": files.command, "machine": files.machine, "writes": args.writes,
                           "cases": args.cases, "loadavg_start": [round(x, 2) for x in os.getloadavg()], "sizes": []}
    for slots in args.slots:
        size = {"slots": slots, "mib": HEADS * slots * DIM * 4 / 2**20, "cases": {}}
        for case in args.cases:
            size["cases"][case] = r = measure(case, slots, args.writes)
            print(f"{slots:8d} slots {case:15s} {r['ms_median']:8.2f} ms ({r['ms_fastest']:.2f}) moved {r['moved']}",
                  file=sys.stderr, flush=True)
        res["sizes"].append(size)
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    files.write(res, markdown(res))
    print(f"wrote {files.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
