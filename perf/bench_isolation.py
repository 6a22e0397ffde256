"""Issue 30's canary: a short completion's latency while another client attacks the server.

A canary client sends 2-token completions one after another; its latency is measured idle, then while
each attack runs: a 6k-token uncached prompt (the long-prefill case: goal <= 2 s p99 on a CPU), the same
prompt again with prompt_logprobs 20 (recomputed whole, 8.5 MB of logprobs out), a
64 KiB grammar constraint (the most engine.max_constraint_bytes lets through; compiled off the step
loop), three of them at once, a tool of 1,250 properties under tool_choice "required" (its schema just
under 64 KiB), 60k choices (0.7 MB: refused at the door), a 7.5 MB prompt (refused before it is
tokenized whole), and a 1,024 x 2,000-id request (refused by server.max_request_prompt_tokens). An attack
is another client (a process of its own), sent again until the phase's canaries are done. Goal: each
attack's canary p99 at most 2x the idle p99 (the long prefill: at most 2 s). The default model, one
server, default settings; each row notes the 1-minute load average when its phase ended, and each phase
keeps the engine's own figures (perf/engine_figures.py: its steps, their phases and the slowest steps), which
say whether a slow canary waited on a slow step and what that step did, and each stage process's CPU over the
phase (cores busy: how much of the machine the attack's own parsing, tokenizing and compiling took).

    python -m perf.bench_isolation [--canaries 20] [--idle-each]

With `--idle-each` an idle phase runs right before each attack as well, and each attack's p99 is also given
over that phase's: on the 2-core VM the idle p99 itself moved 0.23 -> 0.54 s between two runs five minutes
apart, so a ratio to the one idle phase at the start follows the host's state as much as the server's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import httpx

from perf import engine_figures
from perf.harness import Results, Server, add_results_options, cpu_delta


def canary(url: str, count: int, until: Any = None) -> list[float]:
    """`count` 2-token completions one after another, and more until `until` (an Event) is set if given."""
    times: list[float] = []
    with httpx.Client(base_url=url, timeout=300) as c:
        i = 0
        while i < count or (until is not None and not until.is_set()):
            i += 1
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": f"Hello {i}", "max_tokens": 2, "temperature": 0})
            r.raise_for_status()
            times.append(time.perf_counter() - t0)
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"n": len(times), "p50_s": round(statistics.median(ordered), 4),
            "p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4), "max_s": round(ordered[-1], 4),
            "latencies_s": [round(t, 3) for t in times]}  # in the order sent


Attack = list[tuple[str, dict[str, Any]]]  # (path, body) requests sent at once
REPEAT_UNDER_S = 5.0  # an attack round shorter than this is sent again until the canary is done


def _attack(url: str, make: Callable[[int], Attack], stop: Any, first_done: Any, out: Any) -> None:
    """Send round r's requests (`make(r)`, at once) for r = 0, 1, ... until `stop` is set, at least once: a
    short attack (a refusal in 0.1 s, a grammar compiled in 0.1 s) overlaps every canary, not one; a round
    longer than REPEAT_UNDER_S is not sent again. A body is encoded once (a round may repeat the last one's:
    the 1,024 x 2,000 ids take 0.3 s to encode)."""
    encoded: dict[int, tuple[Any, bytes]] = {}  # id(body) -> (body, kept so that its id is not reused; its JSON)

    def encode(body: dict[str, Any]) -> bytes:
        if (hit := encoded.get(id(body))) is None or hit[0] is not body:
            hit = encoded[id(body)] = (body, json.dumps(body).encode())
        return hit[1]

    statuses, seconds = [], []
    with httpx.Client(base_url=url, timeout=600) as c:
        pool = ThreadPoolExecutor(8)
        while True:
            posts = [(path, encode(body)) for path, body in make(len(statuses))]
            t0 = time.perf_counter()
            responses = list(pool.map(lambda p: c.post(p[0], content=p[1], headers=JSON), posts))
            statuses.append(max(r.status_code for r in responses))
            seconds.append(time.perf_counter() - t0)
            first_done.set()
            if stop.is_set() or seconds[-1] > REPEAT_UNDER_S:  # a long attack (a 6k prefill) is sent once
                break
        pool.shutdown()
    out.put({"status": statuses[0] if len(set(statuses)) == 1 else "/".join(map(str, sorted(set(statuses)))),
             "attack_s": round(statistics.median(seconds), 3), "attacks": len(seconds)})


def under(url: str, attack: Callable[[int], Attack], count: int) -> tuple[dict[str, float], Any]:
    """The canary's latencies while `attack` runs: the attack starts first, the canary 0.3 s later, and it goes
    on until the attack's first round has ended (a 6k-token prefill: its whole prefill and its answer, 8.5 MB
    with prompt_logprobs) and it has sent `count`; a shorter attack is sent again until then. The attack runs in
    a process of its own, as another client would: in a thread of this one, encoding its body (json.dumps of
    the 1,024 x 2,000 ids: 0.32 s holding the GIL) stalled the canary's own client, and that was timed."""
    ctx = multiprocessing.get_context("fork")  # the child uses no MLX
    stop, first_done, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_attack, args=(url, attack, stop, first_done, out))
    child.start()
    time.sleep(0.3)
    times = canary(url, count, until=first_done)
    stop.set()
    result = out.get(timeout=900)
    child.join()
    return summary(times), result


JSON = {"content-type": "application/json"}
LONG_PROMPT = [[(7 * i) % 40000 + 100 for i in range(6000)]]


