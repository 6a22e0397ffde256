"""What one access-log line costs the thread that logs it (the ingress event loop), written straight to
stderr or handed to the log-writer thread (parallm/logs.py), with stderr a pipe that a supervisor-like
reader drains (launch/process.py's pump) and, with --busy N, N processes spinning on the CPU.

A child process per variant logs `--lines` access lines as the ingress middleware does and times each
call; the variants alternate over `--rounds`, so both see the same load.

    python -m perf.profile_logging --lines 3000 --rounds 3 --busy 2     # -> perf/results/logging-cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time

from perf.harness import ROOT, Results, add_results_options

CHILD = """
import json, logging, sys, time
from parallm.logs import request_extra, setup_logging
setup_logging("info", "ingress", "{fmt}", background={background})
access = logging.getLogger("parallm.access")
times = []
for i in range({lines}):
    t0 = time.perf_counter()
    access.info("%s %s %d %.1fms", "POST", "/v1/chat/completions", 200, 12.5,
                extra=request_extra(f"chatcmpl-{{i:024x}}", method="POST", route="/v1/chat/completions", status=200,
                                    duration_ms=12.5))
    times.append(time.perf_counter() - t0)
    if i % 50 == 0:
        time.sleep(0.001)
times.sort()
print(json.dumps({{"mean_us": 1e6 * sum(times) / len(times), "p50_us": 1e6 * times[len(times) // 2],
                  "p99_us": 1e6 * times[int(len(times) * 0.99)], "max_us": 1e6 * times[-1]}}), file=sys.__stdout__, flush=True)
"""


def spin(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def one(background: bool, lines: int, fmt: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(background=background, lines=lines, fmt=fmt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)

    def pump() -> None:  # the supervisor's side: read each line, write it on
        with open(os.devnull, "wb") as sink:
            sink.writelines(proc.stderr)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    out, _ = proc.communicate(timeout=300)
    reader.join(10)
    return json.loads(out.decode().strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU meanwhile")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    add_results_options(parser)
    args = parser.parse_args(argv)
    results = Results.from_args("logging", args, argv)
    spinners = [multiprocessing.Process(target=spin, args=(time.time() + 3600,), daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    runs = []
    try:
        for r in range(args.rounds):
            for background in (False, True):
                runs.append({"round": r, "writer_thread": background, **one(background, args.lines, args.format)})
                print(json.dumps(runs[-1]), flush=True)
    finally:
        for p in spinners:
            p.terminate()
    summary = {str(bg): {k: round(sum(x[k] for x in runs if x["writer_thread"] == bg) / args.rounds, 2)
                         for k in ("mean_us", "p50_us", "p99_us", "max_us")} for bg in (False, True)}
    results.write({"lines": args.lines, "busy": args.busy, "format": args.format, "runs": runs,
                   "mean_of_rounds": {"direct": summary["False"], "writer_thread": summary["True"]}})
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
