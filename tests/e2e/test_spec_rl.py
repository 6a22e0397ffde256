"""RL rollouts under speculative decoding (issue 36): a server with --spec.mode ngram answers /generate and
raw ZeroMQ rollouts (an adapter version loaded while serving) with the same tokens, per-token logprobs and
policy versions as the session's server, which does not speculate; its /v1/spec_decode/metrics and
Prometheus metrics show that it did. A server with --spec.mode draft (the default model as its own draft:
its base rows accept every proposal, adapter rows verify under their adapter; the default coupled
acceptance) gives greedy and seeded sampled rollouts the same tokens, logprobs and versions, the sampled
ones' logprobs also equal to the teacher-forced scores of the session's server."""

from __future__ import annotations

import httpx
import pytest

from parallm.client import Client
from parallm.protocol import SamplingParams

from .server import Server
from .test_adapters import CONFIG, weights

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# a prompt whose answer repeats it (a list to copy): prompt lookup proposes from it
PHRASE = [504, 3458, 282, 9690, 30]
PROMPT = [1] + PHRASE * 4 + PHRASE[:2]


@pytest.fixture(scope="module")
def spec_server():
    with Server("--spec.mode", "ngram", "--engine.max-num-seqs", "32") as srv:
        yield srv


@pytest.fixture(scope="module")
def draft_server():
    with Server("--spec.mode", "draft", "--spec.draft-model", "default", "--engine.max-num-seqs", "32") as srv:
        yield srv


def generate(url: str, temperature: float = 0.7) -> dict:
    body = {"prompt": {"prompt_token_ids": PROMPT}, "logprobs": 0, "n": 3, "max_tokens": 24,
            "temperature": temperature, "ignore_eos": True, "seed": 11}
    r = httpx.post(f"{url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def assert_same_generation(want: dict, got: dict) -> None:
    """Two /generate answers: the same token ids and versions, each token's logprob within 1e-3."""
    assert got["token_ids"] == want["token_ids"] and got["versions"] == want["versions"]
    for a, b in zip(want["logprobs"], got["logprobs"]):
        lp_a = [next(iter(item[0].values())) for item in a]
        lp_b = [next(iter(item[0].values())) for item in b]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-3


def test_generate_under_speculation_carries_the_same_tokens_logprobs_and_versions(server, spec_server):
    want, got = generate(server.url), generate(spec_server.url)
    assert_same_generation(want, got)


def test_generate_under_draft_speculation_carries_the_same_greedy_tokens_logprobs_and_versions(server,
                                                                                                  draft_server):
    want, got = generate(server.url, 0.0), generate(draft_server.url, 0.0)
    assert_same_generation(want, got)


def test_generate_under_draft_speculation_carries_the_same_sampled_tokens_logprobs_and_versions(server,
                                                                                                   draft_server):
    want, got = generate(server.url), generate(draft_server.url)  # temperature 0.7, seed 11, n = 3
    assert_same_generation(want, got)


def test_raw_rollouts_under_draft_speculation_carry_the_same_tokens_versions_and_logprobs(server, draft_server):
    want, got = rollouts(server.router, "draft-pol"), rollouts(draft_server.router, "draft-pol")
    with Client(server.router, timeout=300) as c:
        for i, (a, b) in enumerate(zip(want, got)):
            # rollouts(): temperature 0 (base, adapter; n = 2), then temperature 1, seed 3: coupled acceptance
            assert b.versions == a.versions and b.adapter == a.adapter and b.token_ids == a.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
            if i >= 4:  # temperature 1, no filter: the target's logprob of each emitted token is its teacher-forced score
                scored = c.score(PROMPT + b.token_ids, start=len(PROMPT), adapter=b.adapter,
                                 adapter_version=b.versions[0][1] if b.adapter else 0)["logprobs"]
                assert max(abs(x - y) for x, y in zip(scored, b.logprobs)) < 1e-3
    metrics = httpx.get(f"{draft_server.url}/v1/spec_decode/metrics", timeout=30).json()
    assert metrics["mode"] == "draft" and metrics["accepted_tokens"] > 0


def rollouts(router: str, name: str) -> list:
    with Client(router, timeout=300) as c:
        c.load_adapter(name, 1, weights(1), CONFIG)
        params = [SamplingParams(max_tokens=20, temperature=t, seed=3, logprobs=True, ignore_eos=True)
                  for t in (0.0, 1.0)]
        return [seq for p in params for adapter in ("", name) for seq in c.generate(PROMPT, p, n=2, adapter=adapter)]


def test_raw_rollouts_with_an_adapter_version_match_without_speculation(server, spec_server):
    want, got = rollouts(server.router, "spec-pol"), rollouts(spec_server.router, "spec-pol")
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids and b.versions == a.versions and b.adapter == a.adapter
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
    assert any(seq.adapter == "spec-pol" and seq.versions == [(0, 1)] for seq in got)
    metrics = httpx.get(f"{spec_server.url}/v1/spec_decode/metrics", timeout=30).json()
    assert metrics["mode"] == "ngram" and metrics["accepted_tokens"] > 0 and metrics["k_distribution"]
    text = httpx.get(f"{spec_server.url}/metrics", timeout=30).text
    assert "parallm_spec_accepted_tokens_total" in text and "parallm_spec_acceptance_rate" in text
    off = httpx.get(f"{server.url}/v1/spec_decode/metrics", timeout=30).json()
    assert off["mode"] == "none" and off["verify_passes"] == 0
