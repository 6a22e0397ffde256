"""Shared helpers for the engine tests: tiny random-weight mlx-lm models and reference decoding."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma, gemma2, gemma3_text, llama, phi3, qwen2, qwen3

from parallm.config import AdaptersConfig, Config, EngineConfig, KVConfig, SpecConfig
from parallm.engine import Engine, EngineModel, Request, ScoreResult
from parallm.engine import make_request as req  # noqa: F401 - the tests' short name for it
from parallm.protocol import SamplingParams

TINY_VOCAB = 101

COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
              rms_norm_eps=1e-5, vocab_size=TINY_VOCAB, num_key_value_heads=2)

TINY_MODELS = {
    "llama": lambda: llama.Model(llama.ModelArgs(model_type="llama", **COMMON)),
    "llama3-rope": lambda: llama.Model(llama.ModelArgs(
        model_type="llama", max_position_embeddings=64, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, **COMMON)),
    "llama-sliding": lambda: llama.Model(llama.ModelArgs(
        model_type="llama", layer_types=["sliding_attention", "full_attention"], sliding_window=6, **COMMON)),
    "mistral": lambda: llama.Model(llama.ModelArgs(model_type="mistral", **COMMON)),
    "qwen2": lambda: qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **COMMON)),
    "qwen3": lambda: qwen3.Model(qwen3.ModelArgs(model_type="qwen3", max_position_embeddings=512, head_dim=16,
                                                 tie_word_embeddings=True, rope_theta=10000.0, **COMMON)),
    "gemma": lambda: gemma.Model(gemma.ModelArgs(model_type="gemma", head_dim=16, **COMMON)),
    "gemma2": lambda: gemma2.Model(gemma2.ModelArgs(model_type="gemma2", head_dim=16, query_pre_attn_scalar=16.0,
                                                    **COMMON)),
    "gemma3_text": lambda: gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", head_dim=16, sliding_window=5, sliding_window_pattern=2,
        query_pre_attn_scalar=16.0, **{**COMMON, "num_hidden_layers": 4})),
    "phi3": lambda: phi3.Model(phi3.ModelArgs(model_type="phi3", **COMMON)),
}


def tiny_model(name: str, seed: int = 0) -> nn.Module:
    mx.random.seed(seed)
    model = TINY_MODELS[name]()
    # spread the random weights so logits are far from ties (greedy parity is then exact)
    model.update(nn.utils.tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def wide_heads_model(name: str = "llama", seed: int = 0, head_dim: int = 32) -> nn.Module:
    """parallm.models.tiny's model of module `name` with wider attention heads (32: mx.quantize's smallest
    group, for quantized KV)."""
    import importlib

    from parallm.models import tiny

    mod = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict({**tiny.config(name), "head_dim": head_dim}))
    return tiny._finish(model, seed, 3.0)


def reference_greedy(model: nn.Module, prompt: list[int], max_tokens: int, prefill_step_size: int = 2048) -> list[int]:
    """mlx-lm's own single-sequence greedy decoding (no stop tokens)."""
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prefill_step_size=prefill_step_size):
        out.append(int(tok))
    return out


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_all(engine: Engine, requests: list[Request] | None = None, *, arrivals: dict[int, list[Request]] | None = None,
            max_steps: int = 100_000, check_every: bool = True,
            scores: dict[str, ScoreResult] | None = None) -> dict[tuple[str, int], dict]:
    """Drive an engine to completion; collect tokens/logprobs/finish per (rid, index), and the
    finished score requests by qid into `scores`."""
    for r in requests or []:
        engine.add_request(r)
    results: dict[tuple[str, int], dict] = {}
    step = 0
    while engine.has_work() or (arrivals and any(k >= step for k in arrivals)):
        for r in (arrivals or {}).get(step, []):
            engine.add_request(r)
        for o in engine.step():
            if isinstance(o, ScoreResult):
                assert scores is not None and o.qid not in scores, f"score {o.qid} unexpected or finished twice"
                scores[o.qid] = o
                continue
            d = results.setdefault((o.rid, o.index), {"tokens": [], "logprobs": [], "top": [], "finish": None,
                                                     "usage": None, "prompt_logprobs": None, "outputs": 0})
            d["tokens"].extend(o.token_ids)
            d["outputs"] += 1
            if o.logprobs is not None:
                d["logprobs"].extend(o.logprobs)
            if o.top_logprobs is not None:
                d["top"].extend(o.top_logprobs)
            if o.prompt_logprobs is not None:
                d["prompt_logprobs"] = (o.prompt_logprobs, o.prompt_top_logprobs)
            if o.finish_reason is not None:
                assert d["finish"] is None, "a sequence finished twice"
                d["finish"] = o.finish_reason
                d["usage"] = o.usage
        if check_every:
            engine.check_integrity()
        step += 1
        assert step < max_steps, "engine did not finish"
    return results


def make_engine(model: nn.Module, *, eos: list[int] | None = None, max_model_len: int = 512,
                kv_budget_bytes: int = 64 << 20, adapter_merge_mb: int | None = None, spec: SpecConfig | None = None,
                kv: KVConfig | None = None, draft: nn.Module | None = None, **engine) -> Engine:
    """An Engine on `model` with these engine settings (a 64 MiB KV budget unless given; `spec`: speculative
    decoding's; `draft`: its draft model (spec.mode draft); `kv`: the KV store's, e.g. kv.bits; prefill pacing off unless given, so a pass's chunks do not
    depend on how loaded the machine is)."""
    engine.setdefault("prefill_pass_s", 0.0)
    config = Config(engine=EngineConfig(kv_budget_mb=kv_budget_bytes / (1 << 20), **engine),
                    adapters=AdaptersConfig(merge_mb=adapter_merge_mb), spec=spec or SpecConfig(), kv=kv or KVConfig())
    return Engine(EngineModel(model, tuple(eos or ()), max_model_len, draft=draft), config)

def tracked_engine(engines: list[Engine], model: nn.Module, **kw) -> Engine:
    """make_engine, registered with the `engines` fixture (integrity and leak checks at teardown)."""
    engine = make_engine(model, **kw)
    engines.append(engine)
    return engine
