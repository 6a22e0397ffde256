"""What a step's deadline costs the engine stage per step (issue 37, item 3): `StepDeadline.begin` + `end` with a
full window of recent steps, the expected time from the sliding-window maxima (`WindowMax`, this code) against
the walk over the window it replaced (three generator passes over the 64 recent steps every step, kept here as
`Walked`), alternated round by round; both must give the same deadlines.

    python -m perf.bench_step_deadline --rounds 3      # -> perf/results/step-deadline-cpu.{json,md}
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from parallm.engine.step_deadline import StepDeadline


class _NoMax:
    def push(self, index: int, value: float) -> None:
        pass


class Walked(StepDeadline):
    """The expected time as it was computed before WindowMax: a walk over the recent steps (and no maxima kept)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._longest = self._rate = _NoMax()

    def expected_s(self, work: float) -> float:
        if not self.recent:
            return 0.0
        longest = max(s for s, _ in self.recent)
        rate = max(s / w for s, w in self.recent if w > 0) if any(w > 0 for _, w in self.recent) else 0.0
        return max(longest, rate * work)


def per_step_us(kind: type[StepDeadline], steps: int) -> tuple[float, list[float]]:
    """µs of one begin + end, and the deadlines given, over `steps` steps after the window filled."""
    t = [0.0]
    d = kind(5.0, 10.0, clock=lambda: t[0])
    for i in range(100):
        d.begin((1, False), 3.0)
        t[0] += 0.004 + 0.001 * (i % 5)
        d.end()
    deadlines = []
    start = time.perf_counter()
    for i in range(steps):
        deadlines.append(d.begin((1, False), 3.0 + i % 7))
        t[0] += 0.004 + 0.001 * (i % 5)
        d.end()
    return 1e6 * (time.perf_counter() - start) / steps, deadlines


def main(argv: list[str] | None = None) -> int:
    from perf.harness import Results, add_results_options

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    add_results_options(parser)
    args = parser.parse_args(argv)
    results = Results.from_args("step-deadline", args, argv)
    rows = []
    for r in range(args.rounds):
        order = (("walked", Walked), ("window_max", StepDeadline))
        got = {}
        for name, kind in (order if r % 2 == 0 else order[::-1]):
            got[name] = per_step_us(kind, args.steps)
        same = got["walked"][1] == got["window_max"][1]
        rows.append({"round": r, "walked_us": round(got["walked"][0], 3), "window_max_us": round(got["window_max"][0], 3),
                     "same_deadlines": same})
        print(rows[-1], flush=True)
    lines = [f"# A step's deadline, begin + end, µs a step ({args.steps} steps a round, a full window of 64)", "",
             "| round | walk over the window (before) | WindowMax (now) | same deadlines |", "|---|---|---|---|"]
    lines += [f"| {r['round']} | {r['walked_us']:.2f} | {r['window_max_us']:.2f} | {r['same_deadlines']} |" for r in rows]
    lines += ["", f"Medians: {statistics.median(r['walked_us'] for r in rows):.2f} -> "
              f"{statistics.median(r['window_max_us'] for r in rows):.2f} µs a step"]
    results.write({"steps": args.steps, "rows": rows}, "\n".join(lines))
    print("\n".join(lines))
    return 0 if all(r["same_deadlines"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
