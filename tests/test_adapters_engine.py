"""Adapters in the engine core: parity with mlx-lm, mixed batches, versions, rejections."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import pytest

from parallm.adapters import AdapterError, save_bytes
from parallm.engine import RequestRejected
from tests._adapter_helpers import adapter_tensors, lora_model, save_mlx, to_peft
from tests._engine_helpers import greedy, make_engine, reference_greedy, run_all, tiny_model, req

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _tokens(engine, prompt=PROMPT, n=12, adapter="", **kw):
    rid = f"r{id(kw)}{adapter}{engine.stats().steps}"
    out = run_all(engine, [req(rid=rid, prompt_ids=prompt, params=greedy(n), adapter=adapter, **kw)])
    return out[(rid, 0)]["tokens"]


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_mlx_format_matches_mlx_lm(tmp_path, dora):
    ref = tiny_model("llama")
    config = lora_model(ref, rank=4, keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"), dora=dora)
    path = save_mlx(ref, config, tmp_path / "ad")
    engine = make_engine(tiny_model("llama"))
    loaded = engine.load_adapter("pol", path=str(path))
    assert (loaded.kind, loaded.format, loaded.version) == ("dora" if dora else "lora", "mlx", 1)
    want = reference_greedy(ref, PROMPT, 12)
    assert _tokens(engine, adapter="pol") == want
    assert _tokens(engine) == reference_greedy(tiny_model("llama"), PROMPT, 12)  # base rows untouched
    engine.check_integrity()


def test_peft_format_matches_mlx_lm():
    ref = tiny_model("qwen2")
    config = lora_model(ref, rank=8, scale=0.5, keys=("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"))
    peft_config, blob = to_peft(adapter_tensors(ref), config)
    engine = make_engine(tiny_model("qwen2"))
    loaded = engine.load_adapter("peft", config=peft_config, weights=blob)
    assert loaded.format == "peft" and loaded.rank == 8
    assert _tokens(engine, adapter="peft") == reference_greedy(ref, PROMPT, 12)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v have biases (DoRA rescales around them)
def test_mixed_batch_rows_match_alone(arch):
    refs, engine = {}, make_engine(tiny_model(arch), max_num_seqs=8)
    for name, kw in {"a": dict(rank=4, seed=1), "b": dict(rank=8, seed=2, keys=("self_attn.v_proj", "mlp.gate_proj")),
                     "d": dict(rank=2, seed=3, dora=True)}.items():
        ref = tiny_model(arch)
        config = lora_model(ref, **kw)
        engine.load_adapter(name, config=config, weights=save_bytes(adapter_tensors(ref)))
        refs[name] = ref
    refs[""] = tiny_model(arch)
    prompts = {"": [3, 4, 5], "a": [7, 8, 9, 10], "b": [11, 12], "d": [20, 21, 22, 23, 24]}
    alone = {name: reference_greedy(refs[name], prompts[name], 10) for name in refs}
    for name in refs:
        assert _tokens(engine, prompts[name], 10, adapter=name) == alone[name], name
    mix = ["", "a", "b", "a", "", "d", "b"]
    reqs = [req(rid=f"m{i}", prompt_ids=prompts[n], params=greedy(10), adapter=n) for i, n in enumerate(mix)]
    out = run_all(engine, reqs)
    for i, name in enumerate(mix):
        assert out[(f"m{i}", 0)]["tokens"] == alone[name], (i, name)
    passes = engine.stats().adapters.passes
    assert passes["mixed"] > 0 and passes["single"] > 0 and passes["base"] > 0


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q/k/v
def test_merged_weights_give_the_factored_update(arch, dora):
    """A single-adapter pass through the merged copies equals base + (x @ a) @ b, and mixing
    the version with the base model (the factored path) gives each row its own tokens still."""
    ref = tiny_model(arch)
    config = lora_model(ref, rank=4, keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"), dora=dora)
    blob = save_bytes(adapter_tensors(ref))
    merged_engine = make_engine(tiny_model(arch), max_num_seqs=4, adapter_merge_mb=256)
    factored_engine = make_engine(tiny_model(arch), max_num_seqs=4, adapter_merge_mb=0)
    merged = merged_engine.load_adapter("pol", config=config, weights=blob)
    factored = factored_engine.load_adapter("pol", config=config, weights=blob)
    assert merged.merged and not factored.merged
    assert merged.describe().merged and not factored.describe().merged
    targets = [m for p, m in merged_engine.model.named_modules() if p in merged.modules]
    copies = sum(m.merged.nbytes for m in merged.modules.values())
    assert merged.nbytes - factored.nbytes == copies == sum(t.linear.weight.nbytes for t in targets)
    assert merged_engine.stats().adapters.bytes == merged.nbytes

    x = mx.array([PROMPT])
    outs = []
    for engine, adapter in ((merged_engine, merged), (factored_engine, factored)):
        engine.adapters.router.bind([adapter])
        outs.append(engine.model(x))
        engine.adapters.router.unbind()
    assert mx.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4).item()

    want = reference_greedy(ref, PROMPT, 12)
    assert _tokens(merged_engine, adapter="pol") == _tokens(factored_engine, adapter="pol") == want
    base = reference_greedy(tiny_model(arch), [3, 4, 5], 12)
    reqs = [req(rid="m0", prompt_ids=PROMPT, params=greedy(12), adapter="pol"),
            req(rid="m1", prompt_ids=[3, 4, 5], params=greedy(12))]
    out = run_all(merged_engine, reqs)
    assert out[("m0", 0)]["tokens"] == want and out[("m1", 0)]["tokens"] == base
    assert merged_engine.stats().adapters.passes["mixed"] > 0


def test_merging_needs_dense_layers_within_the_budget():
    ref = tiny_model("llama")
    config = lora_model(ref, rank=4)
    blob = save_bytes(adapter_tensors(ref))
    quantized = tiny_model("llama")
    nn.quantize(quantized, group_size=32, bits=8)
    engine = make_engine(quantized, adapter_merge_mb=256)
    assert not engine.load_adapter("pol", config=config, weights=blob).merged  # no dense weight to fold into
    engine = make_engine(tiny_model("llama"), adapter_merge_mb=0)
    assert not engine.load_adapter("pol", config=config, weights=blob).merged
    assert make_engine(tiny_model("llama")).adapters.merge_bytes == 0  # auto on MLX's CPU device
    engine = make_engine(tiny_model("llama"), adapter_merge_mb=1)
    engine.adapters.merge_bytes = sum(m.weight.nbytes for p, m in engine.model.named_modules()
                                      if p.endswith(("q_proj", "v_proj"))) - 1
    assert not engine.load_adapter("pol", config=config, weights=blob).merged  # one byte over
    engine.adapters.merge_bytes += 1
    assert engine.load_adapter("pol", config=config, weights=blob).merged


def _random_adapter(engine_model, rank=4, seed=0, spread=0.3, keys=("q_proj", "v_proj")):
    mx.random.seed(seed)
    w = {}
    for path, module in engine_model.named_modules():
        leaf = path.rsplit(".", 1)[-1]
        if leaf in keys:
            lin = getattr(module, "linear", module)
            o, i = lin.weight.shape
            w[f"{path}.lora_a"] = mx.random.normal((i, rank)) * spread
            w[f"{path}.lora_b"] = mx.random.normal((rank, o)) * spread
    config = {"fine_tune_type": "lora", "num_layers": -1,
              "lora_parameters": {"rank": rank, "scale": 2.0, "dropout": 0.0}}
    return config, w


def test_bad_adapters_are_rejected_and_serving_continues():
    model = tiny_model("llama")
    engine = make_engine(model)
    config, good = _random_adapter(model)
    engine.load_adapter("pol", config=config, weights=save_bytes(good))
    before = _tokens(engine, adapter="pol")
    base = _tokens(engine)
    rid = "running"
    engine.add_request(req(rid=rid, prompt_ids=PROMPT, params=greedy(12), adapter="pol"))
    first = [t for o in engine.step() for t in o.token_ids]

    def rejected(match, **kw):
        with pytest.raises(AdapterError, match=match):
            engine.load_adapter("pol", **kw)

    k = "model.layers.0.self_attn.q_proj.lora_a"
    wrong = dict(good, **{k: mx.zeros((good[k].shape[0] + 1, 4))})
    rejected(r"maps 65 -> 64 features in the adapter .* but 64 -> 64", config=config, weights=save_bytes(wrong))
    nan = dict(good, **{k: good[k] * math.nan})
    rejected(r"'model.layers.0.self_attn.q_proj.lora_a' holds NaN", config=config, weights=save_bytes(nan))
    other_cfg, other = _random_adapter(tiny_model("llama"))
    other = {key.replace("layers.1.", "layers.7."): v for key, v in other.items()}
    rejected(r"targets layer 7 .* has 2 layers", config=other_cfg, weights=save_bytes(other))
    bigger = {key: mx.zeros((32, 4)) if key.endswith("lora_a") else mx.zeros((4, 32)) for key in good}
    rejected(r"maps 32 -> 32 features in the adapter .* but 64 -> 64", config=config, weights=save_bytes(bigger))
    rejected(r"no module 'model.layers.0.attn.q'", config=config,
             weights=save_bytes({"model.layers.0.attn.q.lora_a": mx.zeros((64, 4)),
                                 "model.layers.0.attn.q.lora_b": mx.zeros((4, 64))}))
    rejected(r"is a RMSNorm, not a linear layer", config=config,
             weights=save_bytes({"model.layers.0.input_layernorm.lora_a": mx.zeros((64, 4)),
                                 "model.layers.0.input_layernorm.lora_b": mx.zeros((4, 64))}))
    rejected(r"dtype int32", config=config, weights=save_bytes(dict(good, **{k: good[k].astype(mx.int32)})))
    rejected(r"rank 4 differs from lora_parameters.rank 8",
             config={**config, "lora_parameters": {"rank": 8, "scale": 1.0}}, weights=save_bytes(good))
    rejected(r"not safetensors", config=config, weights=b"\x00garbage")
    rejected(r"versions must increase", config=config, weights=save_bytes(good), version=1)
    with pytest.raises(AdapterError, match="does not exist"):
        engine.load_adapter("pol", path="/nonexistent/adapter")
    assert engine.policy() == {"": 0, "pol": 1}
    assert engine.stats().adapters.rejected == 11
    out = run_all(engine)
    assert first + out[(rid, 0)]["tokens"] == before  # the sequence running through all this is unchanged
    assert _tokens(engine, adapter="pol") == before and _tokens(engine) == base


def test_unknown_adapter_and_versions_are_refused_per_request():
    model = tiny_model("llama")
    engine = make_engine(model)
    with pytest.raises(RequestRejected) as info:
        engine.add_request(req(rid="x", prompt_ids=PROMPT, adapter="nope"))
    assert (info.value.status, info.value.code) == (404, "adapter_not_found")
    config, w = _random_adapter(model)
    engine.load_adapter("pol", config=config, weights=save_bytes(w))
    with pytest.raises(RequestRejected) as info:
        engine.add_request(req(rid="x", prompt_ids=PROMPT, adapter="pol", min_version=2))
    assert (info.value.status, info.value.code) == (409, "version_unavailable")
    with pytest.raises(RequestRejected) as info:
        engine.add_request(req(rid="x", prompt_ids=PROMPT, adapter="pol", adapter_version=5))
    assert info.value.status == 404
    assert engine.unload_adapter("pol") == 1
    with pytest.raises(RequestRejected):
        engine.add_request(req(rid="x", prompt_ids=PROMPT, adapter="pol"))
    assert not engine.has_work()


def _versions_engine(history=64, **config):
    model = tiny_model("llama")
    engine = make_engine(model, max_num_seqs=32, **config)
    engine.adapters.history = history
    passes: list[list[tuple[str, int]]] = []
    bind = engine.adapters.router.bind

    def recording_bind(adapters, packed=False):
        passes.append([("", 0) if a is None else (a.name, a.version) for a in adapters])
        bind(adapters, packed)

    engine.adapters.router.bind = recording_bind
    return model, engine, passes


@pytest.mark.parametrize("follow", [False, True], ids=["keep-version", "pause-keep-resume"])
def test_many_versions_while_streams_run(follow):
    """50 versions published while 16 streams run (and new ones arrive). Without `follow` each
    sequence keeps the version it started with, and its tokens equal that version's alone; with
    `follow` (what Pause(keep)+Resume does) running sequences move to each new version at the next
    pass, so no pass mixes two versions of the adapter."""
    model, engine, passes = _versions_engine()
    published: set[int] = set()
    prompts = [[3 + i, 4 + i, 5 + i] for i in range(4)]
    tokens: dict[tuple[str, int], list[tuple[int, int]]] = {}
    seq_n, step = 0, 0

    def publish(v):
        config, w = _random_adapter(model, seed=100 + v, spread=0.5)
        engine.load_adapter("pol", config=config, weights=save_bytes(w))
        published.add(v)
        if follow:
            engine.follow_latest()

    publish(1)
    for i in range(16):
        engine.add_request(req(rid=f"s{i}", prompt_ids=prompts[i % 4], params=greedy(60), adapter="pol"))
    seq_n = 16
    version = 1
    while engine.has_work() or version < 50:
        if version < 50 and step % 2 == 1:
            version += 1
            publish(version)
            if version % 5 == 0:  # new streams keep arriving
                engine.add_request(req(rid=f"s{seq_n}", prompt_ids=prompts[seq_n % 4], params=greedy(30),
                                           adapter="pol"))
                seq_n += 1
        for o in engine.step():
            assert o.adapter == "pol"
            assert o.version in published, f"token reported under version {o.version} that did not exist yet"
            tokens.setdefault((o.rid, o.index), []).extend((t, o.version) for t in o.token_ids)
        engine.check_integrity()
        step += 1
        assert step < 2000
    assert len(tokens) == seq_n and all(len(v) in (60, 30) for v in tokens.values())
    pol_passes = [{v for n, v in p if n == "pol"} for p in passes]
    if follow:
        assert all(len(vs) <= 1 for vs in pol_passes), "a pass mixed two versions of one adapter"
        spans = [sorted({v for _, v in toks}) for toks in tokens.values()]
        assert max(len(s) for s in spans) > 10  # the long streams really moved across versions
        for toks in tokens.values():
            vs = [v for _, v in toks]
            assert vs == sorted(vs)  # versions only move forward along a sequence
    else:
        assert max(len(vs) for vs in pol_passes) > 1  # sequences started under different versions shared passes
        # every sequence's tokens are exactly its version's tokens alone (no pass tore a version)
        want_keys = {(tuple(prompts[int(rid[1:]) % 4]), toks[0][1], len(toks)) for (rid, _), toks in tokens.items()}
        refs = run_all(engine, [req(rid=f"ref{j}", prompt_ids=list(p), params=greedy(n), adapter="pol",
                                        adapter_version=v) for j, (p, v, n) in enumerate(sorted(want_keys))])
        ref_of = {key: refs[(f"ref{j}", 0)]["tokens"] for j, key in enumerate(sorted(want_keys))}
        for (rid, _), toks in tokens.items():
            assert len({v for _, v in toks}) == 1
            key = (tuple(prompts[int(rid[1:]) % 4]), toks[0][1], len(toks))
            assert [t for t, _ in toks] == ref_of[key], rid


def test_history_keeps_last_k_versions_and_running_sequences_keep_theirs():
    model, engine, _ = _versions_engine(history=2)
    for v in range(1, 4):
        config, w = _random_adapter(model, seed=v)
        engine.load_adapter("pol", config=config, weights=save_bytes(w))
        if v == 1:
            engine.add_request(req(rid="old", prompt_ids=PROMPT, params=greedy(20), adapter="pol"))
            first = sum(len(o.token_ids) for o in engine.step())
    assert [a.version for a in engine.adapters.describe()[0].versions] == [2, 3]
    with pytest.raises(RequestRejected, match="no version 1"):
        engine.add_request(req(rid="x", prompt_ids=PROMPT, adapter="pol", adapter_version=1))
    out = run_all(engine)
    assert first + len(out[("old", 0)]["tokens"]) == 20  # finished under the evicted version 1
    st = engine.stats()
    assert st.adapters.versions_kept == 2 and st.adapters.bytes > 0


def test_first_token_of_a_new_version_is_read_in_the_step_that_samples_it():
    """With overlap a pass is read one step after its launch; the first pass under a newly loaded
    version is read at once (what a trainer waits for after publishing), later ones overlap again."""
    model, engine, _ = _versions_engine(overlap=True)  # auto would turn it off on the CPU
    config, w = _random_adapter(model, seed=1)
    engine.load_adapter("pol", config=config, weights=save_bytes(w))
    engine.add_request(req(rid="base", prompt_ids=[3, 4, 5], params=greedy(40)))
    engine.add_request(req(rid="old", prompt_ids=[3, 4, 5], params=greedy(40), adapter="pol"))
    for _ in range(4):
        engine.step()
    assert engine.owes_outputs()  # steady decode: one pass in flight between steps
    config, w = _random_adapter(model, seed=2)
    engine.load_adapter("pol", config=config, weights=save_bytes(w))
    engine.follow_latest()
    outs = engine.step()
    assert any(o.version == 2 and o.token_ids for o in outs), [(o.rid, o.version) for o in outs]
    assert not engine.owes_outputs()  # that pass was read, not left in flight
    engine.step()
    assert engine.owes_outputs()  # and overlap resumes
    assert engine.stats().adapters.load_to_first_token_ms is not None
    run_all(engine)
    engine.check_integrity()
