"""Issue 30: one user's request, message or path must not stall or corrupt other users' work. Each test
attacks the session server while other clients' requests run, and checks those requests whole."""

from __future__ import annotations

import asyncio
import os
import time

import msgpack
import pytest
import zmq

from parallm import protocol
from parallm.client import AsyncClient
from parallm.protocol import SamplingParams

pytestmark = pytest.mark.e2e

VICTIMS = [[1, 504, 3458, 282, 2], [1, 9690, 30], [1, 422, 5248, 314, 253, 1694, 28], [1, 19, 2]]


class Attacker:
    """A raw ZeroMQ client with an allowed address: its own DEALER and a PUSH to the engine."""

    def __init__(self, router: str, identity: bytes = b"attacker") -> None:
        self.ctx = zmq.Context()
        self.identity = identity
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, identity)
        self.dealer.connect(router)
        self.dealer.send(protocol.encode(protocol.Hello(client="attacker")))
        welcome = self.recv(10)
        assert isinstance(welcome, protocol.Welcome)
        self.engine = self.ctx.socket(zmq.PUSH)
        self.engine.connect(welcome.addresses["engine"])

    def push(self, fields: dict) -> None:
        self.engine.send(msgpack.packb({"v": protocol.PROTOCOL_VERSION, **fields}))

    def recv(self, timeout: float) -> object | None:
        if not self.dealer.poll(int(timeout * 1000)):
            return None
        return protocol.decode(self.dealer.recv(), protocol.ClientInbound)

    def until(self, predicate, timeout: float = 60.0) -> list:
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.recv(max(0.01, deadline - time.monotonic()))
            if message is None:
                break
            seen.append(message)
            if predicate(message):
                return seen
        raise AssertionError(f"not received within {timeout} s; got {seen}")

    def close(self) -> None:
        self.ctx.destroy(0)


def test_an_abort_reason_outside_the_enum_is_refused_and_costs_no_one_a_token(server):
    """Before: the engine copied reason "bogus" into finish_reason, the detokenizer rejected that whole
    step message ("Invalid enum value"), each request batched in the step lost its tokens, and the
    aborted request never ended. Now the codec refuses the abort with a 400 to its sender."""
    attacker = Attacker(server.router)
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

        async def victims() -> list:
            async with AsyncClient(server.router, timeout=120) as client:
                streams = [client.stream(ids, params) for ids in VICTIMS]
                got = [[await anext(s)] for s in streams]  # every victim is running
                attacker.push({"type": "abort", "rids": ["att-1"], "reason": "bogus", "qid": "q-bad",
                               "reply_to": attacker.identity})
                for out, s in zip(got, streams):
                    out.extend([o async for o in s])
                return got

        attacker.push({"type": "submit", "rid": "att-1", "reply_to": attacker.identity,
                       "prompt_ids": protocol.pack_ids([1, 2, 3]),
                       "spec": {"params": {"max_tokens": 60, "temperature": 0.0, "ignore_eos": True}}})
        results = asyncio.run(victims())
        for outs in results:
            tokens = sum(protocol.count_ids(o.token_ids) for o in outs)
            assert (tokens, outs[-1].usage.completion_tokens, outs[-1].finish_reason) == (40, 40, "length")
        seen = attacker.until(lambda m: isinstance(m, protocol.RequestError) and m.rid == "q-bad")
        error = seen[-1]
        assert (error.status, error.code) == (400, "invalid_message") and "reason" in error.message
        # the attacker's own request was not aborted: it runs to its end
        seen += attacker.until(lambda m: isinstance(m, protocol.Outputs)
                               and any(o.rid == "att-1" and o.finish_reason for o in m.items))
        outs = [o for m in seen if isinstance(m, protocol.Outputs) for o in m.items if o.rid == "att-1"]
        assert sum(protocol.count_ids(o.token_ids) for o in outs) == 60 and outs[-1].finish_reason == "length"
    finally:
        attacker.close()


def test_health_follows_a_resume_at_once(server, http):
    """Before: /health said `paused` for up to one stats poll (0.5 s) after /v1/resume had answered."""
    try:
        for _ in range(3):
            assert http.post("/v1/pause", json={"mode": "keep"}).json()["paused"] is True
            assert http.get("/health").json()["status"] == "paused"
            assert http.post("/v1/resume").json()["paused"] is False
            health = http.get("/health")
            assert (health.status_code, health.json()["status"]) == (200, "ok")
    finally:
        http.post("/v1/resume")  # the session server serves the next tests


def test_weight_and_adapter_errors_name_no_server_path(server, http, tmp_path):
    """Before: a weight file MLX could not read answered "cannot read model.safetensors: [load_safetensors]
    Invalid json header length file /tmp/.../model.safetensors". The server's paths stay in its log."""
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")  # a header length past the end
    r = http.post("/v1/weights", json={"path": str(tmp_path)})
    assert r.status_code == 400, r.text
    assert str(tmp_path) not in r.text and "Errno" not in r.text and "model.safetensors" in r.text
    weights = tmp_path / "fifo"
    weights.mkdir()
    os.mkfifo(weights / "model.safetensors")
    t0 = time.monotonic()
    r = http.post("/v1/weights", json={"path": str(weights)})
    assert r.status_code == 400 and "not a regular file" in r.text and time.monotonic() - t0 < 10
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_huge_constraint_is_a_400_naming_the_field_at_once(http):
    """Before: 100k choices ended after 11 s in a 400 carrying llguidance's Rust panic and backtrace (and 60k
    delayed everyone's tokens by 3.7 s). Past engine.max_constraint_bytes it is refused before any work."""
    choices = [f"option-{i}" for i in range(100_000)]
    t0 = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "structured_outputs": {"choice": choices}})
    assert r.status_code == 400 and time.monotonic() - t0 < 2.0
    error = r.json()["error"]
    assert error["param"] == "structured_outputs" and "max_constraint_bytes" in error["message"]
    assert "panicked" not in r.text and ".rs:" not in r.text
