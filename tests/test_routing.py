"""parallm/routing.py: replica addresses, and the tokenizers' choice of replica."""

from __future__ import annotations

from parallm.config import Config, TransportConfig
import subprocess
import sys

from parallm.engine.blocks import NO_HASH, BlockManager, block_hash
from parallm.routing import Router, adapters_address, block_hashes, engine_address
from parallm.transport import addresses


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 7919 + j * 104729) % 5000 for j in range(n)]


def test_block_hashes_are_the_engines():
    ids = list(range(40))
    hashes = block_hashes(ids, 16, "a@1")
    assert len(hashes) == 2  # full blocks only
    assert hashes[0] == block_hash(NO_HASH, ids[:16], "a@1")
    assert hashes[1] == block_hash(hashes[0], ids[16:32], "a@1")
    blocks = BlockManager(4, 16)  # the engine's prefix cache keys the same prompt's blocks by these hashes
    stored = blocks.store([], ids, "a@1", 2)
    assert [blocks.blocks[bid].hash for bid, _ in stored] == hashes


def test_routing_imports_no_mlx():
    """The tokenizer hashes blocks to route (parallm/hashing.py) without importing MLX or the engine."""
    code = "import sys, parallm.routing; print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx' or m.startswith('parallm.engine')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_requests_spread_over_the_replicas():
    router = Router(2, 16, clock=Clock())
    picks = [router.choose(prompt(i), cost=100) for i in range(10)]
    assert picks.count(0) == picks.count(1) == 5
    assert router.routed == [5, 5]


def test_prefix_sharing_requests_go_to_the_same_replica():
    router = Router(2, 16, clock=Clock())
    shared = prompt(99, 160)  # 10 blocks: a hit saves 160 tokens of prefill
    first = router.choose(shared + [1, 2, 3], cost=100)
    router.choose(prompt(1), cost=100)  # the other replica is now as loaded
    for tail in range(4):  # until it carries 2 x 160 tokens more than the other
        assert router.choose(shared + [tail] * 5, cost=100) == first
    assert router.affinity_hits == 4
    assert router.choose(shared + [9] * 5, cost=100) != first


def test_a_short_common_prefix_does_not_pin_every_request():
    router = Router(2, 16, clock=Clock())
    system = prompt(5, 16)  # one block every chat shares
    picks = [router.choose(system + prompt(i, 30), cost=200) for i in range(6)]
    assert picks.count(0) == picks.count(1) == 3


def test_affinity_yields_to_a_much_lighter_replica():
    router = Router(2, 16, clock=Clock())
    shared = prompt(3, 32)
    owner = router.choose(shared, cost=100)
    picks = [router.choose(shared + [t], cost=100) for t in range(8)]
    assert picks.count(owner) < 8, "one hot prefix must not pin every request to one replica"


def test_load_decays_and_down_replicas_take_nothing():
    clock = Clock()
    router = Router(2, 16, clock=clock, half_life_s=1.0)
    router.choose(prompt(1), cost=1000)
    clock.t = 20.0
    router._age()
    assert max(router.load) < 1.0
    router.mark_down(1)
    assert {router.choose(prompt(i), cost=10) for i in range(5)} == {0}
    router.mark_up(1)
    assert 1 in {router.choose(prompt(i + 10), cost=10) for i in range(5)}


def test_replica_addresses_are_distinct():
    ipc = addresses(Config(transport=TransportConfig(run_dir="/tmp/x")))
    assert engine_address(ipc, 0) == ipc.engine and adapters_address(ipc, 0) == ipc.adapters
    assert engine_address(ipc, 1) == "ipc:///tmp/x/engine-r1.sock"
    tcp = addresses(Config(transport=TransportConfig(kind="tcp", tcp_base_port=7000)))
    used = {tcp.engine, tcp.detok, tcp.router, tcp.supervisor, tcp.control, tcp.rollouts, tcp.adapters,
            tcp.training, *tcp.tokenizers}
    extra = [f(tcp, r) for r in (1, 2) for f in (engine_address, adapters_address)]
    assert len(set(extra)) == 4 and not set(extra) & used


