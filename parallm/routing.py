"""Data-parallel engine replicas: where replica i listens, and which replica a request goes to.

Replica 0 keeps the engine's usual addresses (raw clients, ingress's control requests and trainers
reach it as before, and it hands every abort and adapter version on to the others: stages/engine.py);
replica i > 0 binds its own engine PULL and adapters SUB beside them.

A tokenizer routes each request (`Router.choose`): to the replica that last took a request sharing
the longest prefix of full blocks with it (the engine's own chained block hashes, so that replica's
prefix cache holds those blocks), unless that replica carries more than the lightest one by over
AFFINITY_SLACK times the prefill the hit saves (so a system prompt every chat shares does not pin
all traffic to one replica, while a long shared context does keep its requests together); else to
the lightest. Load is the work this tokenizer sent each replica (prompt + max_tokens tokens),
decayed with a half-life: it needs no message back from the engines. An n > 1 request is one
message, so its samples stay on one replica. A replica the supervisor announced down takes nothing
until it is back.

With several tokenizers (tokenizer.replicas), each remembers only what it routed itself, and the
ingress spreads a conversation's turns over them: turn 2 of a chat reaches a tokenizer that never
saw turn 1. So with several, every tokenizer also knows each prompt's home replica, alike and with
no message between them: the rendezvous-hash winner, over the replicas that are up, of the hash of
the prompt's anchor block (its ANCHOR_BLOCKS-th full block; a shorter prompt's 8th, 4th, 2nd or 1st,
the deepest it has; SGLang's router mirrors every worker's cache in one radix tree, in one process:
several tokenizers share no tree, and the home is what they agree on without one). It tries the
home first, within a load bound of AFFINITY_SLACK times the prompt's full blocks' tokens (what the
home holds when an earlier turn went there), then what it remembers, then the lightest: what one
tokenizer remembers may be stale (another may have sent a later turn home), and the home is where
they all converge. A sole tokenizer's memory is complete: it routes by memory and load alone.
A conversation's turns share their first 256 tokens, so they share a home: the turns of a multi-turn
chat stay on one replica whichever tokenizer routes them (a chat shorter than that moves when its
prompt doubles; perf/bench_prefix_routing.py with --server-args --tokenizer.replicas 2).

A dead replica fails only its own requests: the detokenizer fails those it had admitted (each
Track names its replica), and each tokenizer those it sent it lately (`Router.mark_down` returns
them: they may have been lost on the way, or waiting in it for an adapter version), while clients
fail nothing on their own for a replica of several (parallm/pipeline.py). A "lost" error for a
request that had in fact finished is dropped by the detokenizer (`RecentIds`).

Stats: replica i > 0 pushes its EngineStats to replica 0 about every second (`ReplicaReports`);
replica 0 answers GetStats with its own and, in `replicas`, the others' latest (a replica silent for
STALE_AFTER_S, e.g. a dead one, is left out until it reports again), so one GetStats (ingress's
/metrics poll, `Client.stats()`) sees every replica.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence

from parallm import protocol
from parallm.hashing import block_hashes
from parallm.config import Config, EngineConfig
from parallm.keys import Curve, stage_curve
from parallm.threads import name_os_thread
from parallm.transport import Addresses, Sender

HALF_LIFE_S = 2.0
REMEMBER_S = 150.0  # how long a tokenizer remembers where it sent a request (> adapters.hold_timeout_s)
MAX_REMEMBERED = 65536
AFFINITY_SLACK = 2.0  # a prefix's replica keeps it while it carries at most this many times the cached tokens more
ANCHOR_BLOCKS = 16  # a prompt's anchor: its 16th full block (256 tokens); a shorter prompt's 1st, 2nd, 4th or 8th
MAX_PREFIXES = 65536
REPORT_EVERY_S = 1.0
STALE_AFTER_S = 5.0



def _sibling(address: str, kind: str, replica: int, n_tokenizers: int) -> str:
    if replica == 0:
        return address
    if address.startswith("ipc://"):
        return address[:-len(".sock")] + f"-r{replica}.sock"
    host, port = address.rsplit(":", 1)
    base = int(port) - (0 if kind == "engine" else 6)  # transport's offsets: engine 0, adapters 6
    return f"{host}:{base + 9 + n_tokenizers + 2 * (replica - 1) + (kind == 'adapters')}"


def replica_count(engine: EngineConfig) -> int:
    """Every engine replica: engine.replicas local ones, then engine.remote_replicas."""
    return engine.replicas + len(engine.remote_replicas)


def engine_address(addrs: Addresses, replica: int, engine: EngineConfig | None = None) -> str:
    """Replica `replica`'s engine PULL (replica 0: the engine's usual address; a remote one: its entry
    of engine.remote_replicas)."""
    if engine is not None and replica >= engine.replicas:
        return engine.remote_replicas[replica - engine.replicas]
    return _sibling(addrs.engine, "engine", replica, len(addrs.tokenizers))


def adapters_address(addrs: Addresses, replica: int, engine: EngineConfig | None = None) -> str:
    """Replica `replica`'s adapters SUB (replica 0: the usual one, which trainers publish to; a remote
    one: the port after its engine PULL's)."""
    if engine is not None and replica >= engine.replicas:
        host, port = engine.remote_replicas[replica - engine.replicas].rsplit(":", 1)
        return f"{host}:{int(port) + 1}"
    return _sibling(addrs.adapters, "adapters", replica, len(addrs.tokenizers))


