"""What CurveZMQ costs on the raw client's round trip over tcp:// (issue 22; goal: <= 0.2 ms added).

Two servers on tcp:// (parallm-launch, perf/harness.py), one with CURVE (the default) and one with
`--transport.curve false`; on each, a raw `Client` sends `--rounds` 1-token token-id requests one
after another (submit to the engine, the output back through the detokenizer's ROUTER), the two
servers taking turns in blocks so that load from elsewhere falls on both alike. Between two
requests the client also asks the engine for its adapter list (ListAdapters): the same hops as a
request (client -> engine -> detokenizer's ROUTER -> client) without a model step, so that on a
loaded CPU, where the step's jitter hides a few microseconds, CURVE's share of the path is still
readable. Also, without a server: a DEALER/ROUTER ping-pong of a 100-byte frame over tcp:// with
and without CURVE, the encryption's own cost per hop pair.

    python -m perf.bench_curve --rounds 1000       # -> perf/results/curve-cpu.json

On a GPU host the same command measures the same thing (the engine step is then shorter, so the
share CURVE takes of the round trip is larger; the added milliseconds should be the same).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from parallm import keys
from parallm.client import Client
from parallm.protocol import SamplingParams
from perf.harness import Results, Server, add_results_options, free_port_range


def _summary(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in samples_s)
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 4), "mean_ms": round(statistics.fmean(ms), 4),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 4), "min_ms": round(ms[0], 4)}


def ping_pong(curve: bool, rounds: int) -> list[float]:
    """DEALER -> ROUTER -> DEALER of a 100-byte frame over tcp://127.0.0.1, CURVE on or off."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    auth = None
    if curve:
        from zmq.auth.thread import ThreadAuthenticator

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.certs["*"] = {client_public: True}
        router.curve_secretkey, router.curve_publickey, router.curve_server = server_secret, server_public, True
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = (server_public, client_public,
                                                                                  client_secret)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = b"x" * 100
    times = []
    try:
        for i in range(rounds + 50):
            t0 = time.perf_counter()
            dealer.send(payload)
            ident, data = router.recv_multipart()
            router.send_multipart([ident, data])
            dealer.recv()
            if i >= 50:
                times.append(time.perf_counter() - t0)
    finally:
        for s in (router, dealer):
            s.close(0)
        if auth is not None:
            auth.stop()
        ctx.term()
    return times


def serve(curve: bool, key_dir: Path, model: list[str]) -> tuple[Server, Client]:
    base = free_port_range()
    args = [*model, "--transport.kind", "tcp", "--transport.tcp-base-port", str(base)]
    args += ["--transport.curve-clients", str(key_dir)] if curve else ["--transport.curve", "false"]
    server = Server(*args).start()
    router = f"tcp://127.0.0.1:{base + 2}"
    if curve:
        client = Client(router, timeout=120, server_key=f"{server.run_dir}/{keys.SERVER_PUBLIC_FILE}",
                        client_key=str(key_dir / "bench.key_secret"))
    else:
        client = Client(router, timeout=120)
    return server, client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.bench_curve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400, help="1-token requests per server (%(default)s)")
    parser.add_argument("--block", type=int, default=50, help="requests per turn before the other server's")
    parser.add_argument("--shape", default="tiny", help="a perf.bench_gpu shape with random weights, so that the "
                                                        "engine's step is short beside the sockets; '' = the "
                                                        "default model")
    parser.add_argument("--work-dir", default="", help="where --shape's model is built (reused if there)")
    parser.add_argument("--tokenizer-dir", default="", help="tokenizer files for --shape (perf/bench_serving.py)")
    add_results_options(parser)
    args = parser.parse_args(argv)
    results = Results.from_args("curve", args, argv)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    model: list[str] = []
    if args.shape:
        from perf.bench_serving import shape_model_dir

        model = ["--model.path", str(shape_model_dir(args))]
    with tempfile.TemporaryDirectory() as tmp:
        key_dir = Path(tmp)
        keys.main(["new", str(key_dir), "bench"])
        served = {name: serve(name == "curve", key_dir, model) for name in ("curve", "plain")}
        times: dict[str, list[float]] = {"curve": [], "plain": []}
        control: dict[str, list[float]] = {"curve": [], "plain": []}
        try:
            for _, client in served.values():  # warm-up: compiled step, sockets connected
                for _ in range(20):
                    client.generate([1, 2, 3], params)
            while min(len(v) for v in times.values()) < args.rounds:
                for name, (_, client) in served.items():
                    for _ in range(args.block):
                        t0 = time.perf_counter()
                        client.generate([1, 2, 3], params)
                        times[name].append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        client.list_adapters()
                        control[name].append(time.perf_counter() - t0)
        finally:
            for server, client in served.values():
                client.close()
                server.stop()
    pings = {"curve": ping_pong(True, args.rounds * 5), "plain": ping_pong(False, args.rounds * 5)}
    data: dict[str, Any] = {
        "shape": args.shape or "default",
        "round_trip": {name: _summary(v) for name, v in times.items()},
        "control_round_trip": {name: _summary(v) for name, v in control.items()},
        "ping_pong_100B": {name: _summary(v) for name, v in pings.items()},
    }
    rt, ct, pp = data["round_trip"], data["control_round_trip"], data["ping_pong_100B"]
    data["added_ms"] = {"round_trip_median": round(rt["curve"]["median_ms"] - rt["plain"]["median_ms"], 4),
                        "control_round_trip_median": round(ct["curve"]["median_ms"] - ct["plain"]["median_ms"], 4),
                        "ping_pong_median": round(pp["curve"]["median_ms"] - pp["plain"]["median_ms"], 4)}
    md = ["| measure | CURVE off (median / p90 ms) | CURVE on (median / p90 ms) | added (median ms) |", "|---|---|---|---|"]
    for label, table, key in (("raw client 1-token round trip", rt, "round_trip_median"),
                              ("raw client ListAdapters round trip (same hops, no step)", ct,
                               "control_round_trip_median"),
                              ("DEALER/ROUTER 100-byte ping-pong", pp, "ping_pong_median")):
        md.append(f"| {label} | {table['plain']['median_ms']:.3f} / {table['plain']['p90_ms']:.3f} | "
                  f"{table['curve']['median_ms']:.3f} / {table['curve']['p90_ms']:.3f} | {data['added_ms'][key]:+.3f} |")
    results.write(data, "\n".join(md))
    print("\n".join(md))
    print(f"wrote {results.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
