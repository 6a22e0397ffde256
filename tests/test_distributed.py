"""Tensor parallelism (parallm/engine/distributed.py): a 2-rank group on MLX's ring backend, on this
CPU, against the single-rank engine. The ranks are real processes (this file run as a script) that
join through the same environment the supervisor gives them (launch/group.py)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import get_args

import mlx.core as mx
import msgspec
import pytest
import zmq
from mlx_lm.models import llama

from parallm import protocol
from parallm.launch.group import write_ring_hostfile
from parallm.engine import distributed
from parallm.engine.rank_timing import probe_collectives
from parallm.engine.distributed import (Leader, TensorParallelError, control_addresses, follow, freeze_clock,
                                        shard_model, shard_refusal, state_digest)
from parallm.protocol import SamplingParams
from parallm.config import KVConfig
from tests._engine_helpers import greedy, make_engine, req, run_all, tiny_model, wide_heads_model
from tests._ring_helpers import run_ring

ROOT = Path(__file__).resolve().parents[1]


def workload() -> list:
    """A batch of greedy prompts of different lengths (one past a prefix-cache block, one n=2), and a
    seeded sampled one: every rank must draw the same tokens."""
    prompts = [[(7 * i + 3 * j) % 97 + 1 for j in range(n)] for i, n in enumerate((5, 19, 40, 3))]
    requests = [req(f"g{i}", p, greedy(12)) for i, p in enumerate(prompts)]
    requests.append(req("n2", prompts[1], greedy(6), n=2))
    requests.append(req("s", prompts[2], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=5)))
    return requests


def tokens(results: dict) -> dict[str, list[int]]:
    return {f"{rid}/{index}": d["tokens"] for (rid, index), d in sorted(results.items())}


def both_phases(engine) -> dict[str, list[int]]:
    """The workload, the prefix cache reset (as ResetPrefixCache does: every rank must drop the same
    blocks, or their next plans differ), then the workload again under new ids."""
    first = tokens(run_all(engine, workload()))
    engine.drop_cached_blocks()
    again = workload()
    for r in again:
        r.rid = "again-" + r.rid
    return {**first, **tokens(run_all(engine, again))}


def model_of(name: str):
    """The tiny random llama (with 32-wide heads: "wide"), or the default model (SmolLM2-135M: 9 heads,
    3 KV heads, so 3 ranks)."""
    if name == "default":
        from tests._default_model import default_model

        return default_model()
    return wide_heads_model() if name == "wide" else tiny_model("llama")


def kv_of() -> KVConfig:
    """The ranks' KV settings: TP_KV_BITS quantizes their K/V (in groups of 32)."""
    return KVConfig(bits=int(os.environ.get("TP_KV_BITS", "0")), group_size=32)


def rank_main(out: str) -> int:
    """One rank: shard the model, build the engine, warm up, then serve (rank 0, through the
    Leader, writing what it produced to `out`) or follow."""
    from parallm.engine import distributed

    if os.environ.get("TP_CURVE"):  # the call channel over tcp: the stages' keys, as the supervisor hands them
        from parallm.keys import stage_curve
        from parallm.transport import set_curve

        set_curve(stage_curve(os.environ["TP_CURVE"].split(",")))
    group = distributed.join(int(os.environ["TP_SIZE"]), backend="ring")
    model = model_of(os.environ["TP_MODEL"])
    shard_model(model, group)
    engine = make_engine(model, kv=kv_of(), prefill_pass_s=float(os.environ.get("TP_PACE_S", "0")),
                         **({"compiled_decode": True} if os.environ.get("TP_COMPILED") else {}))
    if group.rank() > 0 and os.environ.get("TP_PACE_S"):
        slow_clock(engine.pacer)
    distributed.freeze_clock(engine)
    engine.warm_up()
    collective_us = probe_collectives(model, group)
    addresses = distributed.control_addresses(str(Path(out).parent))
    if group.rank() > 0:
        return distributed.follow(engine, group, addresses, collective_us)
    leader = distributed.Leader(engine, group, addresses, collective_us)
    results = both_phases(leader)
    deadline = time.monotonic() + 10  # the followers' last acks (with their phases) arrive asynchronously
    while any(r.step < leader.steps for r in leader.stats().ranks[1:]) and time.monotonic() < deadline:
        time.sleep(0.01)
    ranks = [msgspec.to_builtins(r) for r in leader.stats().ranks]
    leader.close()
    Path(out).write_text(json.dumps(results))
    Path(out).with_suffix(".ranks.json").write_text(json.dumps(ranks))
    return 0


