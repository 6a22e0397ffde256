"""The real client packages against parallm-launch (slow: they are installed by `make test-slow` from
the `rl-clients` extra, ~1 GB with atroposlib):

- atroposlib 0.4.0: `VLLMServer.tokens_and_logprobs_completion` and `get_logprobs` (vllm shape of
  /generate with prompt_logprobs), `SGLangServer.tokens_and_logprobs_completion` (SGLang /generate),
  `TrlVllmServer.completion` (TRL's /generate/);
- renderers 0.1.12: `renderers.client.generate`, the call verifiers' TrainClient (prime-rl's
  orchestrator) makes: /v1/models pre-flight, then /inference/v1/generate, checking every
  `token_id:<id>` and logprob itself;
- an Atropos loop: atroposlib's run-api, a minimal environment written here (it samples through
  parallm's /generate and scores by the share of even token ids), and `parallm-train
  --rl-training.rollout-source atropos` for a few steps: batches consumed, policy versions rising;
- skyrl 0.3.0: `RemoteInferenceClient` (SkyRL's vLLM-server client) generate, sample with prompt
  logprobs, tokenize / detokenize, pause / resume, its LoRA load and unload, get_world_size,
  reset_prefix_cache. It needs Python >= 3.12 (on 3.11 pydantic refuses skyrl/tinker/types.py's
  typing.TypedDict) and its dependencies pull torch (through peft) while the client needs none of
  them: the test makes a venv once (pytest's cache) from python3.12 or python3.13 on PATH with
  `pip install --no-deps skyrl==0.3.0` then `pip install aiohttp pydantic`, or takes PARALLM_SKYRL_PYTHON.

The packages may live in another interpreter: PARALLM_RL_CLIENTS_PYTHON names it (default: this one),
and ATROPOS_RUN_API the run-api executable (default: the one on PATH next to it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from parallm.config import ModelConfig
from parallm.models import resolve_model

from .server import Server, free_port
from .test_trainer import SMALL_TRAINER, training_status, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PYTHON = os.environ.get("PARALLM_RL_CLIENTS_PYTHON", sys.executable)
PROMPT = [1, 504, 3458, 282, 2]


def has(module: str) -> bool:
    probe = subprocess.run([PYTHON, "-c", f"import {module}"], capture_output=True)
    return probe.returncode == 0


def drive(script: str, server, *args: str) -> str:
    """Run a client script under PYTHON against the server; its asserts are the test."""
    tokenizer = str(resolve_model(ModelConfig()).path)
    proc = subprocess.run([PYTHON, "-c", textwrap.dedent(script), server.url, tokenizer, *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


ATROPOS = """
import asyncio, sys
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.vllm_server import VLLMServer
from atroposlib.envs.server_handling.sglang_server import SGLangServer
from atroposlib.envs.server_handling.trl_vllm_server import TrlVllmServer

url, tok = sys.argv[1], sys.argv[2]
def cfg(kind, base=url + "/v1"):
    return APIServerConfig(model_name=tok, base_url=base, server_type=kind, health_check=False, api_key="x")

async def main():
    v = VLLMServer(cfg("vllm"))
    prompt, out_ids, out_lps, finish = await v.tokens_and_logprobs_completion(
        input_ids=[1, 504, 3458, 282, 2], n=2, max_tokens=6, temperature=1.0, top_p=1.0)
    assert len(out_ids) == 2 and all(len(ids) == len(lps) > 0 for ids, lps in zip(out_ids, out_lps)), out_ids
    lp = await v.get_logprobs(input_ids=[1, 504, 3458, 282, 2], top_k=2)
    print("vllm", out_ids, finish, type(lp).__name__)
    s = SGLangServer(cfg("sglang"))
    prompt, out_ids, out_lps, finish = await s.tokens_and_logprobs_completion(
        input_ids=[1, 504, 3458], n=2, max_tokens=4, temperature=1.0)
    assert len(out_ids) == 2 and all(len(ids) == len(lps) > 0 for ids, lps in zip(out_ids, out_lps)), out_ids
    print("sglang", out_ids, finish)
    t = TrlVllmServer(cfg("trl", url))
    out = await t.completion(prompt="Hello", n=2, max_tokens=4)
    assert len(out.choices) == 2 and all(c.text for c in out.choices)
    print("trl", [c.text for c in out.choices])

asyncio.run(main())
"""

RENDERERS = """
import asyncio, sys
from openai import AsyncOpenAI
from renderers import create_renderer
from renderers.base import load_tokenizer
from renderers.configs import DefaultRendererConfig
from renderers.client import generate

url, tok = sys.argv[1], sys.argv[2]

