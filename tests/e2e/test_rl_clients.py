"""RL clients' protocols on the real server (bodies from tests/test_rl_clients.py's pinned sources):
TRL 1.16's /v1/completions with token-id strings, /inference/v1/generate (prime-rl / renderers),
SGLang's /generate, Atropos' prompt_logprobs, vLLM's LoRA API selecting an adapter by `model`.
Logprobs are checked against the engine's teacher-forced scoring, greedy outputs across shapes."""

from __future__ import annotations

import json

import pytest

from parallm.adapters import save_bytes
from parallm.protocol import SamplingParams

from .test_adapters import CONFIG, weights

pytestmark = pytest.mark.e2e

PROMPT = [1, 504, 3458, 282, 2]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-3


def test_trl_1_16_completions_and_tito_and_sglang_agree_greedy(http, raw):
    model = http.get("/v1/models").json()["data"][0]["id"]
    trl = http.post("/v1/completions", json={
        "model": model, "prompt": [PROMPT], "return_token_ids": True, "return_tokens_as_token_ids": True, "n": 1,
        "repetition_penalty": 1.0, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 8,
        "logprobs": 0, "ignore_eos": True})
    assert trl.status_code == 200, trl.text
    choice = trl.json()["choices"][0]
    ids = choice["token_ids"]
    assert choice["prompt_token_ids"] == PROMPT and len(ids) == 8
    assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == ids

    tito = http.post("/inference/v1/generate", json={
        "model": model, "token_ids": PROMPT, "cache_salt": "v0",
        "sampling_params": {"temperature": 0.0, "max_tokens": 8, "logprobs": 1, "ignore_eos": True,
                            "skip_special_tokens": False, "output_kind": 2}})
    assert tito.status_code == 200, tito.text
    c = tito.json()["choices"][0]
    assert c["token_ids"] == ids
    assert [e["token"] for e in c["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]

    sglang = http.post("/generate", json={"input_ids": PROMPT, "return_logprob": True,
                                          "sampling_params": {"temperature": 0.0, "max_new_tokens": 8,
                                                              "ignore_eos": True}})
    assert sglang.status_code == 200, sglang.text
    out = sglang.json()
    assert out["output_ids"] == ids and out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert [item[1] for item in out["meta_info"]["output_token_logprobs"]] == ids


def test_tito_sampled_logprobs_match_teacher_forcing(http, raw):
    r = http.post("/inference/v1/generate", json={
        "token_ids": PROMPT, "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 6, "logprobs": 0,
                                                 "ignore_eos": True, "seed": 3}})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lps = [e["logprob"] for e in c["logprobs"]["content"]]
    scored = raw.score(PROMPT + c["token_ids"], start=len(PROMPT))["logprobs"]
    assert close(lps, scored)


def test_atropos_get_logprobs_matches_scoring(http, raw):
    body = {"prompt": {"prompt_token_ids": PROMPT}, "prompt_logprobs": 2, "n": 1, "temperature": 0.0,
            "top_p": 1.0, "max_tokens": 1}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    own = [entry[str(tid)] for entry, tid in zip(plp[1:], PROMPT[1:])]
    assert all(len(entry) >= 2 for entry in plp[1:])
    scored = raw.score(PROMPT, start=1)["logprobs"]
    assert close(own, scored)


def test_trl_1_16_get_sequence_logprobs_ranks_and_top_k_match_scoring(http, raw):
    """TRL v1.16.0 get_sequence_logprobs (trl/generation/vllm_client.py:684-724) with top_logprobs=20, the
    server's default limit: its body, its read (entries sorted by `rank`); 100 needs --server.max-logprobs."""
    from test_rl_logprobs import trl_format

    model = http.get("/v1/models").json()["data"][0]["id"]
    seqs = [PROMPT + [7042, 314, 216], [1, 9690, 30, 2]]
    body = {"model": model, "prompt": seqs, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 20}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for choice, seq, start in zip(choices, seqs, (len(PROMPT), 2), strict=True):
        got = trl_format(choice, seq, start, 20)
        ref = raw.score(seq, start=start, top_logprobs=20)
        ids, lps = ref["top_ids"], ref["top_logprobs"]
        for j, pos in enumerate(range(start, len(seq))):
            best = sorted(zip(ids[20 * j:20 * j + 20], lps[20 * j:20 * j + 20]), key=lambda x: -x[1])
            assert got["logprob_token_ids"][j] == [t for t, _ in best]
            assert close(got["logprobs"][j], [v for _, v in best])
            assert close(got["actual_logprobs"][j], [ref["logprobs"][j]])
            own = choice["prompt_logprobs"][pos][str(seq[pos])]["rank"]
            assert own == 1 + sum(v > ref["logprobs"][j] + 1e-6 for _, v in best) or own > 20
    r = http.post("/v1/completions", json={**body, "prompt_logprobs": 100})    # TRL's default
    assert r.status_code == 400 and "max allowed: 20" in r.json()["error"]["message"], r.text


def test_vllm_lora_api_selects_the_adapter_by_model(http, raw, tmp_path):
    (tmp_path / "adapters.safetensors").write_bytes(save_bytes(weights(11)))
    (tmp_path / "adapter_config.json").write_text(json.dumps(CONFIG))
    name = "e2e-rl-clients-v1"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(tmp_path),
                                                 "load_inplace": False})
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    try:
        body = {"model": name, "token_ids": PROMPT,
                "sampling_params": {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 0}}
        r = http.post("/inference/v1/generate", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["versions"] and c["versions"][0][1] >= 1
        [ref] = raw.generate(PROMPT, _greedy(6), adapter=name)
        assert c["token_ids"] == ref.token_ids
        cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert cards[name]["parent"] == http.get("/v1/models").json()["data"][0]["id"]
        # TRL AsyncGRPO's rollout worker names the adapter as its model on /v1/completions
        r = http.post("/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
                                               "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref.token_ids, r.text
    finally:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    r = http.post("/inference/v1/generate", json={"model": name, "token_ids": PROMPT})
    assert r.status_code == 404, r.text


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_pause_keep_then_resume_and_nccl_routes_501(http):
    assert http.post("/pause?mode=keep&clear_cache=false").json() == {"status": "paused"}
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").json() == {"status": "resumed"}
    r = http.post("/init_weight_transfer_engine", json={"init_info": {}})
    assert r.status_code == 501
    assert http.get("/health_generate").status_code == 200     # SGLang's, as slime polls it


def test_reset_prefix_cache_forgets_cached_prompts(http):
    prompt = list(range(1000, 1040))   # 40 tokens: full prefix-cache blocks
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}

    def cached() -> int:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["dropped"] > 0
    assert cached() == 0
    assert http.get("/flush_cache").text.startswith("Cache flushed.")