def slow_clock(pacer) -> None:
    """This rank's passes look 50x slower to its prefill pacer (as on a loaded or slower machine)."""
    observe = pacer.observe
    pacer.observe = lambda seconds, *a, **k: observe(seconds * 50, *a, **k)


def run_group(tmp_path: Path, ranks: int, model: str, timeout_s: float = 600.0, **extra_env: str) -> dict[str, list[int]]:
    """`ranks` processes on the ring over localhost; rank 0's tokens."""
    out = tmp_path / "tokens.json"
    env = {**os.environ, "TP_SIZE": str(ranks), "TP_MODEL": model, "PYTHONPATH": str(ROOT), **extra_env}
    assert run_ring(__file__, str(out), tmp_path, ranks, env, timeout_s) == [0] * ranks
    return json.loads(out.read_text())


def test_two_ring_ranks_match_the_single_rank_engine(tmp_path):
    got = run_group(tmp_path, 2, "tiny")
    want = both_phases(make_engine(tiny_model("llama")))
    assert got == want
    assert len(got) == 14 and all(len(t) >= 6 for t in got.values())
    check_rank_timings(json.loads((tmp_path / "tokens.ranks.json").read_text()))


@pytest.mark.slow  # 11 s; the plain two-rank test stays: make test's 10-minute budget (clean clone, 2-core CI host)
def test_two_ring_ranks_with_compiled_decode_match_the_single_rank_engine(tmp_path):
    """engine.compiled_decode on every rank: the decode pass, its all-sums inside, traced once per shape
    under mx.compile (what cuts a GPU step's host launch cost, the cost TP=2 pays on every rank)."""
    got = run_group(tmp_path, 2, "tiny", TP_COMPILED="1")
    assert got == both_phases(make_engine(tiny_model("llama"), compiled_decode=True))


def check_rank_timings(ranks: list[dict]) -> None:
    """Each rank's step phases and its all-sum probe, as rank 0's stats report them (rank_timing.py)."""
    assert [r["rank"] for r in ranks] == [0, 1]
    lead, follower = ranks[0]["step_ms_mean"], ranks[1]["step_ms_mean"]
    assert {"plan", "schedule", "launch", "read"} <= set(lead) and "wait" not in lead
    assert {"wait", "replay", "ack", "schedule", "launch", "read"} <= set(follower) and "plan" not in follower
    assert all(v >= 0 for r in ranks for v in r["step_ms_mean"].values())
    for r in ranks:  # tiny llama: 64 wide, 2 layers -> 4 all-sums a step
        assert set(r["collective_us"]) == {"all_sum_1row", "all_sum_64rows", "step_chain_4"}, r
        assert all(v > 0 for v in r["collective_us"].values())


@pytest.mark.slow  # 10 s: make test's 10-minute budget (clean clone, 2-core CI host)
def test_ranks_that_time_their_passes_differently_pace_prefill_as_rank_0(tmp_path):
    """engine.prefill_pass_s on (the CPU default) with rank 1's passes timed 50x slower: a follower
    pacing by its own timings would admit fewer prompt tokens per step than rank 0 and diverge (the
    group restarts, or its passes' collectives no longer pair up and the ranks hang: hence the 60 s);
    every rank steps with rank 0's rate and the group samples what one engine does."""
    got = run_group(tmp_path, 2, "tiny", timeout_s=60, TP_PACE_S="0.05")
    assert got == both_phases(make_engine(tiny_model("llama")))


