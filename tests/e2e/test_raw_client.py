"""RL rollouts over raw ZeroMQ on the real server: the project's client and a msgpack-only one."""

from __future__ import annotations

import math
import struct
import threading
import time
import uuid

import msgpack
import pytest
import zmq

from parallm import protocol
from parallm.client import Client
from parallm.protocol import SamplingParams

pytestmark = pytest.mark.e2e

PROMPTS = [[1, 504, 3458, 282, 2], [1, 9690, 30], [1, 422, 5248, 314, 253, 1694, 28], [1, 19, 2], [1, 1812],
           [1, 7306, 253, 2096, 282, 260, 2361], [1, 3120, 314, 11], [1, 532, 1178, 4120, 30, 216]]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.router, timeout=300) as c:
        yield c


@pytest.mark.slow  # 15 s: make test's 10-minute budget (clean clone, 2-core CI host)
def test_group_logprobs_match_teacher_forced_rescoring(client):
    """8 prompts x 4 samples: the logprob reported for each sampled token is the one the model gives
    that token when the same ids are scored without sampling (temperature 1: the raw distribution)."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, logprobs=True, ignore_eos=True)
    groups = client.generate_group(PROMPTS, params, n=4)
    sequences = [s for group in groups for s in group]
    assert len(sequences) == 32
    for prompt, group in zip(PROMPTS, groups):
        assert sorted(s.index for s in group) == [0, 1, 2, 3]
        assert len({tuple(s.token_ids) for s in group}) > 1, "4 samples of one prompt were all identical"
        for seq in group:
            assert seq.finish_reason == "length" and len(seq.token_ids) == 12 == len(seq.logprobs)
            assert seq.usage.prompt_tokens == len(prompt) and seq.usage.completion_tokens == 12
            assert seq.versions == [(0, 0)]
            scored = client.score(prompt + seq.token_ids, start=len(prompt))
            assert max(abs(a - b) for a, b in zip(seq.logprobs, scored["logprobs"])) < 1e-3


def test_top_logprobs_and_greedy_maximum(client):
    [seq] = client.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=3))
    assert len(seq.top_logprobs) == len(seq.token_ids) == 6
    for token, lp, top in zip(seq.token_ids, seq.logprobs, seq.top_logprobs):
        assert len(top) == 3 and top[0][0] == token and abs(top[0][1] - lp) < 1e-5
        assert top[0][1] >= top[1][1] >= top[2][1]


def test_text_and_chat_prompts_through_the_tokenizer(client):
    [seq] = client.generate([{"role": "user", "content": "What is 2+2?"}],
                            SamplingParams(max_tokens=8, temperature=0), detok=True)
    assert seq.text and seq.token_ids and seq.usage.prompt_tokens > 10
    [plain] = client.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0), detok=True)
    assert plain.text.strip()


def test_abort_returns_partial_tokens(client):
    rid = client.submit(PROMPTS[1], SamplingParams(max_tokens=2000, logprobs=True, ignore_eos=True))
    seen = 0
    stream = client.stream(rid)
    result = {}
    for out in stream:
        result.setdefault(out.index, []).extend(protocol.unpack_ids(out.token_ids))
        seen += 1
        if seen == 3:
            client.abort([rid])
        if out.finish_reason:
            assert out.finish_reason == "abort"
            break
    tokens = result[0]
    assert 0 < len(tokens) < 2000
    assert client.stats().running == 0


def test_rollout_subscriber_sees_every_finished_sequence(server, client):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"ipc://{server.run_dir}/rollouts.sock")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # the subscription reaches the publisher
    step_id = uuid.uuid4().hex
    rids = [client.submit(p, SamplingParams(max_tokens=5, logprobs=True), n=2, metadata={"step_id": step_id})
            for p in PROMPTS[:4]]
    results = {rid: client.result(rid) for rid in rids}
    got = {}
    deadline = time.monotonic() + 30
    while len(got) < 8 and time.monotonic() < deadline:
        if sub.poll(500):
            topic, payload = sub.recv_multipart()
            rollout = protocol.decode(payload)
            if rollout.metadata.get("step_id") == step_id:
                assert topic == b""
                got[(rollout.rid, rollout.index)] = rollout
    sub.close(0)
    assert len(got) == 8
    for rid, seqs in results.items():
        for seq in seqs:
            r = got[(rid, seq.index)]
            assert protocol.unpack_ids(r.completion_ids) == seq.token_ids
            assert protocol.unpack_floats(r.logprobs) == pytest.approx(seq.logprobs, abs=1e-6)
            assert r.finish_reason == seq.finish_reason and r.versions == [(0, 0)]
            assert r.finished_at >= r.first_token_at >= r.submitted_at > 0


def _ids(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def test_msgpack_only_client(server):
    """Everything a client in another language needs: pyzmq sockets and plain msgpack maps."""
    ctx = zmq.Context.instance()
    identity = f"raw-{uuid.uuid4().hex[:8]}".encode()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, identity)
    dealer.connect(server.router)
    dealer.send(msgpack.packb({"type": "hello", "v": 2, "client": "raw test"}))
    assert dealer.poll(10_000)
    welcome = msgpack.unpackb(dealer.recv())
    assert welcome["type"] == "welcome" and welcome["model"]
    push = ctx.socket(zmq.PUSH)
    push.connect(welcome["addresses"]["engine"])
    rid = uuid.uuid4().hex
    push.send(msgpack.packb({"type": "submit", "v": 2, "rid": rid, "reply_to": identity,
                             "prompt_ids": _ids(PROMPTS[0]),
                             "spec": {"n": 2, "params": {"max_tokens": 7, "temperature": 0, "logprobs": True}}}))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[float]] = {0: [], 1: []}
    finished = {}
    deadline = time.monotonic() + 60
    while len(finished) < 2 and time.monotonic() < deadline:
        if not dealer.poll(1000):
            continue
        message = msgpack.unpackb(dealer.recv(), strict_map_key=False)
        assert message["type"] == "outputs", message
        for out in message["items"]:
            if out["rid"] != rid:
                continue
            index = out.get("index", 0)
            raw = out.get("token_ids", b"")
            tokens[index] += list(struct.unpack(f"<{len(raw) // 4}i", raw))
            lps = out.get("logprobs", b"")
            logprobs[index] += list(struct.unpack(f"<{len(lps) // 4}f", lps))
            if out.get("finish_reason"):
                finished[index] = out
    assert set(finished) == {0, 1}
    assert tokens[0] == tokens[1] and len(tokens[0]) == 7  # greedy: both samples agree
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs[0])
    assert finished[0]["usage"]["prompt_tokens"] == len(PROMPTS[0])
    # a malformed message is dropped; the server still answers
    push.send(b"\x93not a map")
    push.send(msgpack.packb({"type": "submit", "v": 2, "rid": "bad", "reply_to": identity, "prompt_ids": 5}))
    rid2 = uuid.uuid4().hex
    push.send(msgpack.packb({"type": "submit", "v": 2, "rid": rid2, "reply_to": identity,
                             "prompt_ids": _ids([1, 2, 3]), "spec": {"params": {"max_tokens": 2}}}))
    done = False
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        if dealer.poll(1000):
            message = msgpack.unpackb(dealer.recv(), strict_map_key=False)
            done = any(o["rid"] == rid2 and o.get("finish_reason") for o in message.get("items", []))
    assert done
    push.close(0)
    dealer.close(0)


def test_concurrent_clients_share_batches(server):
    """Several raw clients at once: all complete, and the engine batches across them."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with Client(server.router, timeout=300) as c:
                [seq] = c.generate(PROMPTS[i % 8], SamplingParams(max_tokens=24, ignore_eos=True, seed=i))
                assert len(seq.token_ids) == 24
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    with Client(server.router) as c:
        assert c.stats().max_decode_batch > 1