async def main():
    renderer = create_renderer(load_tokenizer(tok), DefaultRendererConfig())
    client = AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    model = (await client.models.list()).data[0].id
    out = await generate(client=client, renderer=renderer, messages=[{"role": "user", "content": "Hi"}], model=model,
                         sampling_params={"temperature": 1.0, "top_p": 1.0, "max_tokens": 6, "logprobs": True},
                         cache_salt="v0", extra_headers={"X-Session-ID": "s1"})
    assert out["completion_ids"] and len(out["completion_logprobs"]) == len(out["completion_ids"]), out
    print("renderers", out["completion_ids"], out["finish_reason"])

asyncio.run(main())
"""


SKYRL = """
import asyncio, json, sys, urllib.request
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient

url, tok, adapter_dir = sys.argv[1], sys.argv[2], sys.argv[3]
model = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]
PARAMS = {"max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 0,
          "min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True, "stop": None}

async def main():
    sky = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model)
    batch = {"prompt_token_ids": [[1, 504, 3458, 282, 2], [1, 9690, 30]], "sampling_params": PARAMS,
             "session_ids": ["s1", "s2"], "cache_salt": "v0"}
    out = await sky.generate(batch)
    assert all(len(ids) == len(lps) == 6 for ids, lps in zip(out["response_ids"], out["response_logprobs"])), out
    assert out["stop_reasons"] == ["length", "length"] and all(out["responses"]), out
    ids = (await sky.tokenize(["Hello there"]))[0]
    text = (await sky.detokenize([ids]))[0]
    sample = await sky.sample({"json": {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 504, 3458, 282]}]},
                                        "num_samples": 2, "sampling_params": {"temperature": 1.0, "max_tokens": 4,
                                                                              "seed": 7},
                                        "prompt_logprobs": True, "topk_prompt_logprobs": 2}})
    assert len(sample["sequences"]) == 2 and all(len(s["tokens"]) == len(s["logprobs"]) == 4
                                                 for s in sample["sequences"]), sample
    assert sample["prompt_logprobs"][0] is None and len(sample["topk_prompt_logprobs"][1]) == 2, sample
    await sky.pause()
    await sky.resume()
    await sky.load_lora_adapter("sky-lora", adapter_dir)
    lora = await sky.generate(batch, model="sky-lora")
    await sky.unload_lora_adapter("sky-lora")
    world = await sky.get_world_size()
    await sky.reset_prefix_cache()
    await sky.teardown()
    print(json.dumps({"base": out["response_ids"], "lora": lora["response_ids"], "tokenized": ids, "text": text,
                      "prompt_logprobs": sample["prompt_logprobs"], "world": list(world)}))

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    with Server("--engine.max-num-seqs", "16", "--adapters.allowed-dirs", str(tmp_path_factory.getbasetemp())) as srv:
        yield srv


def test_atroposlib_server_types_against_parallm(http_server):
    if not has("atroposlib"):
        pytest.skip(f"atroposlib is not installed for {PYTHON} (pip install -e '.[rl-clients]'; make test-slow does)")
    out = drive(ATROPOS, http_server)
    assert "vllm" in out and "sglang" in out and "trl" in out


def test_renderers_generate_as_verifiers_calls_it(http_server):
    if not has("renderers"):
        pytest.skip(f"renderers is not installed for {PYTHON} (pip install -e '.[rl-clients]'; make test-slow does)")
    assert "renderers" in drive(RENDERERS, http_server)


def skyrl_python(cache) -> str:
    """A Python >= 3.12 where skyrl 0.3.0's client imports (see the module docstring), or a skip saying why."""
    given = os.environ.get("PARALLM_SKYRL_PYTHON")
    if given:
        return given
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = [shutil.which(name) for name in ("python3.13", "python3.12")] + \
        sorted(str(p) for p in pyenv.glob("3.1[2-9]*/bin/python3"))   # installed, if not enabled
    base = next((p for p in found if p and subprocess.run([p, "-c", "import venv"], capture_output=True).returncode == 0),
                None)   # a pyenv shim of a version not enabled is on PATH but fails
    if base is None:
        pytest.skip("SkyRL's client needs Python >= 3.12: none on PATH (python3.12, python3.13) or under pyenv "
                    "(or set PARALLM_SKYRL_PYTHON)")
    venv = cache.mkdir("skyrl-0.3.0-venv")
    python = str(venv / "bin" / "python")
    probe = [python, "-c", "import skyrl.backends.skyrl_train.inference_servers.remote_inference_client"]
    if not Path(python).exists() or subprocess.run(probe, capture_output=True).returncode:
        for step in ([base, "-m", "venv", "--clear", str(venv)],
                     [python, "-m", "pip", "install", "-q", "--no-deps", "skyrl==0.3.0"],
                     [python, "-m", "pip", "install", "-q", "aiohttp", "pydantic"]):
            made = subprocess.run(step, capture_output=True, text=True, timeout=600)
            if made.returncode:
                pytest.skip(f"could not make SkyRL's venv ({' '.join(step[:4])}...): {made.stderr[-500:]}")
        made = subprocess.run(probe, capture_output=True, text=True)
        assert made.returncode == 0, f"skyrl's client does not import in {venv}: {made.stderr[-2000:]}"
    return python