@pytest.mark.slow
def test_two_ring_ranks_with_rank_0s_calls_over_tcp_and_curve_match_one(tmp_path):
    """The channel ranks on other machines use (PARALLM_TP_CONTROL, as the supervisor sets it for them),
    here between two rank processes of this machine."""
    from parallm.launch.group import free_ports

    keys = [k.decode() for pair in (zmq.curve_keypair(), zmq.curve_keypair()) for k in pair]
    calls, acks = free_ports(2)
    got = run_group(tmp_path, 2, "tiny", TP_CURVE=",".join(keys),
                    **{distributed.CONTROL_ENV: f"tcp://127.0.0.1:{calls},tcp://127.0.0.1:{acks}"})
    assert got == both_phases(make_engine(tiny_model("llama")))


@pytest.mark.slow
def test_two_ring_ranks_with_quantized_kv_match_one(tmp_path):
    """--kv.bits 8 on both ranks: each quantizes the K/V of its own heads; the group samples what one
    engine with the same KV format samples."""
    got = run_group(tmp_path, 2, "wide", TP_KV_BITS="8")
    want = both_phases(make_engine(wide_heads_model(), kv=KVConfig(bits=8, group_size=32)))
    assert got == want


@pytest.mark.slow
def test_three_ring_ranks_on_the_default_model_match_one(tmp_path):
    """The default model's 9 heads / 3 KV heads / 1536-wide MLP split over 3 ranks (not 2)."""
    from tests._default_model import default_model

    got = run_group(tmp_path, 3, "default")
    want = both_phases(make_engine(default_model()))
    assert got == want


def test_a_model_whose_heads_do_not_split_is_refused():
    args = dict(model_type="llama", hidden_size=72, num_hidden_layers=1, intermediate_size=96,
                num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=50)
    model = llama.Model(llama.ModelArgs(**args))  # the default model's 9 query / 3 KV heads
    reason = shard_refusal(model, 2)
    assert reason is not None and "num_attention_heads (9)" in reason and "not divisible" in reason
    assert shard_refusal(model, 3) is None


def test_a_model_without_shard_is_refused():
    class NoShard(llama.Model):
        shard = None

    model = NoShard(llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                                    num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=10))
    with pytest.raises(TensorParallelError, match="no shard\\(\\) method"):
        shard_model(model, mx.distributed.init())


def test_calls_round_trip_as_typed_messages():
    """Every engine call rank 0 sends is its own struct (protocol/to_ranks.py), decoded by type."""
    spec = protocol.RequestSpec(params=greedy(3), adapter="a")
    calls = [protocol.AddRequest(now=1.5, rid="r", prompt_ids=[1, 2], spec=spec),
             protocol.AbortRequest(now=1.6, rid="r", reason="error", index=0),
             protocol.AddScore(now=1.7, qid="q", ids=[1, 2, 3], start=1, top_logprobs=2),
             protocol.LoadAdapter(now=1.8, name="a", weights=b"\x80", version=3),
             protocol.UnloadAdapter(now=1.9, name="a"), protocol.SetDefaultAdapter(now=2.0, name="a"),
             protocol.FollowLatest(now=2.1), protocol.DropCachedBlocks(now=2.2),
             protocol.UpdateWeights(now=2.3, path="/w", version=4, complete=False), protocol.Step(now=2.4),
             protocol.Flush(now=2.5), protocol.StopFollowing(now=2.6)]
    batch = protocol.RankBatch(calls=calls, digest=7, seq=3)
    assert protocol.decode(protocol.encode(batch), protocol.RankBatch) == batch
    assert set(map(type, calls)) == set(get_args(protocol.RankCallKind))  # every kind, each replayed or ending


def test_a_follower_refuses_an_unknown_call():
    frame = msgspec.msgpack.encode({"type": "rank_batch", "v": protocol.PROTOCOL_VERSION, "digest": 1,
                                    "calls": [{"type": "rank_reboot", "now": 0.0}]})
    with pytest.raises(protocol.ProtocolError, match="rank_reboot"):
        protocol.decode(frame, protocol.RankBatch)


def test_the_leader_sends_its_calls_without_a_collective(tmp_path, monkeypatch):
    """Rank 0's step must not read back a device value for the calls (an all-sum on the default
    stream waits for the pass launched last step, which undoes the engine's overlap): with one rank
    and an unsharded model, no collective may run at all while the Leader serves."""
    collectives = []
    for name in ("all_sum", "all_gather", "send", "recv"):
        monkeypatch.setattr(mx.distributed, name, lambda *a, _name=name, **k: collectives.append(_name))
    leader = Leader(make_engine(tiny_model("llama")), mx.distributed.init(), control_addresses(str(tmp_path)))
    got = tokens(run_all(leader, workload()))
    leader.close()
    assert collectives == []
    assert got == tokens(run_all(make_engine(tiny_model("llama")), workload()))


