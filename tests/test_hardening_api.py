"""Hardening of the HTTP layer over a scripted backend: auth sources and exemptions, probes,
/metrics and the 503 a backend raises for a full queue."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.api.auth import BearerAuth
from parallm.api.backend import BackendError
from parallm.config import ServerConfig, build_config
from parallm.metrics import ServerMetrics
from parallm.protocol import DetokenizerStats, EngineStats
from test_api_fakes import MODEL, FakeBackend

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def make(backend: FakeBackend | None = None, metrics: ServerMetrics | None = None, **server):
    backend = backend or FakeBackend()
    return TestClient(build_app(backend, ServerConfig(**server), metrics)), backend


def test_api_keys_from_flag_env_and_file(tmp_path):
    assert build_config(environ={}, cli={"server": {"api_keys": ["a"]}}).server.api_keys == ["a"]
    env = {"PARALLM_SERVER__API_KEYS": "k1, k2"}
    assert build_config(environ=env).server.api_keys == ["k1", "k2"]
    keys = tmp_path / "keys"
    keys.write_text("filekey\n")
    client, _ = make(api_keys=["k1", "k2"], api_key_file=str(keys))
    for key in ("k1", "k2", "filekey"):
        assert client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_auth_protects_every_path_but_the_exempt_ones():
    client, _ = make(api_keys=["k"])
    for path in ("/livez", "/readyz", "/health", "/metrics", "/openapi.json"):
        assert client.get(path).status_code == 200, path
    r = client.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"
    assert client.get("/anything-else").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer kk"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    closed, _ = make(api_keys=["k"], auth_exempt_paths=[])
    assert closed.get("/metrics").status_code == 401


def test_every_key_is_compared_with_compare_digest(monkeypatch):
    calls = []
    import parallm.api.auth as auth

    def spy(a, b):
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    guard = BearerAuth(None, ["first", "second", "third"])
    assert guard.accepted(b"first")
    assert len(calls) == 3  # no early exit on the first match
    assert not guard.accepted(b"")


@pytest.mark.parametrize("status, ready", [("ok", 200), ("overloaded", 503), ("degraded", 503), ("paused", 503),
                                           ("stalled", 503), ("shutting_down", 503)])
def test_probes(status, ready):
    client, _ = make(FakeBackend(status=status))
    assert client.get("/livez").status_code == 200
    r = client.get("/readyz")
    assert r.status_code == ready and r.json()["health"] == status
    assert client.get("/health").status_code == (200 if status in ("ok", "overloaded") else 503)


def test_metrics_count_requests_by_route_and_status():
    metrics = ServerMetrics()
    client, _ = make(metrics=metrics, api_keys=["k"])
    client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k"})
    client.post("/v1/completions", json=BODY)
    client.get("/no/such/route/12345", headers={"Authorization": "Bearer k"})
    metrics.set_stats(EngineStats(waiting=3, running=2, kv_blocks_used=5, kv_blocks_free=7, prefix_queried_tokens=10,
                                  prefix_hit_tokens=4, preemptions=1, decode_batch_hist={1: 2, 3: 1}))
    metrics.set_stats(DetokenizerStats(rollouts_dropped=6))
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for line in ('parallm_http_requests_total{method="POST",route="/v1/completions",status="200"} 1.0',
                 'parallm_http_requests_total{method="POST",route="/v1/completions",status="401"} 1.0',
                 'parallm_http_requests_total{method="GET",route="other",status="404"} 1.0',
                 "parallm_num_requests_waiting 3.0", "parallm_num_requests_running 2.0",
                 "parallm_kv_blocks_used 5.0", "parallm_kv_blocks_free 7.0", "parallm_prefix_cache_hit_rate 0.4",
                 "parallm_preemptions_total 1.0", "parallm_rollouts_dropped_total 6.0",
                 'parallm_decode_batch_size_bucket{le="2"} 2.0', 'parallm_decode_batch_size_bucket{le="4"} 3.0',
                 "parallm_decode_batch_size_sum 5.0", "parallm_requests_in_flight 0.0"):
        assert line in text, line
    for name in ("parallm_time_to_first_token_seconds_bucket", "parallm_inter_token_latency_seconds_bucket",
                 "parallm_stage_restarts_total"):
        assert name in text


def test_route_labels_do_not_grow_with_paths():
    metrics = ServerMetrics()
    client, _ = make(metrics=metrics)
    client.get("/v1/models/some/model")
    client.get("/x" * 50)
    client.delete("/v1/adapters/a/b")
    client.post("/v1/pause")
    text = client.get("/metrics").text
    for label in ('route="/v1/models/{model}"', 'route="other"', 'route="/v1/adapters/{name}"', 'route="/v1/pause"'):
        assert label in text, label
    assert "/x/x" not in text and "some/model" not in text


def test_an_abandoned_stream_counts_as_499():
    import asyncio

    from parallm.api.http import DisconnectWatch, EventStream

    metrics = ServerMetrics()

    async def main() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        await queue.put({"type": "http.request", "body": b"", "more_body": False})

        async def events():
            yield b"data: 1\n\n"
            await queue.put({"type": "http.disconnect"})
            await asyncio.sleep(10)
            yield b"data: never\n\n"

        from parallm.api.metrics import CountRequests

        async def app(scope, receive, send):
            await receive()
            await EventStream(events(), DisconnectWatch(receive))(scope, receive, send)

        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": "/v1/completions", "method": "POST", "headers": []}
        await asyncio.wait_for(CountRequests(app, metrics)(scope, queue.get, send), 5)
        assert sent[0]["status"] == 200

    asyncio.run(main())
    assert 'parallm_http_requests_total{method="POST",route="other",status="499"} 1.0' in metrics.render().decode()


def test_queue_full_is_a_retryable_503():
    backend = FakeBackend(error_at_start=BackendError(503, "queue_full", "full", retryable=True))
    client, _ = make(backend)
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    r = client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 503


def test_token_ids_past_int32_are_a_400_not_a_500():
    # found by tests/e2e/test_fuzz.py: pack_ids overflowed on {"tokens": [2147483648]}
    client, backend = make()
    r = client.post("/v1/detokenize", json={"tokens": [2**31]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[0]"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2**31], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt")
    r = client.post("/v1/completions", json={**BODY, "logit_bias": {str(2**40): 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert not backend.submits


def test_one_request_cannot_ask_for_more_prefill_than_the_cap():
    """Issue 30: one request of 1,024 prompts x 2,000 ids timed out other clients' requests for over 2 minutes
    (CPU). server.max_request_prompt_tokens bounds prompts x tokens x n per request (a 400 naming prompt)."""
    client, backend = make()
    big = {"model": MODEL, "prompt": [[5] * 2000] * 1024, "max_tokens": 1}
    r = client.post("/v1/completions", json=big)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "2048000" in r.json()["error"]["message"] and "max_request_prompt_tokens" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 1_100_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # text: about 4 characters a token
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [[5] * 2000] * 50, "max_tokens": 1, "n": 2})
    assert r.status_code == 200, r.text
    r = client.post("/generate", json={"prompt_token_ids": [5] * 300_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert len(backend.submits) == 50  # one submit per prompt, n samples each
    client, backend = make(max_request_prompt_tokens=0)  # no cap
    assert client.post("/v1/completions", json=big).status_code == 200


def test_a_request_over_the_prompt_cap_is_refused_without_a_pass_over_its_ids():
    """Issue 30's canary beside 1,024 x 2,000 ids sent again and again: the ingress read every id in Python to
    check its range (0.12 s of its event loop each time, after a 0.07 s decode that had bounded them already:
    schemas.TokenId) before the prompt-token cap refused the request. Now no pass over the ids is made."""
    from parallm.api.errors import APIError
    from parallm.api.schemas import CompletionRequest
    from parallm.api.validate import Limits, check_completion

    class Counted(list):
        reads = 0

        def __iter__(self):
            Counted.reads += 1
            return super().__iter__()

    req = CompletionRequest(prompt=[Counted([5] * 2000) for _ in range(1024)], max_tokens=1)
    with pytest.raises(APIError, match="max_request_prompt_tokens"):
        check_completion(req, Limits(model_name=MODEL, max_request_prompt_tokens=262_144))
    assert Counted.reads == 0


def test_a_large_body_of_ids_past_the_cap_is_refused_before_its_ids_are_decoded():
    """Decoding the 6 MB of 1,024 x 2,000 ids took 0.07 s of the ingress's event loop before the cap refused
    them. A large body's ids are counted from its bytes first: the cap's 400 comes even for a body whose last
    id the decoder would have refused, which shows no id was decoded."""
    client, backend = make()
    ids = [[5] * 2000] * 1023 + [[5] * 1999 + [-1]]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "2048000" in r.json()["error"]["message"] and "max_request_prompt_tokens" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [[5] * 2000] * 300, "max_tokens": 1, "n": 2})
    assert "1200000" in r.json()["error"]["message"]  # n counts
    under = [[5] * 2000] * 130  # 1.3 MB, within the cap: decoded and served
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": under, "max_tokens": 1}).status_code == 200