def test_skyrl_remote_inference_client_against_parallm(http_server, request, tmp_path):
    from parallm.adapters import save_bytes
    from parallm.client import Client
    from parallm.protocol import SamplingParams

    from .test_adapters import CONFIG, weights

    python = skyrl_python(request.config.cache)
    (tmp_path / "adapters.safetensors").write_bytes(save_bytes(weights(5)))
    (tmp_path / "adapter_config.json").write_text(json.dumps(CONFIG))
    tokenizer = str(resolve_model(ModelConfig()).path)
    proc = subprocess.run([python, "-c", textwrap.dedent(SKYRL), http_server.url, tokenizer, str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with Client(http_server.router, timeout=300) as raw:
        want = [r.token_ids for [r] in raw.generate_group([[1, 504, 3458, 282, 2], [1, 9690, 30]], greedy)]
        assert got["base"] == want and got["lora"] != want        # the adapter, by its name as the model
        assert got["tokenized"] == raw.tokenize("Hello there") and got["text"] == "Hello there"
        scored = raw.score([1, 504, 3458, 282], start=1)["logprobs"]
    assert max(abs(a - b) for a, b in zip(got["prompt_logprobs"][1:], scored)) < 1e-3
    assert got["world"] == [1, 1]


def run_api_command() -> list[str]:
    given = os.environ.get("ATROPOS_RUN_API") or shutil.which("run-api", path=str(Path(PYTHON).parent))
    if not given:
        pytest.skip(f"atroposlib's run-api is not installed next to {PYTHON} (pip install -e '.[rl-clients]')")
    return [given]


def minimal_environment(api: str, server_url: str, stop: threading.Event, posted: list[int]) -> None:
    try:
        _environment(api, server_url, stop, posted)
    except httpx.HTTPError:
        if not stop.is_set():   # the servers going away at the end of the test is expected
            raise


def _environment(api: str, server_url: str, stop: threading.Event, posted: list[int]) -> None:
    """An Atropos environment in a few lines: register, sample groups of 4 through parallm's /generate,
    score each completion by its share of even token ids, post the scored group."""
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            reply = http.post(f"{api}/register-env", json={"max_token_length": 512, "desired_name": "even-tokens",
                                                           "weight": 1.0, "group_size": 4}).json()
            if reply.get("status") == "success":
                break
            time.sleep(0.5)
        while not stop.is_set():
            r = http.post(f"{server_url}/generate", json={"prompt": {"prompt_token_ids": PROMPT}, "n": 4,
                                                          "max_tokens": 8, "logprobs": 0, "temperature": 1.0})
            if r.status_code != 200:   # a busy (503) or stopping server: try again
                time.sleep(0.5)
                continue
            out = r.json()
            tokens, masks, scores, lps = [], [], [], []
            for ids, sample in zip(out["token_ids"], out["logprobs"]):
                tokens.append(PROMPT + ids)
                masks.append([-100] * len(PROMPT) + ids)
                scores.append(sum(1 for t in ids if t % 2 == 0) / max(1, len(ids)))
                lps.append([1.0] * len(PROMPT) + [next(iter(item[0].values())) for item in sample])
            http.post(f"{api}/scored_data", json={"tokens": tokens, "masks": masks, "scores": scores,
                                                  "inference_logprobs": lps})
            posted.append(len(tokens))
            while not stop.is_set() and http.get(f"{api}/status").json().get("queue_size", 0) > 2:
                time.sleep(0.2)   # keep the queue short: the trainer trains on fresh groups


def test_atropos_loop_trains_parallm_train_on_scored_batches(tmp_path):
    command = run_api_command()
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    run_api = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT, start_new_session=True)
    stop, posted = threading.Event(), []
    try:
        with Server(*SMALL_TRAINER, "--trainer.checkpointing.dir", str(tmp_path / "ckpt"),
                    "--trainer.rl-training.rollout-source", "atropos",
                    "--trainer.rl-training.atropos-url", api) as srv:
            env = threading.Thread(target=minimal_environment, args=(api, srv.url, stop, posted), daemon=True)
            env.start()

            def at_step(step: int):
                trainers = training_status(srv.url)["trainers"]
                return trainers[0] if trainers and trainers[0]["step"] >= step else None

            first = wait_for(lambda: at_step(1), 300, "a first training step on an Atropos batch", srv)
            third = wait_for(lambda: at_step(3), 300, "three training steps on Atropos batches", srv)
            assert third["version"] > first["version"] >= 2
            status = httpx.get(f"{api}/status", timeout=10).json()
            assert status["current_step"] >= 3               # batches the run-api handed out
            policy = httpx.get(f"{srv.url}/v1/policy", timeout=10).json()["versions"]
            assert policy["policy"] >= third["version"] - 1   # the published versions reached the engine
    finally:
        stop.set()
        run_api.terminate()
        run_api.wait(timeout=30)
    assert posted