def test_the_leader_answers_every_engine_call_the_stage_makes_and_nothing_else():
    """Rank 0's stage holds a Leader where it would hold an Engine. Every attribute of the engine that
    the stage modules use must be one the Leader defines (a call that changes state is recorded for the
    other ranks; a read passes through): no __getattr__ sends an unrecorded call to rank 0's engine alone."""
    import re

    engine = make_engine(tiny_model("llama"))
    used = set()
    for module in (ROOT / "stages").glob("engine*.py"):
        used |= set(re.findall(r"\bengine\.([a-z_]+)", module.read_text()))
    used = {name for name in used if hasattr(engine, name)} - {"warm_up"}  # before the Leader wraps it, every rank
    assert {"add_request", "abort", "step", "set_default_adapter", "drop_cached_blocks"} <= used
    assert not hasattr(Leader, "__getattr__")
    assert sorted(name for name in used if not hasattr(Leader, name)) == []


def test_a_ranks_warm_up_does_not_pace_by_its_own_passes(tmp_path):
    """With prefill pacing on, a rank's warm-up passes are not measured (freeze_clock): a pacer that learned
    from them would chunk the later warm-up prompts by this rank's speed, and a slower rank's extra pass
    would leave its collectives unpaired. Serving (the Leader) measures again."""
    calls_at, acks_at = control_addresses(str(tmp_path))
    sub = zmq.Context.instance().socket(zmq.SUB)  # the other rank, as far as the Leader's wait for it goes
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(calls_at)
    engine = make_engine(tiny_model("llama"), prefill_pass_s=0.05)
    freeze_clock(engine)
    engine.warm_up()
    assert engine.pacer.passes == 0 and engine.pacer.seconds_per_unit == 0.0
    leader = Leader(engine, TwoRanks(), (calls_at, acks_at))
    try:
        run_all(leader, workload()[:1])
        assert engine.pacer.passes > 0
    finally:
        leader.close()
        sub.close(linger=0)


def test_setting_the_default_adapter_and_dropping_blocks_are_calls_every_rank_replays(tmp_path):
    calls_at, acks_at = control_addresses(str(tmp_path))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(calls_at)
    engine = make_engine(tiny_model("llama"), block_size=16)  # the workload's prompts fill 16-token blocks
    leader = Leader(engine, TwoRanks(), (calls_at, acks_at))
    try:
        run_all(leader, workload()[:2])
        while sub.poll(100):
            sub.recv()
        assert leader.drop_cached_blocks() > 0 and engine.blocks.num_cached == 0
        leader.set_default_adapter("")
        leader.step()
        batch = protocol.decode(sub.recv(), protocol.RankBatch)
        assert [type(c) for c in batch.calls] == [protocol.DropCachedBlocks, protocol.SetDefaultAdapter,
                                                   protocol.Step]
    finally:
        leader.close()
        sub.close()


