"""Prompt logprobs as TRL 1.16's get_sequence_logprobs reads them: each prompt token's exact rank and up
to server.max_logprobs alternatives (vLLM's --max-logprobs; TRL asks 100 by default), checked against a
direct forward of the model; requests past the limit refused with vLLM's message naming it.

Pinned source: TRL v1.16.0 trl/generation/vllm_client.py:684-690 (the body: /v1/completions with
`prompt` = token-id lists, `max_tokens: 1`, `temperature`, `prompt_logprobs: top_logprobs`) and
:703-724 (`_format_sequence_logprobs`: sorts each position's entries by `rank`, keeps `top_logprobs`,
looks up the sequence's own token), copied below as `trl_format`; vLLM 0.31.0
vllm/v1/sample/sampler.py:309-348 (rank = how many entries are >= the token's logprob) and
vllm/sampling_params.py:856-915 (the limit's messages)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from starlette.testclient import TestClient

from _engine_helpers import TINY_VOCAB, greedy, req, tiny_model
from parallm.api.app import build_app
from parallm.config import Config, EngineConfig, ServerConfig
from parallm.engine import Engine, EngineModel, RequestRejected
from parallm.protocol import Output, TextSubmit, pack_floats, pack_ids, pack_top
from test_api_fakes import MODEL, FakeBackend

PROMPT = [3, 17, 88, 41, 5, 60, 23, 9, 71, 12]


def trl_format(choice: dict, sequence: list[int], prompt_length: int, top_logprobs: int) -> dict:
    """TRL v1.16.0 VLLMClient._format_sequence_logprobs (trl/generation/vllm_client.py:703-724), verbatim."""
    logprobs, logprob_token_ids, actual_logprobs, actual_token_ids = [], [], [], []
    for position in range(prompt_length, len(choice["prompt_logprobs"])):
        position_logprobs = choice["prompt_logprobs"][position] or {}
        items = sorted(position_logprobs.items(), key=lambda item: item[1]["rank"])[:top_logprobs]
        values = [-math.inf if math.isnan(item["logprob"]) else item["logprob"] for _, item in items]
        token_ids = [int(token_id) for token_id, _ in items]
        logprobs.append(values + [-math.inf] * (top_logprobs - len(values)))
        logprob_token_ids.append(token_ids + [0] * (top_logprobs - len(token_ids)))
        actual = position_logprobs.get(str(sequence[position]))
        actual_logprobs.append([-math.inf if actual is None or math.isnan(actual["logprob"]) else actual["logprob"]])
        actual_token_ids.append([sequence[position]])
    return {"logprobs": logprobs, "logprob_token_ids": logprob_token_ids, "actual_logprobs": actual_logprobs,
            "actual_token_ids": actual_token_ids}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", 0)


def engine(model, max_logprobs: int = 20) -> Engine:
    return Engine(EngineModel(model, [0], 256, TINY_VOCAB),
                  Config(engine=EngineConfig(block_size=8, kv_budget_mb=16), server=ServerConfig(max_logprobs=max_logprobs)))


def prompt_side(e: Engine, prompt: list[int], k: int):
    """The prompt logprobs, alternatives and ranks of one request (the output that carries them)."""
    e.add_request(req("p", prompt, greedy(1, prompt_logprobs=k)))
    found = None
    while e.has_work():
        for o in e.step():
            if o.prompt_logprobs is not None:
                found = o
    assert found is not None
    return found.prompt_logprobs, found.prompt_top_logprobs, found.prompt_ranks


def test_ranks_and_100_alternatives_are_exact(model):
    plp, top, ranks = prompt_side(engine(model, max_logprobs=100), PROMPT, 100)
    logits = model(mx.array([PROMPT]))[0].astype(mx.float32)
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert plp[0] is None and ranks[0] is None and top[0] is None
    for i in range(1, len(PROMPT)):
        row, own = ref[i - 1], ref[i - 1, PROMPT[i]]
        assert ranks[i] == int((row >= own).sum())                     # vLLM's count, 1 = the most likely
        assert len(top[i]) == 100
        assert [t for t, _ in top[i]] == np.argsort(-row, kind="stable")[:100].tolist()
        assert np.allclose([v for _, v in top[i]], np.sort(row)[::-1][:100], atol=1e-5)
    assert any(r > 1 for r in ranks[1:]), "the test prompt should not be the model's greedy continuation"


def test_more_alternatives_than_the_limit_are_refused_with_vllms_message(model):
    with pytest.raises(RequestRejected, match="Requested prompt logprobs of 21, which is greater than max allowed: 20"):
        engine(model).add_request(req("a", PROMPT, greedy(1, prompt_logprobs=21)))
    with pytest.raises(RequestRejected, match="Requested sample logprobs of 21") as info:
        engine(model).add_request(req("a", PROMPT, greedy(1, logprobs=True, top_logprobs=21)))
    assert info.value.param == "top_logprobs"
    whole = engine(model, max_logprobs=-1)                               # -1: the vocabulary, as vLLM
    whole.add_request(req("v", PROMPT, greedy(1, prompt_logprobs=TINY_VOCAB)))
    with pytest.raises(RequestRejected, match=f"max allowed: {TINY_VOCAB}"):
        whole.add_request(req("w", PROMPT, greedy(1, prompt_logprobs=TINY_VOCAB + 1)))


# --------------------------------------------------------------------------- the HTTP side (scripted engine)

SEQ = [1, 504, 3458, 282, 2]
TOP = [None, [(504, -0.5), (7, -1.5), (9, -2.5)], [(11, -0.2), (3458, -1.7), (12, -3.0)],
       [(13, -0.1), (14, -0.9), (15, -1.1)], [(2, -0.05), (16, -3.5), (17, -4.0)]]
OWN = [None, -0.5, -1.7, -6.0, -0.05]
RANKS = [0, 1, 2, 40, 1]


def scored_script(submit: TextSubmit) -> list[Output]:
    """What the engine stage sends for a prompt-logprobs request: the own token's logprob and rank, the
    alternatives best first."""
    k = submit.spec.params.prompt_logprobs
    filler = [(1000 + j, -10.0 - j / 100) for j in range(k)]              # the engine sends k alternatives
    ids, lps = pack_top([(row + filler)[:k] for row in TOP[1:]])
    return [Output(rid=submit.rid, text="x", token_ids=pack_ids([5]), finish_reason="length", prompt_ids=pack_ids(SEQ),
                   prompt_logprobs=pack_floats([float("nan")] + OWN[1:]), prompt_top_ids=ids, prompt_top_logprobs=lps,
                   prompt_ranks=pack_ids(RANKS))]


def client(max_logprobs: int) -> tuple[TestClient, FakeBackend]:
    fake = FakeBackend(script=scored_script)
    return TestClient(build_app(fake, ServerConfig(max_logprobs=max_logprobs)), raise_server_exceptions=False), fake


def test_trl_get_sequence_logprobs_body_and_reads():
    http, fake = client(100)
    body = {"model": MODEL, "prompt": [SEQ], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 100}  # :684-690
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert fake.submits[0].spec.params.prompt_logprobs == 100
    assert http.get("/server_info").json()["vllm_config"]["model_config"]["max_logprobs"] == 100
    [choice] = r.json()["choices"]
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][3]["282"] == {"logprob": -6.0, "rank": 40, "decoded_token": choice[
        "prompt_logprobs"][3]["282"]["decoded_token"]}
    got = trl_format(choice, SEQ, 2, 100)
    assert [row[:4] for row in got["logprob_token_ids"]] == [[11, 3458, 12, 1000], [13, 14, 15, 1000], [2, 16, 17, 1000]]
    # ranked 1..100; at position 3 the own token (rank 40) is among them and the 100th alternative is cut
    assert [row[-1] for row in got["logprob_token_ids"]] == [1096, 1095, 1096]
    assert got["logprob_token_ids"][1][39:41] == [282, 1036]
    assert got["logprobs"][0][:3] == pytest.approx([-0.2, -1.7, -3.0])
    assert got["actual_logprobs"] == [[pytest.approx(-1.7)], [-6.0], [pytest.approx(-0.05)]]


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": [SEQ], "max_tokens": 1, "prompt_logprobs": 100}, "prompt_logprobs",
     "Requested prompt logprobs of 100, which is greater than max allowed: 20"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "Requested sample logprobs of 21"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
     "top_logprobs", "max allowed: 20"),
    ("/generate", {"prompt": {"prompt_token_ids": SEQ}, "prompt_logprobs": 50}, "prompt_logprobs", "max allowed: 20"),
    ("/inference/v1/generate", {"token_ids": SEQ, "sampling_params": {"logprobs": 25}}, "logprobs", "max allowed: 20"),
])
def test_past_the_limit_is_vllms_400_naming_it(path, body, param, message):
    http, fake = client(20)
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"] and "--server.max-logprobs" in error["message"]
    assert not fake.submits