def test_replica_stats_reach_replica_0_and_go_stale():
    import zmq

    from parallm import protocol
    from parallm.routing import STALE_AFTER_S, ReplicaReports
    from parallm.transport import Receiver, Sender

    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://replica-0")
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://replica-0")
    clock = Clock()
    second = ReplicaReports(1, Sender(push), clock=clock)
    first = ReplicaReports(0, clock=clock)
    inbox = Receiver(pull, protocol.EngineInbound)
    calls = []

    def stats() -> protocol.EngineStats:
        calls.append(clock.t)
        return protocol.EngineStats(replica=1, running=len(calls), adapters=protocol.AdapterStats(latest={"a": 3}))

    for t in (0.0, 0.5, 1.2):  # pushed at 0 and 1.2 only
        clock.t = t
        second.tick(stats)
        first.tick(stats)  # replica 0 pushes nothing
    assert calls == [0.0, 1.2]
    received = 0
    while received < 2:
        assert pull.poll(1000)
        for message in inbox.drain():
            first.receive(message)
            received += 1
    [got] = first.others()
    assert got.replica == 1 and got.running == 2 and got.adapters.latest == {"a": 3}
    clock.t = 1.2 + STALE_AFTER_S + 0.1  # a dead replica's last stats are dropped
    assert first.others() == []
    push.close(0)
    pull.close(0)


def test_a_dead_replica_gives_back_only_the_requests_sent_to_it():
    from parallm.routing import REMEMBER_S, RecentIds

    clock = Clock()
    router = Router(2, 16, clock=clock)
    picks = {f"r{i}": router.choose(prompt(i), cost=100, rid=f"r{i}", reply_to=b"c%d" % i) for i in range(6)}
    on_one = sorted(rid for rid, r in picks.items() if r == 1)
    assert on_one and len(on_one) < 6
    lost = router.mark_down(1)
    assert sorted(rid for rid, _ in lost) == on_one
    assert all(reply_to == b"c" + rid[1:].encode() for rid, reply_to in lost)
    assert router.mark_down(1) == []  # given back once
    router.mark_up(1)
    router.choose(prompt(50), cost=1, rid="old", reply_to=b"x")
    clock.t = REMEMBER_S + 1  # long enough ago that it was admitted (or failed) by now
    router.choose(prompt(51), cost=1, rid="new", reply_to=b"y")
    assert "old" not in {rid for rid, _ in router.mark_down(0) + router.mark_down(1)}
    recent = RecentIds(limit=2)
    for rid in ("a", "b", "c"):
        recent.add(rid)
    assert "a" not in recent and "b" in recent and "c" in recent


def conversation(session: int, turns: int, system: list[int]) -> list[list[int]]:
    """A chat's prompts turn by turn: a shared system prompt, a 300-token document of its own, then each
    turn's answer and question appended to the last prompt."""
    prompts, ids = [], system + prompt(1000 + session, 300)
    for turn in range(turns):
        ids = ids + prompt(50 * session + turn, 30)
        prompts.append(list(ids))
    return prompts


def route_conversations(tokenizers: list[Router], clock: Clock, chats: int = 15, turns: int = 5) -> dict[int, list[int]]:
    """Each chat's replica turn by turn; the tokenizers take the requests in turn (as the ingress spreads
    them), so with an odd number of chats each chat's turns alternate between two tokenizers."""
    system = prompt(7, 48)
    convs = [conversation(s, turns, system) for s in range(chats)]
    placed: dict[int, list[int]] = {s: [] for s in range(chats)}
    n = 0
    for turn in range(turns):
        for s, conv in enumerate(convs):
            placed[s].append(tokenizers[n % len(tokenizers)].choose(conv[turn], cost=300))
            n += 1
            clock.t += 0.05
    return placed


def moves(placed: dict[int, list[int]]) -> int:
    return sum(a != b for p in placed.values() for a, b in zip(p, p[1:]))


def test_a_conversation_stays_on_its_home_replica_across_tokenizers():
    """Two tokenizers, each with its own router, take a conversation's turns in turn: the tokenizer that
    routes turn 2 never saw turn 1 (it knows only the system prompt, from other chats). Both send each
    turn to the chat's home replica (the hash of its anchor block) where the load allows: the chats
    spread over both replicas, and at most one turn in ten moves (each chat at most once), where routing
    by each tokenizer's own memory and load moved 16 of 60 turns, some chats every turn."""
    clock = Clock()
    tokenizers = [Router(2, 16, clock=clock, tokenizers=2), Router(2, 16, clock=clock, tokenizers=2)]
    placed = route_conversations(tokenizers, clock)
    assert moves(placed) <= 6, placed
    assert all(sum(a != b for a, b in zip(p, p[1:])) <= 1 for p in placed.values()), placed
    firsts = [p[0] for p in placed.values()]
    assert 4 <= firsts.count(0) <= 11, firsts
    assert sum(r.home_hits for r in tokenizers) >= 50


def test_a_sole_tokenizer_routes_by_its_memory():
    """One tokenizer remembers every turn it routed: no home rule, no turn moves."""
    clock = Clock()
    router = Router(2, 16, clock=clock)
    placed = route_conversations([router], clock)
    assert moves(placed) == 0 and router.home_hits == 0
    assert 5 <= [p[0] for p in placed.values()].count(0) <= 10