def replica_curve(config: Config, replica: int) -> Curve | None:
    """The CURVE keys for connecting to replica `replica`: None (this process's own) for a local one; for
    a remote one, the server's key pair as the client's too (a remote engine binds with the server's
    pair and admits the server's public key: parallm/launch/remote.py)."""
    keys = stage_curve(config.transport.curve_keys)
    if replica < config.engine.replicas or keys is None or keys.server_secret is None:
        return None
    return Curve(server_public=keys.server_public, public=keys.server_public, secret=keys.server_secret)


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit value of `x` (rendezvous hashing's score)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class Router:
    """Chooses a replica per request (module docstring); pure Python, one per tokenizer."""

    def __init__(self, replicas: int, block_size: int, *, clock: Callable[[], float] = time.monotonic,
                 half_life_s: float = HALF_LIFE_S, down: Sequence[int] = (), tokenizers: int = 1) -> None:
        """`down`: replicas that take nothing until `mark_up` (remote ones, until the supervisor has heard
        them); `tokenizers`: how many tokenizers route (tokenizer.replicas), each with its own Router."""
        if replicas < 1:
            raise ValueError("a router needs at least one replica")
        self.replicas = replicas
        self.tokenizers = tokenizers
        self.block_size = block_size
        self.clock = clock
        self.decay = math.log(2) / half_life_s
        self.load = [0.0] * replicas
        self.routed = [0] * replicas
        self.affinity_hits = 0
        self.home_hits = 0  # requests sent to their anchor's home replica (module docstring)
        self.down: set[int] = set(down)
        self._stamp = clock()
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # block hash -> replica, least recent first
        self._sent: OrderedDict[str, tuple[float, int, bytes]] = OrderedDict()  # rid -> (when, replica, reply_to)

    def _age(self) -> None:
        now = self.clock()
        factor = math.exp(-self.decay * max(0.0, now - self._stamp))
        self.load = [x * factor for x in self.load]
        self._stamp = now

    def choose(self, ids: Sequence[int], cost: float, adapter: str = "", rid: str = "", reply_to: bytes = b"") -> int:
        """The replica for a request with prompt `ids` and `cost` tokens of work; counts it there (and
        remembers where request `rid` went, for `mark_down`)."""
        self._age()
        up = [r for r in range(self.replicas) if r not in self.down] or list(range(self.replicas))
        lightest = min(up, key=lambda r: (self.load[r], self.routed[r]))
        hashes = block_hashes(ids, self.block_size, adapter) if self.replicas > 1 else []
        known, owner = 0, None
        for blocks in range(len(hashes), 0, -1):  # the longest prefix this tokenizer placed
            placed = self._prefixes.get(hashes[blocks - 1])
            if placed is not None and placed in up:
                known, owner = blocks, placed
                break
        candidates = [(owner, known, "affinity")] if owner is not None else []
        if hashes and self.tokenizers > 1:  # the home first: where every tokenizer sends this prompt
            anchor = min(1 << (len(hashes).bit_length() - 1), ANCHOR_BLOCKS)
            home = max(up, key=lambda r: _mix(hashes[anchor - 1] ^ _mix(r + 1)))
            candidates.insert(0, (home, len(hashes), "home"))
        choice, rule = lightest, ""
        for replica, blocks, why in candidates:  # the first within the load bound
            if self.load[replica] - self.load[lightest] <= AFFINITY_SLACK * blocks * self.block_size:
                choice, rule = replica, why
                break
        self.affinity_hits += rule == "affinity"
        self.home_hits += rule == "home"
        for h in hashes:
            self._prefixes[h] = choice
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > MAX_PREFIXES:
            self._prefixes.popitem(last=False)
        self.load[choice] += cost
        self.routed[choice] += 1
        if rid:
            self._remember(rid, choice, reply_to)
        return choice

    def _remember(self, rid: str, replica: int, reply_to: bytes) -> None:
        now = self.clock()
        self._sent[rid] = (now, replica, reply_to)
        while self._sent and (len(self._sent) > MAX_REMEMBERED or
                              next(iter(self._sent.values()))[0] < now - REMEMBER_S):
            self._sent.popitem(last=False)

    def mark_down(self, replica: int) -> list[tuple[str, bytes]]:
        """Replica `replica` died: it takes nothing until `mark_up`. Returns (rid, reply_to) of the
        requests sent to it in the last REMEMBER_S, forgotten here."""
        if 0 <= replica < self.replicas:
            self.down.add(replica)
        lost = [(rid, reply_to) for rid, (_, r, reply_to) in self._sent.items() if r == replica]
        for rid, _ in lost:
            del self._sent[rid]
        return lost

    def mark_up(self, replica: int) -> None:
        self.down.discard(replica)


class ReplicaReports:
    """Replica i > 0: its stats pushed to replica 0 every REPORT_EVERY_S (`tick`). Replica 0: the
    latest stats of each other replica (`receive`, `others`), and for a remote one (replica >=
    `remote_from`) a Heartbeat on its behalf to the supervisor (`to_supervisor`), whose socket only
    local processes reach: that is how the supervisor hears remote replicas (launch/group.py)."""

    def __init__(self, replica: int, to_first: Sender | None = None, *,
                 clock: Callable[[], float] = time.monotonic, to_supervisor: Sender | None = None,
                 remote_from: int = 1 << 30) -> None:
        self.replica = replica
        self.to_first = to_first
        self.clock = clock
        self.to_supervisor = to_supervisor
        self.remote_from = remote_from
        self._due = 0.0
        self._latest: dict[int, tuple[float, protocol.EngineStats]] = {}
        self._last: protocol.ReplicaStats | None = None
        self._beating = False

    def tick(self, stats: Callable[[], protocol.EngineStats]) -> None:
        """Push this replica's stats when due (never blocks: replica 0 may be down)."""
        if self.to_first is None:
            return
        now = self.clock()
        if now >= self._due:
            self._due = now + REPORT_EVERY_S
            self._last = protocol.ReplicaStats(replica=self.replica, stats=stats(), pid=os.getpid())
            if not self._beating:
                self.to_first.send(self._last, block=False)

    def beat_from_thread(self, open_sender: Callable[[], Sender]) -> None:
        """Send the latest stats every REPORT_EVERY_S from a thread, on a socket of its own (`open_sender`),
        rather than from the loop: a remote replica's liveness (the supervisor hears it through these)
        must not wait for a long step, as a local stage's heartbeat thread does not."""
        self._beating = True

        def beat() -> None:
            name_os_thread()
            sender = open_sender()
            while True:
                if self._last is not None:
                    sender.send(self._last, block=False)
                time.sleep(REPORT_EVERY_S)

        threading.Thread(target=beat, name="replica-stats", daemon=True).start()

    def receive(self, message: protocol.ReplicaStats) -> None:
        message.stats.replicas = []
        self._latest[message.replica] = (self.clock(), message.stats)
        if self.to_supervisor is not None and message.replica >= self.remote_from:
            self.to_supervisor.send(protocol.Heartbeat(stage="engine", replica=message.replica, pid=message.pid,
                                                       in_flight=message.stats.running + message.stats.waiting),
                                    block=False)

    def silent(self, replica: int) -> bool:
        """Whether `replica` reported before but not for STALE_AFTER_S (down or restarting)."""
        seen = self._latest.get(replica)
        return seen is not None and self.clock() - seen[0] > STALE_AFTER_S

    def others(self) -> list[protocol.EngineStats]:
        """The other replicas' latest stats, by replica, leaving out those silent for STALE_AFTER_S."""
        return [stats for replica, (_, stats) in sorted(self._latest.items()) if not self.silent(replica)]


def lost_error(rid: str, reply_to: bytes) -> protocol.RequestError:
    """What a tokenizer tells the client of a request it sent to a replica that died."""
    return protocol.RequestError(rid=rid, reply_to=reply_to, status=503, code="stage_restarted", retryable=True,
                                 message="the engine replica this request was sent to restarted; retry it")


class RecentIds:
    """The last MAX_REMEMBERED request ids added (the detokenizer's requests that ended)."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, rid: str) -> None:
        self._ids[rid] = None
        if len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def __contains__(self, rid: str) -> bool:
        return rid in self._ids
