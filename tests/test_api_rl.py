"""POST /generate in vLLM's (Atropos), TRL's and the MLX RL Inference Server's shapes; /v1/policy,
/v1/pause, /v1/resume, /v1/abort — over a scripted Backend."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.api.backend import BackendError
from parallm.config import ServerConfig
from parallm.protocol import AdapterList, Output, TextSubmit, Usage, pack_floats, pack_ids
from test_api_fakes import FakeBackend

PROMPT_IDS = [1, 504, 3458, 282, 2]


def rl_script(tokens: int = 3, finish: str = "length"):
    """Sample j of a request emits ids 100*(j+1)+k with logprob -(k+1)/10 - j, its first token under
    policy version 3 and the rest under 4, and top-k alternatives (the sampled token first)."""

    def script(submit: TextSubmit) -> list[Output]:
        outs = []
        for j in range(submit.spec.n):
            for k in range(tokens):
                tid, lp = 100 * (j + 1) + k, -(k + 1) / 10 - j
                out = Output(rid=submit.rid, index=j, token_ids=pack_ids([tid]), text=f" w{j}{k}",
                             version=3 if k == 0 else 4, adapter=submit.spec.adapter)
                if submit.spec.params.logprobs:
                    out.logprobs = pack_floats([lp])
                    top = submit.spec.params.top_logprobs
                    if top:
                        out.top_ids = pack_ids([tid + t for t in range(top)])
                        out.top_logprobs = pack_floats([lp - t for t in range(top)])
                if k == 0 and submit.spec.detok is not None and submit.spec.detok.echo:
                    out.prompt_text = submit.prompt if submit.prompt is not None else "<ids>"
                    out.prompt_ids = submit.prompt_ids or pack_ids([7, 8, 9])
                if k == tokens - 1:
                    out.finish_reason = finish  # type: ignore[assignment]
                    out.usage = Usage(prompt_tokens=3, completion_tokens=tokens)
                outs.append(out)
        return outs

    return script


@dataclass
class RLFake(FakeBackend):
    """FakeBackend with a policy (or the error asking for it raises) and a batch size."""

    policy: Any = field(default_factory=lambda: {"lora-a": 3})
    last_batch_size: int = 6

    async def list_adapters(self) -> AdapterList:
        if isinstance(self.policy, BaseException):
            raise self.policy
        return AdapterList(qid="", policy=self.policy)


def make(backend: FakeBackend | None = None, **server) -> tuple[TestClient, Any]:
    backend = backend or RLFake(script=rl_script())
    return TestClient(build_app(backend, ServerConfig(**server)), raise_server_exceptions=False), backend


def error_of(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    return error


# --------------------------------------------------------------------------- vLLM / Atropos

def test_atropos_vllm_body_returns_token_logprob_dicts_and_finish_reasons():
    """Exactly what atroposlib's VLLMServer._tokens_and_logprobs_completion_wrapper posts and reads."""
    client, backend = make()
    body = {"prompt": {"prompt_token_ids": PROMPT_IDS}, "logprobs": 0, "n": 2, "max_tokens": 3,
            "temperature": 1.0, "top_p": 1.0, "stop": ["User:", "Human:"]}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    results = r.json()
    [submit] = backend.submits
    assert submit.prompt_ids == pack_ids(PROMPT_IDS) and submit.spec.n == 2 and submit.spec.params.max_tokens == 3
    assert submit.spec.params.logprobs and submit.spec.params.top_logprobs == 0 and submit.spec.detok.stop == ["User:", "Human:"]
    # Atropos: ids and logprobs from [{id: logprob}] per token, one list per sample
    ids = [[int(list(item[0].keys())[0]) for item in sample] for sample in results["logprobs"]]
    lps = [[list(item[0].values())[0] for item in sample] for sample in results["logprobs"]]
    assert ids == [[100, 101, 102], [200, 201, 202]] == results["token_ids"]
    assert lps == [pytest.approx([-0.1, -0.2, -0.3]), pytest.approx([-1.1, -1.2, -1.3])]
    assert results["finish_reasons"] == ["length", "length"]
    assert results["prompt_token_ids"] == PROMPT_IDS
    assert results["text"] == ["<ids> w00 w01 w02", "<ids> w10 w11 w12"]  # vLLM: prompt + completion
    assert results["versions"] == [[[0, 3], [1, 4]], [[0, 3], [1, 4]]]


