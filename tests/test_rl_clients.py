"""Contract tests: the bodies today's RL clients send, copied from their pinned sources, and the fields
their code reads from the answers (research: /work/notes/issue21-clients.md; docs/rl.md's table).

Pinned sources (tag: file:line of what each test copies):
- TRL v1.16.0: trl/generation/vllm_client.py:431-466 (generate -> /v1/completions with
  return_token_ids + return_tokens_as_token_ids; parse_logprobs :95-136 strips "token_id:"),
  :579-624 (chat), :303-324 (/server_info, /get_world_size), :726-884 (NCCL weight transfer);
  trl/experimental/async_grpo/vllm_client.py:99-143 (pause?mode=keep, /v1/load_lora_adapter, resume).
- TRL v0.29.1: trl/generation/vllm_client.py:266-302 (/generate/ with `logprobs`; reads prompt_ids,
  completion_ids, logprobs[seq][tok][k], logprob_token_ids); TRL v0.24.0 (no `logprobs` key, flat floats).
- prime-rl v0.8.0: src/prime_rl/utils/client.py:373-508 (pause?mode=keep&clear_cache=false, resume,
  /load_lora_adapter, /v1/unload_lora_adapter); renderers 0.1.12 renderers/client.py:137-424
  (/inference/v1/generate, content[i].token == "token_id:<id>").
- SGLang 0.5.23 / slime v0.3.1 / atroposlib 0.4.0 sglang_server.py:152-242: /generate with input_ids,
  sampling_params.max_new_tokens, return_logprob; reads meta_info.output_token_logprobs[i][0|1] and
  meta_info.finish_reason["type"].
- atroposlib 0.4.0 vllm_server.py:263-356 (get_logprobs: prompt_logprobs on /generate).
These run against the HTTP layer with a scripted backend; tests/e2e/test_rl_clients.py runs the same
bodies against a real server, and the slow suite drives the real atroposlib and renderers packages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.api.backend import BackendError
from parallm.config import ServerConfig
from parallm.protocol import AdapterInfo, AdapterList, AdapterLoaded, AdapterPublish, AdapterUnloaded, unpack_ids
from test_api_fakes import MODEL, FakeBackend


@dataclass
class LoraBackend(FakeBackend):
    """A scripted backend that records adapter loads (each load of a name adds a version)."""

    loads: list[AdapterPublish] = field(default_factory=list)
    unloads: list[str] = field(default_factory=list)

    async def load_adapter(self, request: AdapterPublish) -> AdapterLoaded:
        self.loads.append(request)
        version = self.policy.get(request.name, 0) + 1
        self.policy[request.name] = version
        return AdapterLoaded(qid="", name=request.name, version=version)

    async def unload_adapter(self, name: str) -> AdapterUnloaded:
        if name not in self.policy:
            raise BackendError(404, "adapter_not_found", f"adapter {name!r} is not loaded")
        self.unloads.append(name)
        del self.policy[name]
        return AdapterUnloaded(qid="", name=name, versions_removed=1)

    async def list_adapters(self) -> AdapterList:
        return AdapterList(qid="", policy=dict(self.policy),
                           adapters=[AdapterInfo(name=n, latest=v, bytes=0) for n, v in self.policy.items()])


def make(**kw) -> tuple[TestClient, LoraBackend]:
    fake = LoraBackend(**kw)
    return TestClient(build_app(fake, ServerConfig()), raise_server_exceptions=False), fake


def _strip(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


# --------------------------------------------------------------------------- TRL 1.16 (plain vLLM)

def test_trl_1_16_generate_completions_with_token_id_strings():
    client, _ = make()
    body = {"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], "return_token_ids": True,
            "return_tokens_as_token_ids": True, "n": 2, "repetition_penalty": 1.0, "temperature": 1.0,
            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 16, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    for choice in choices[::2]:          # prompt-major: one per prompt
        assert isinstance(choice["prompt_token_ids"], list)
    for choice in choices:               # parse_logprobs: every token and top key is "token_id:<id>"
        lp = choice["logprobs"]
        ids = [_strip(t) for t in lp["tokens"]]
        assert ids == choice["token_ids"]
        for top in lp["top_logprobs"]:
            assert all(_strip(k) >= 0 for k in top)
        assert all(isinstance(v, float) for v in lp["token_logprobs"])


def test_trl_1_16_chat_with_token_id_strings():
    client, _ = make()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 1, "temperature": 1.0,
            "max_tokens": 16, "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out["prompt_token_ids"], list)
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert [_strip(c["token"]) for c in content] == choice["token_ids"]
    assert all(_strip(t["token"]) >= 0 for c in content for t in c["top_logprobs"])


def test_trl_1_16_server_info_world_size_and_nccl_routes():
    client, _ = make()
    info = client.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["weight_transfer_config"] is None      # TRL GRPO: "has no weight-transfer engine"
    assert info["lora_config"]["max_loras"] >= 2 and info["parallel_config"]["data_parallel_size"] == 1
    assert client.get("/get_world_size").json() == {"world_size": 1}
    for path in ("/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
                 "/init_communicator/", "/update_named_param/"):
        r = client.post(path, json={"init_info": {"master_address": "h", "master_port": 1}})
        assert r.status_code == 501, (path, r.text)
        assert "load_lora_adapter" in r.json()["error"]["message"]


def test_trl_async_grpo_lora_sync():
    client, backend = make()
    assert client.post("/pause?mode=keep").json() == {"status": "paused"}
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "pol-v1", "lora_path": "/ckpt/pol-v1",
                                                   "load_inplace": False})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'pol-v1' added successfully."
    assert client.post("/resume").json() == {"status": "resumed"}
    assert backend.controls == [("pause", "keep"), ("resume", None)]
    assert (backend.loads[0].name, backend.loads[0].path) == ("pol-v1", "/ckpt/pol-v1")
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "pol-v1", "lora_path": "/x"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "pol-v1"}).status_code == 200
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "pol-v1"}).status_code == 404


def test_pause_defaults_to_abort_like_vllm_and_refuses_wait():
    client, backend = make()
    assert client.post("/pause").status_code == 200
    assert backend.controls == [("pause", "abort")]
    r = client.post("/pause?mode=wait")
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"


# --------------------------------------------------------------------------- TRL 0.2x - 1.10 (trl vllm-serve)

def test_trl_0_24_generate_answer_is_flat():
    client, _ = make()
    body = {"prompts": [[1, 2]], "n": 2, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0,
            "top_k": -1, "min_p": 0.0, "max_tokens": 16, "truncate_prompt_tokens": None,
            "guided_decoding_regex": None, "generation_kwargs": {}}
    out = client.post("/generate/", json=body).json()
    assert set(out) >= {"prompt_ids", "completion_ids", "logprobs"} and "logprob_token_ids" not in out
    assert all(isinstance(v, float) for seq in out["logprobs"] for v in seq)


def test_trl_0_29_generate_answer_is_nested_with_token_ids():
    client, _ = make()
    body = {"prompts": [[1, 2]], "images": None, "n": 2, "repetition_penalty": 1.0, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 16, "logprobs": 1,
            "truncate_prompt_tokens": None, "structured_outputs_regex": None, "generation_kwargs": {}}
    out = client.post("/generate/", json=body).json()
    assert len(out["completion_ids"]) == 2
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        assert len(lps) == len(ids) == len(lp_ids)
        for row, row_ids, tid in zip(lps, lp_ids, ids):
            assert row == sorted(row, reverse=True) and tid in row_ids and len(row) == len(row_ids)
    # TRL 1.0-1.10: logprobs null asks for none
    none = client.post("/generate/", json={**body, "logprobs": None}).json()
    assert none["logprobs"] is None and none["logprob_token_ids"] is None


# --------------------------------------------------------------------------- prime-rl / verifiers / SkyRL

def test_inference_v1_generate_as_renderers_reads_it():
    client, backend = make()
    body = {"model": MODEL, "token_ids": [1, 9690, 198],
            "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 3, "logprobs": 1,
                                "stop_token_ids": [2], "skip_special_tokens": False, "output_kind": 2},
            "cache_salt": "v3"}
    r = client.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "s1"})
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    for entry, tid in zip(content, choice["token_ids"]):
        assert entry["token"] == f"token_id:{tid}"
        assert isinstance(entry["logprob"], float) and entry["logprob"] != -9999.0
    assert out["usage"]["completion_tokens"] == len(choice["token_ids"]) and out["model"] == MODEL
    assert backend.submits[0].spec.params.stop_token_ids == [2]


def test_inference_v1_generate_selects_an_adapter_by_model_and_refuses_unknown_params():
    client, backend = make()
    body = {"model": "pol-v3", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
    assert client.post("/inference/v1/generate", json=body).status_code == 200
    assert backend.submits[-1].spec.adapter == "pol-v3"
    r = client.post("/inference/v1/generate", json={**body, "sampling_params": {"bad_words": ["x"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.bad_words"
    r = client.post("/inference/v1/generate", json={**body, "features": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "features"


def test_prime_rl_admin_flow():
    client, backend = make()
    assert client.post("/pause?mode=keep&clear_cache=false").status_code == 200
    r = client.post("/load_lora_adapter", json={"lora_name": "r", "lora_path": "/ckpt/step1"})
    assert r.json() == {"status": "ok"}
    r = client.post("/load_lora_adapter", json={"lora_name": "r", "lora_path": "/ckpt/step2"})  # reloaded in place
    assert r.status_code == 200 and backend.policy["r"] == 2
    assert client.post("/resume").status_code == 200
    assert client.post("/skyrl/v1/load_lora_adapter", json={"lora_name": "s", "lora_path": "/p"}).status_code == 200


def test_root_tokenize_and_detokenize():
    client, _ = make()
    assert client.post("/tokenize", json={"model": MODEL, "prompt": "ab"}).json()["tokens"] == [97, 98]
    assert client.post("/detokenize", json={"model": MODEL, "tokens": [97, 98]}).json() == {"prompt": "ab"}


# --------------------------------------------------------------------------- SGLang

def test_sglang_generate_single():
    client, backend = make()
    body = {"input_ids": [1, 504, 3458], "sampling_params": {"temperature": 1.0, "max_new_tokens": 3},
            "return_logprob": True, "return_text_in_logprobs": False}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["finish_reason"]["length"] == len(out["output_ids"])
    assert [item[1] for item in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(isinstance(item[0], float) and item[2] is None for item in meta["output_token_logprobs"])
    assert backend.submits[0].spec.params.max_tokens == 3


def test_sglang_batch_and_n_answer_a_list():
    client, _ = make()
    out = client.post("/generate", json={"input_ids": [[1, 2], [3, 4]],
                                         "sampling_params": {"n": 2, "max_new_tokens": 2}}).json()
    assert isinstance(out, list) and len(out) == 4
    assert all("output_token_logprobs" not in o["meta_info"] for o in out)
    r = client.post("/generate", json={"input_ids": [1], "sampling_params": {"regex": "a+"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.regex"


def test_sglang_stop_finish_reason_names_the_match():
    client, _ = make(script=_stop_script)
    meta = client.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 4}}).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}


def _stop_script(submit):
    from test_api_fakes import words_script
    outs = words_script(["a", "b"], finish="stop")(submit)
    outs[-1].stop_reason = 2
    return outs


# --------------------------------------------------------------------------- Atropos

def test_atropos_get_logprobs_prompt_logprobs_on_generate():
    client, backend = make()
    body = {"prompt": {"prompt_token_ids": [1, 504, 3458, 282]}, "prompt_logprobs": 2, "n": 1,
            "temperature": 0.0, "top_p": 1.0, "max_tokens": 1}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None
    assert all(isinstance(k, str) and isinstance(v, float) for entry in plp[1:] for k, v in entry.items())
    assert backend.submits[0].spec.params.prompt_logprobs == 2


# --------------------------------------------------------------------------- vLLM's LoRA naming on /v1

def test_model_names_a_loaded_adapter_on_the_openai_routes_and_v1_models_lists_it():
    client, backend = make()
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "pol-v2", "lora_path": "/ckpt/pol-v2"}).status_code == 200
    cards = client.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "pol-v2"] and cards[1]["parent"] == MODEL
    # TRL AsyncGRPO's rollout worker: model "<lora>-v<N>"
    r = client.post("/v1/completions", json={"model": "pol-v2", "prompt": [1, 2], "max_tokens": 2,
                                             "return_token_ids": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    assert backend.submits[-1].spec.adapter == "pol-v2"
    r = client.post("/v1/chat/completions", json={"model": "pol-v2", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200 and backend.submits[-1].spec.adapter == "pol-v2"
    r = client.post("/v1/completions", json={"model": "never-loaded", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# --------------------------------------------------------------------------- full-weight updates over HTTP

def test_full_weight_update_routes():
    client, backend = make()
    assert client.post("/update_weights", json={"weight_dir": "/ckpt/step_3"}).json() == {"status": "ok"}  # prime-rl
    r = client.post("/update_weights_from_disk", json={"model_path": "/ckpt/step_4", "weight_version": "9"})  # SGLang
    assert r.status_code == 200 and r.json()["success"] is True and backend.policy[""] == 9
    r = client.post("/update_weights_from_disk", json={"model_path": "/missing"})
    assert r.status_code == 400 and r.json()["success"] is False and "does not exist" in r.json()["message"]
    r = client.post("/v1/weights", json={"path": "/ckpt/step_5"})
    assert r.json()["version"] == 10
    r = client.post("/update_weights", json={"update_info": {"names": ["w"]}})    # TRL's NCCL update
    assert r.status_code == 501
    assert [c for c in backend.controls if c[0] == "update_weights"] == [
        ("update_weights", "/ckpt/step_3"), ("update_weights", "/ckpt/step_4"), ("update_weights", "/missing"),
        ("update_weights", "/ckpt/step_5")]


# --------------------------------------------------------------------------- legacy token routes, SGLang control

def test_chat_completions_tokens_uses_the_given_prompt_ids():
    """verifiers 0.3.1 verifiers/legacy/clients/openai_chat_completions_token_client.py:131-146: the chat
    body plus `tokens` (prime-rl v0.5.0 serving_chat_with_tokens.py:46-48 reads them as the prompt)."""
    client, backend = make()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ignored"}], "tokens": [1, 9690, 30],
            "max_tokens": 2, "logprobs": True, "return_token_ids": True}
    r = client.post("/v1/chat/completions/tokens", json=body)
    assert r.status_code == 200, r.text
    submit = backend.submits[-1]
    assert submit.messages is None and unpack_ids(submit.prompt_ids) == [1, 9690, 30]
    assert r.json()["choices"][0]["logprobs"]["content"]
    assert client.post("/v1/chat/completions/tokens", json={**body, "tokens": []}).status_code == 400


def test_sglang_and_vllm_pause_and_abort_routes():
    client, backend = make()
    assert client.post("/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"
    assert client.post("/continue_generation", json={}).json()["status"] == "ok"
    assert client.post("/abort_request", json={"abort_all": True}).json()["all"] is True
    assert client.post("/abort_requests", json={"request_ids": ["a", "b"]}).json() == \
        {"status": "aborted", "aborted": 2, "all": False}
    assert backend.controls == [("pause", "keep"), ("resume", None), ("abort", ([], True)), ("abort", (["a", "b"], False))]


def test_reset_prefix_cache_and_flush_cache():
    """TRL 1.16 vllm_client.py:875-884 (200 + a JSON body), SkyRL 0.3.0 (JSON body {"reset_running_requests":
    false}), slime v0.3.1 sglang_engine.py:287-306 (GET /flush_cache until 200)."""
    client, backend = make()
    r = client.post("/reset_prefix_cache", json={"reset_running_requests": False})
    assert r.status_code == 200 and r.json()["success"] is True
    r = client.get("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    assert backend.controls == [("reset_prefix_cache", None)] * 2


def test_sglang_health_generate_and_model_info():
    """slime v0.3.1 sglang_engine.py:60-100 polls GET /health_generate until 200; SGLang 0.5.23
    http_server.py:802-850 /model_info."""
    client, backend = make()
    assert client.get("/health_generate").status_code == 200
    assert backend.submits[-1].spec.params.max_tokens == 1
    info = client.get("/model_info").json()
    assert info["model_path"] == MODEL and info["is_generation"] is True and info["weight_version"] == "0"
    down, _ = make(error_at_start=BackendError(503, "stage_down", "the engine is down", retryable=True))
    assert down.get("/health_generate").status_code == 503
