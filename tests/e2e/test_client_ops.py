"""Every operation of both raw clients on the real server: the sync Client (its background loop)
and the AsyncClient (driven here from the test's own event loop) answer alike."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from typing import Any

import mlx.core as mx
import pytest

from parallm import protocol
from parallm.client import AsyncClient, Client, ClientError
from parallm.protocol import SamplingParams

pytestmark = pytest.mark.e2e

PROMPT = [1, 504, 3458, 282, 2]
LAYERS, HIDDEN, KV = 30, 576, 192  # SmolLM2-135M: q_proj 576 -> 576, v_proj 576 -> 192
RANK = 4
ADAPTER_CONFIG = {"fine_tune_type": "lora", "num_layers": LAYERS,
                  "lora_parameters": {"rank": RANK, "scale": 2.0, "dropout": 0.0}}


def lora_weights(seed: int) -> dict[str, mx.array]:
    mx.random.seed(seed)
    w = {}
    for layer in range(LAYERS):
        for proj, out in (("q_proj", HIDDEN), ("v_proj", KV)):
            w[f"model.layers.{layer}.self_attn.{proj}.lora_a"] = mx.random.normal((HIDDEN, RANK)) * 0.04
            w[f"model.layers.{layer}.self_attn.{proj}.lora_b"] = mx.random.normal((RANK, out)) * 0.04
    return w


class Blocking:
    """An AsyncClient driven by this thread's own event loop, with the sync Client's calling convention
    (coroutines run to their end, `stream` collected into a list)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(client.connect())

    def __getattr__(self, name: str) -> Any:
        member = getattr(self.client, name)
        if inspect.isasyncgenfunction(getattr(AsyncClient, name, None)):
            async def collect(*args: Any, **kwargs: Any) -> list:
                return [out async for out in member(*args, **kwargs)]
            return lambda *args, **kwargs: self.loop.run_until_complete(collect(*args, **kwargs))
        if inspect.iscoroutinefunction(getattr(AsyncClient, name, None)):
            return lambda *args, **kwargs: self.loop.run_until_complete(member(*args, **kwargs))
        return member

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


@pytest.fixture(params=["sync", "async"], scope="module")
def client(request, server):
    c = Client(server.router, timeout=300) if request.param == "sync" else Blocking(AsyncClient(server.router, timeout=300))
    c.kind = request.param
    yield c
    c.close()


def test_generate_and_generate_group(client):
    greedy = SamplingParams(max_tokens=6, temperature=0, logprobs=True)
    [one] = client.generate(PROMPT, greedy)
    assert len(one.token_ids) == len(one.logprobs) == 6 and one.finish_reason == "length"
    assert one.usage.prompt_tokens == len(PROMPT) and one.versions == [(0, 0)]
    groups = client.generate_group([PROMPT, PROMPT[:3]], greedy, n=2)
    assert [len(g) for g in groups] == [2, 2]
    assert groups[0][0].token_ids == groups[0][1].token_ids == one.token_ids  # greedy: every sample agrees
    [text] = client.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0), detok=True)
    assert text.text and text.token_ids


def test_submit_then_stream_or_result(client):
    params = SamplingParams(max_tokens=5, temperature=0)
    first, second = client.submit(PROMPT, params, n=2), client.submit(PROMPT, params, metadata={"k": 1})
    outputs = list(client.stream(first))
    assert {o.index for o in outputs if o.finish_reason} == {0, 1}
    assert sum(protocol.count_ids(o.token_ids) for o in outputs) == 10
    [result] = client.result(second)
    assert len(result.token_ids) == 5
    streamed = list(client.stream(PROMPT, params))
    assert [o.finish_reason for o in streamed][-1] == "length"


def test_abort_returns_partial_tokens(client):
    rid = client.submit(PROMPT, SamplingParams(max_tokens=3000, ignore_eos=True))
    deadline = time.monotonic() + 60
    while client.stats().running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    client.abort([rid])
    [seq] = client.result(rid)
    assert seq.finish_reason == "abort" and 0 < len(seq.token_ids) < 3000


def test_score_matches_sampled_logprobs(client):
    [seq] = client.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=True))
    scored = client.score(PROMPT + seq.token_ids, start=len(PROMPT), top_logprobs=2)
    assert max(abs(a - b) for a, b in zip(seq.logprobs, scored["logprobs"])) < 1e-3
    assert len(scored["top_ids"]) == len(scored["top_logprobs"]) == 2 * len(seq.token_ids)


def test_stats_of_every_stage(client):
    assert isinstance(client.stats(), protocol.EngineStats)
    assert client.stats("engine").settings is not None  # every engine setting, resolved
    assert client.stats("tokenizer").handled >= 0
    detok = client.stats("detokenizer")
    assert isinstance(detok, protocol.DetokenizerStats) and detok.outputs > 0


def test_tokenize_and_detokenize(client):
    ids = client.tokenize("Hello there")
    assert ids and client.detokenize(ids).endswith("Hello there")
    chat = client.tokenize([{"role": "user", "content": "Hi"}])
    assert len(chat) > len(client.tokenize("Hi", add_special_tokens=False))


def test_pause_and_resume(client):
    try:
        state = client.pause("keep")
        assert state.paused is True and client.stats().paused is True
    finally:
        state = client.resume()
    assert state.paused is False and client.stats().paused is False


def test_adapter_load_list_policy_and_unload(client):
    name = f"ops-{client.kind}-{uuid.uuid4().hex[:6]}"
    loaded = client.load_adapter(name, 1, lora_weights(1), ADAPTER_CONFIG)
    assert (loaded.name, loaded.version, loaded.default) == (name, 1, False) and loaded.bytes > 0
    assert client.load_adapter(name, 0, lora_weights(2), ADAPTER_CONFIG).version == 2  # 0: latest + 1
    assert client.policy()[name] == 2
    listed = {a.name: a for a in client.list_adapters().adapters}
    assert listed[name].latest == 2
    [seq] = client.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0), adapter=name)
    assert seq.adapter == name and seq.versions == [(0, 2)]
    assert client.unload_adapter(name).versions_removed >= 1
    assert name not in client.policy()
    with pytest.raises(ClientError) as info:
        client.unload_adapter(name)
    assert info.value.status == 404
    with pytest.raises(ClientError) as info:
        client.generate(PROMPT, SamplingParams(max_tokens=2), adapter=name)
    assert info.value.status == 404 and not info.value.retryable