def test_vllm_text_prompt_without_logprobs_and_top_k_alternatives():
    client, backend = make()
    r = client.post("/generate", json={"prompt": "The capital of France is", "max_tokens": 3})
    body = r.json()
    assert r.status_code == 200 and "logprobs" not in body
    assert body["text"] == ["The capital of France is w00 w01 w02"] and body["prompt_token_ids"] == [7, 8, 9]
    assert backend.submits[0].prompt == "The capital of France is" and not backend.submits[0].spec.params.logprobs
    r = client.post("/generate/", json={"prompt": {"prompt_token_ids": PROMPT_IDS}, "logprobs": 2, "max_tokens": 3})
    [sample] = r.json()["logprobs"]
    assert [list(item[0]) for item in sample] == [["100", "101"], ["101", "102"], ["102", "103"]]
    assert backend.submits[1].spec.params.top_logprobs == 2


def test_vllm_batched_token_prompts_and_vllm_defaults():
    client, backend = make()
    r = client.post("/generate", json={"prompt": [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 4, 5]}],
                                       "n": 2, "logprobs": 0, "top_k": -1})
    body = r.json()
    assert r.status_code == 200, r.text
    assert body["prompt_token_ids"] == [[1, 2], [3, 4, 5]] and len(body["token_ids"]) == 4
    assert [s.rid for s in backend.submits] == [backend.submits[0].rid[:-2] + "-0", backend.submits[0].rid[:-2] + "-1"]
    assert backend.submits[0].spec.params.max_tokens == 16 and backend.submits[0].spec.params.top_k == 0


# --------------------------------------------------------------------------- TRL