class TwoRanks:
    """A group of two as rank 0 sees it, for a Leader whose follower is this test (no collective runs:
    the model is not sharded)."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


def rank_1_after(leader, seconds: float = 10.0):
    """Rank 1's state in the leader's stats once an ack was taken (acks arrive asynchronously)."""
    deadline = time.monotonic() + seconds
    while (state := leader.stats().ranks[1]).step == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


def test_rank_0_checks_the_followers_acks_without_waiting(tmp_path, monkeypatch):
    calls_at, acks_at = control_addresses(str(tmp_path))
    ctx = zmq.Context.instance()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(calls_at)
    push.connect(acks_at)
    engine = make_engine(tiny_model("llama"))
    leader = Leader(engine, TwoRanks(), (calls_at, acks_at))
    try:
        start = state_digest(engine)
        leader.add_request(req("r", [1, 2, 3], greedy(8)))
        leader.step()  # returns with no ack heard
        first = protocol.decode(sub.recv(), protocol.RankBatch)
        assert first.seq == 1 and first.digest == start
        assert [type(c) for c in first.calls] == [protocol.AddRequest, protocol.Step]
        push.send(protocol.encode(protocol.RankAck(rank=1, seq=1, digest=state_digest(engine))))
        state = rank_1_after(leader)
        assert state.agrees and state.step == 1
        leader.step()
        assert protocol.decode(sub.recv(), protocol.RankBatch).seq == 2
        push.send(protocol.encode(protocol.RankAck(rank=1, seq=2, digest=12345)))  # a follower whose state differs
        with pytest.raises(TensorParallelError, match="rank 1 diverged from rank 0 after batch 2"):
            for _ in range(1000):
                leader.stats()
                time.sleep(0.01)
        monkeypatch.setattr(distributed, "SILENT_AFTER_S", 0.0)
        monkeypatch.setattr(distributed, "ACK_GRACE_S", 0.05)
        leader.step()  # batch 3, never acknowledged
        with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] have not answered rank 0's batch 3"):
            leader.step()
    finally:
        leader.close()
        sub.close()
        push.close()


def test_a_follower_that_misses_a_batch_exits(tmp_path):
    calls_at, _ = control_addresses(str(tmp_path))
    engine = make_engine(tiny_model("llama"))
    pub = zmq.Context.instance().socket(zmq.XPUB)
    pub.bind(calls_at)

    def rank_0():
        if pub.poll(30_000):  # the follower subscribed
            pub.recv()
            pub.send(protocol.encode(protocol.RankBatch(calls=[protocol.Step()], digest=state_digest(engine), seq=2)))

    sender = threading.Thread(target=rank_0)
    sender.start()
    try:
        with pytest.raises(TensorParallelError, match="got rank 0's batch 2, expected 1"):
            follow(engine, mx.distributed.init(), control_addresses(str(tmp_path)))
    finally:
        sender.join()
        pub.close(linger=0)


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1]))


def test_a_hostfile_places_the_ranks_on_this_machines_addresses(tmp_path):
    from parallm.launch.group import hostfile_ranks

    local = tmp_path / "hosts.json"
    local.write_text(json.dumps([{"ssh": "localhost"}, {"ssh": "localhost", "ips": ["127.0.0.1"]}]))
    assert [(h.ip, h.local) for h in hostfile_ranks(str(local), 2)] == [("127.0.0.1", True)] * 2
    ring = json.loads(write_ring_hostfile(tmp_path / "ring.json", 2, hosts=["127.0.0.1", "127.0.0.1"]).read_text())
    assert len(ring) == 2 and ring[0] != ring[1] and all(r[0].startswith("127.0.0.1:") for r in ring)
    # ranks on other machines and the refusals: tests/test_distributed_remote.py


def test_the_supervisor_announces_remote_replicas_up_and_down():
    from parallm import protocol
    from parallm.launch.group import RemoteReplicas

    remotes = RemoteReplicas(first=2, count=1)
    beat = protocol.Heartbeat(stage="engine", replica=2, pid=100)
    assert not remotes.hear(protocol.Heartbeat(stage="engine", replica=1, pid=5), 0.0)  # a local one: not ours
    assert remotes.check(0.0, 10.0) == []  # never heard: nothing to announce
    assert remotes.hear(beat, 1.0)
    [up] = remotes.check(1.5, 10.0)
    assert isinstance(up, protocol.StageUp) and up.replica == 2
    assert remotes.check(5.0, 10.0) == []
    [down] = remotes.check(11.5, 10.0)  # silent for more than 10 s
    assert isinstance(down, protocol.StageDown) and down.replica == 2 and down.restarts == 1
    remotes.hear(beat, 12.0)
    assert [type(m) for m in remotes.check(12.0, 10.0)] == [protocol.StageUp]
    remotes.hear(protocol.Heartbeat(stage="engine", replica=2, pid=101), 13.0)  # a new process: its requests are lost
    assert [type(m) for m in remotes.check(13.0, 10.0)] == [protocol.StageDown]
    assert [type(m) for m in remotes.check(13.5, 10.0)] == [protocol.StageUp]