def choices(tag: str, n: int = 2800) -> tuple[str, dict[str, Any]]:
    """A completion constrained to one of `n` choices (2,800: 64 KiB of JSON, engine.max_constraint_bytes)."""
    return "/v1/completions", {"prompt": "Pick one:", "max_tokens": 4,
                               "structured_outputs": {"choice": [f"option {tag} {i:05d}" for i in range(n)]}}


def big_tool(name: str, n: int = 1250) -> tuple[str, dict[str, Any]]:
    """A chat request with one tool `name` of `n` string properties under tool_choice "required" (1,250: the
    required-calls schema just under 64 KiB)."""
    props = {f"field_{i:05d}": {"type": "string"} for i in range(n)}
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Fill the form."}], "max_tokens": 4, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": props, "required": list(props)}}}]}


def completion(prompt: Any, **kw: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"prompt": prompt, "max_tokens": 1, **kw}


def static(attack: Attack) -> Callable[[int], Attack]:
    """The same requests every round (their bodies encoded once)."""
    return lambda r: attack


ATTACKS: dict[str, Callable[[], Callable[[int], Attack]]] = {
    "long_prefill_6k": lambda: static([completion(LONG_PROMPT)]),
    # the same prompt again with prompt_logprobs: never from the prefix cache, 20 alternatives a position (run
    # long_prefill_6k first: after this one, the plain prompt is found in the prefix cache)
    "prompt_logprobs_6k": lambda: static([completion(LONG_PROMPT, prompt_logprobs=20)]),
    # the largest constraint engine.max_constraint_bytes lets through, one and three at once, and a tool of 1,250
    # properties under tool_choice "required": new ones each round (none cached: each is compiled); 60k choices
    # (0.7 MB) are refused at the door
    "constraint_64k": lambda: lambda r: [choices(f"one{r}")],
    "constraint_64k_x3": lambda: lambda r: [choices(f"{t}{r}") for t in ("a", "b", "c")],
    "tool_required_64k": lambda: lambda r: [big_tool(f"form{r}")],
    "choices_60k": lambda: static([choices("big", 60_000)]),
    "prompt_7_5mb": lambda: static([completion("The quick brown fox jumps over the lazy dog. " * 170_000)]),
    "prompts_1024x2000": lambda: static([completion([[5] * 2000] * 1024)]),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.bench_isolation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--canaries", type=int, default=20, help="canary requests per phase (%(default)s)")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="attacks to run, comma-separated (%(default)s)")
    parser.add_argument("--idle-each", action="store_true",
                        help="an idle phase right before each attack too, and each attack's p99 over that one's "
                             "(this VM's idle p99 moved 0.23 -> 0.54 s between two runs five minutes apart: a "
                             "ratio to one idle phase at the start follows the host as much as the server)")
    parser.add_argument("--server-args", default="", help="extra parallm-launch arguments, e.g. "
                        "'--engine.prefill-pass-s 0' (pacing off)")
    add_results_options(parser)
    args = parser.parse_args(argv)
    results = Results.from_args("isolation", args, argv)
    data: dict[str, Any] = {}
    with Server(*shlex.split(args.server_args)) as srv:
        canary(srv.url, 5)  # warm-up
        attacks = args.attacks.split(",")
        phases = ["idle"] + [p for a in attacks for p in ([f"idle_before_{a}"] if args.idle_each else []) + [a]]
        for name in phases:
            engine_figures.settle()  # the phase's burst of engine steps is its own
            before, cpu_before, t0 = engine_figures.snapshot(srv.router), srv.cpu_seconds(), time.monotonic()
            if name.startswith("idle"):
                lat, out = summary(canary(srv.url, args.canaries)), {}
            else:
                lat, out = under(srv.url, ATTACKS[name](), args.canaries)
            cpu, wall = cpu_delta(cpu_before, srv.cpu_seconds()), time.monotonic() - t0
            data[name] = {**lat, **out, "load_1m": round(os.getloadavg()[0], 1), "wall_s": round(wall, 2),
                          "cpu_s": cpu, "cores_busy": {k: round(v / wall, 2) for k, v in cpu.items()}}
            if not name.startswith("idle"):
                data[name]["p99_over_idle"] = round(lat["p99_s"] / data["idle"]["p99_s"], 2)
                if args.idle_each:
                    data[name]["p99_over_idle_before"] = round(lat["p99_s"] / data[f"idle_before_{name}"]["p99_s"], 2)
            engine_figures.settle()
            data[name]["engine"] = engine_figures.figures(before, engine_figures.snapshot(srv.router))
            print(name, json.dumps({k: v for k, v in data[name].items() if k != "engine"}), flush=True)
    lines = ["| phase | canary p50 s | p99 s | p99 / idle p99 | p99 / the idle p99 just before | cores busy: "
             "ingress / tokenizer / engine | attack status | attack s (median) | attacks sent | load 1m |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for name, row in data.items():
        busy = row.get("cores_busy", {})
        cores = " / ".join(f"{busy.get(k, 0.0):.2f}" for k in ("ingress", "tokenizer", "engine"))
        lines.append(f"| {name} | {row['p50_s']} | {row['p99_s']} | {row.get('p99_over_idle', 1.0)} | "
                     f"{row.get('p99_over_idle_before', '')} | {cores} | {row.get('status', '')} | "
                     f"{row.get('attack_s', '')} | {row.get('attacks', '')} | {row['load_1m']} |")
    lines += ["", "Cores busy: each stage process's CPU seconds over the phase's wall time (this machine has "
              f"{os.cpu_count()}). The engine's own figures in each phase (perf/engine_figures.py; the slowest steps "
              "with their phases in ms):", ""]
    lines += [line for name, row in data.items() if "engine" in row for line in engine_figures.lines(name, row["engine"])]
    print(results.write(data, "\n".join(lines)))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