def test_trl_vllm_client_body():
    """Exactly what trl.extras.vllm_client.VLLMClient.generate posts to /generate/."""
    client, backend = make()
    body = {"prompts": ["Hello, AI!", "Tell me a joke"], "n": 2, "repetition_penalty": 1.1, "temperature": 0.9,
            "top_p": 0.95, "top_k": -1, "min_p": 0.05, "max_tokens": 3, "truncate_prompt_tokens": None,
            "guided_decoding_regex": None, "generation_kwargs": {"seed": 11}, "images": None}
    r = client.post("/generate/", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["prompt_ids"] == [[7, 8, 9], [7, 8, 9]]
    assert out["completion_ids"] == [[100, 101, 102], [200, 201, 202]] * 2  # prompt-major, n per prompt
    assert out["logprobs"][1] == pytest.approx([-1.1, -1.2, -1.3]) and len(out["logprobs"]) == 4
    p = backend.submits[0].spec.params
    assert (p.repetition_penalty, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == \
        (pytest.approx(1.1), pytest.approx(0.9), pytest.approx(0.95), 0, pytest.approx(0.05), 11)
    assert [s.prompt for s in backend.submits] == ["Hello, AI!", "Tell me a joke"]


def test_trl_token_prompts_and_truncation():
    client, backend = make()
    r = client.post("/generate/", json={"prompts": [[1, 2, 3, 4, 5]], "truncate_prompt_tokens": 2, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["prompt_ids"] == [[4, 5]]
    assert backend.submits[0].prompt_ids == pack_ids([4, 5])


# --------------------------------------------------------------------------- MLX RL Inference Server

def test_mlx_rl_server_example_body_is_echoed_with_metadata():
    """The request of the MLX RL Inference Server README, answered in its response shape."""
    client, backend = make()
    r = client.post("/generate", json={"prompt": "What is machine learning?", "temperature": 0.7, "top_p": 1.0,
                                       "max_tokens": 128, "logprobs": 1, "policy_version": 42, "step_id": 1000,
                                       "request_id": "unique-request-id"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["request_id"], out["policy_version"], out["step_id"]) == ("unique-request-id", 42, 1000)
    assert out["prompt_ids"] == [7, 8, 9] and out["completion_ids"] == [100, 101, 102]
    assert out["text"] == " w00 w01 w02" and out["finish_reason"] == "length"
    assert out["logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
    meta = out["metadata"]
    assert meta["batch_size"] == 6 and meta["current_policy_version"] == 4 and meta["latency_ms"] >= 0
    submit = backend.submits[0]
    assert submit.spec.metadata["policy_version"] == 42 and submit.spec.metadata["step_id"] == 1000
    assert submit.spec.metadata["client_request_id"] == "unique-request-id"


def test_mlx_rl_token_prompt_without_logprobs():
    client, backend = make()
    r = client.post("/generate", json={"prompt": PROMPT_IDS, "max_tokens": 3})
    out = r.json()
    assert out["logprobs"] is None and out["prompt_ids"] == PROMPT_IDS and out["request_id"] is None


def test_policy_requirements_pass_through_on_every_route():
    client, backend = make()
    for path, body in [("/generate", {"prompt": PROMPT_IDS}), ("/generate", {"prompts": ["x"]}),
                       ("/generate", {"prompt": {"prompt_token_ids": PROMPT_IDS}}),
                       ("/v1/completions", {"prompt": PROMPT_IDS}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
        r = client.post(path, json={**body, "max_tokens": 3, "min_policy_version": 3, "max_staleness": 1,
                                    "adapter": "lora-a"})
        assert r.status_code == 200, (path, r.text)
        s = backend.submits[-1]
        assert (s.spec.min_version, s.spec.max_staleness, s.spec.adapter) == (3, 1, "lora-a"), path


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("body,param", [
    ({"prompt": {"prompt_token_ids": [1, -2]}}, "prompt.prompt_token_ids[1]"),
    ({"prompt": {"prompt_token_ids": [1, "a"]}}, "prompt.prompt_token_ids[1]"),
    ({"prompt": {"prompt_token_ids": []}}, "prompt.prompt_token_ids"),
    ({"prompt": {"prompt_token_ids": [1], "prompt": "x"}}, "prompt"),
    ({"prompt": "x", "prompt_token_ids": [1]}, "prompt_token_ids"),
    ({"logprobs": 0}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": [{"prompt_token_ids": [1]}] * 9, "n": 128}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stream": True}, "stream"),
    ({"prompts": [[1, -5]]}, "prompts[0][1]"),
    ({"prompts": []}, "prompts"),
    ({"prompts": ["x"], "guided_decoding_regex": "(?=a)b"}, "guided_decoding_regex"),  # look-around: unsupported
    ({"prompts": ["x"], "images": ["a", "b"]}, "images"),  # one entry per prompt
    ({"prompts": ["x"], "images": [5]}, "images[0]"),
    ({"prompt": {"prompt_token_ids": [1], "multi_modal_data": {"audio": "x"}}}, "prompt.multi_modal_data"),
    ({"prompts": ["x"], "generation_kwargs": {"beam_width": 2}}, "generation_kwargs"),
    ({"prompt": [1, -1], "request_id": "a"}, "prompt[1]"),
    ({"prompt": "x", "policy_version": 1, "n": 2}, "n"),
    ({"prompt": "x", "step_id": 1, "min_tokens": 50, "max_tokens": 3}, "min_tokens"),
])
def test_bad_generate_bodies_are_400_openai_errors(body, param):
    client, backend = make()
    error = error_of(client.post("/generate", json=body), 400, param)
    assert error["type"] == "invalid_request_error"
    assert not backend.submits


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b"{not json", b'"text"'])
def test_generate_body_must_be_a_json_object(raw):
    client, _ = make()
    error_of(client.post("/generate", content=raw, headers={"content-type": "application/json"}), 400)


def test_engine_rejection_keeps_its_status():
    backend = RLFake(error_at_start=BackendError(400, "invalid_request_error", "token id 99999 is not in the "
                                                 "vocabulary", param="prompt"))
    client, _ = make(backend)
    error = error_of(client.post("/generate", json={"prompt": {"prompt_token_ids": [99999]}}), 400, "prompt")
    assert "vocabulary" in error["message"]


# --------------------------------------------------------------------------- policy, pause, resume, abort

def test_policy_versions():
    client, _ = make()
    r = client.get("/v1/policy")
    assert r.status_code == 200 and r.json() == {"object": "policy", "versions": {"": 0, "lora-a": 3},
                                                  "current_policy_version": 0, "default_adapter": ""}


def test_policy_unavailable_is_a_clear_error():
    client, backend = make()
    backend.policy = BackendError(503, "timeout", "the engine did not answer", retryable=True)
    error = error_of(client.get("/v1/policy"), 503)
    assert error["type"] == "server_error"


def test_pause_resume_abort_forward_protocol_messages():
    client, backend = make()
    assert client.post("/v1/pause").json() == {"paused": True, "mode": "keep"}
    assert client.post("/v1/pause", json={"mode": "abort"}).json()["mode"] == "abort"
    assert client.post("/v1/resume").json() == {"paused": False, "moved_to_latest": 0}
    assert client.post("/v1/abort", json={"request_ids": ["cmpl-1"]}).json() == {"aborted": ["cmpl-1"], "all": False}
    assert client.post("/v1/abort", json={"all": True}).status_code == 200
    assert backend.controls == [("pause", "keep"), ("pause", "abort"), ("resume", None), ("abort", (["cmpl-1"], False)),
                                ("abort", ([], True))]


def test_control_errors():
    client, _ = make()
    error_of(client.post("/v1/pause", json={"mode": "later"}), 400, "mode")
    error_of(client.post("/v1/abort", json={}), 400, "request_ids")


class AbortableFake(RLFake):
    """Emits one token per 10 ms until an Abort names the request, then ends it with reason 'abort'."""

    def generate(self, submit: TextSubmit):
        self.submits.append(submit)
        return self._run(submit)

    async def _run(self, submit: TextSubmit):
        for k in range(1000):
            aborted = any(kind == "abort" and (args[1] or submit.rid in args[0]) for kind, args in self.controls)
            out = Output(rid=submit.rid, token_ids=pack_ids([100 + k]), logprobs=pack_floats([-0.5]), text="w")
            if k == 0:
                out.prompt_ids = submit.prompt_ids or pack_ids([7])
            if aborted:
                out.token_ids, out.logprobs, out.text, out.finish_reason = b"", b"", "", "abort"
                yield out
                return
            yield out
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("how", ["request_id", "header", "all"])
def test_abort_over_http_returns_partial_tokens(how):
    backend = AbortableFake()
    with TestClient(build_app(backend, ServerConfig())) as client:
        result: dict[str, Any] = {}
        body: dict[str, Any] = {"prompt": PROMPT_IDS, "max_tokens": 2000, "logprobs": 1}
        headers = {}
        if how == "request_id":
            body["request_id"] = "rollout-7"
        elif how == "header":
            headers["X-Request-Id"] = "rollout-7"
        t = threading.Thread(target=lambda: result.update(r=client.post("/generate", json=body, headers=headers)))
        t.start()
        while not backend.submits:
            time.sleep(0.01)
        time.sleep(0.1)
        abort = {"all": True} if how == "all" else {"request_ids": ["rollout-7"]}
        assert client.post("/v1/abort", json=abort).status_code == 200
        t.join(10)
    out = result["r"].json()
    assert out["finish_reason"] == "abort" and 0 < len(out["completion_ids"]) < 2000
    assert len(out["logprobs"]) == len(out["completion_ids"])
    if how != "all":
        assert backend.controls[0] == ("abort", ([backend.submits[0].rid], False))


def test_spec_decode_metrics_route_reports_the_engine_stats_spec_or_mode_none():
    from parallm.protocol import EngineStats, SpecStats

    @dataclass
    class Speculating(FakeBackend):
        async def engine_stats(self) -> EngineStats:
            return EngineStats(spec=SpecStats(mode="ngram", verify_passes=3, rows_verified=4, proposed_tokens=10,
                                              accepted_tokens=6, emitted_tokens=10, acceptance_rate=0.6,
                                              mean_accepted_tokens=1.5, k_distribution={"2": 1, "4": 3}))

    client, _ = make(Speculating())
    body = client.get("/v1/spec_decode/metrics").json()
    assert body["object"] == "spec_decode_metrics" and body["mode"] == "ngram"
    assert body["acceptance_rate"] == 0.6 and body["k_distribution"] == {"2": 1, "4": 3}
    off, _ = make()
    body = off.get("/v1/spec_decode/metrics").json()
    assert body["mode"] == "none" and body["proposed_tokens"] == 0
