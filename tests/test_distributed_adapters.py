"""Adapters and full-weight updates on a tensor-parallel engine (parallm/adapters/sharded.py,
parallm/engine/distributed.py): a 2-rank group on MLX's ring backend, on this CPU, driven through
the same script of steps as the single-rank engine. LoRA and DoRA versions are loaded before the
first request and published mid-stream, the base weights are replaced mid-stream (as tensors, then
from a directory); greedy and seeded tokens, and the version each token ran under, must equal the
single-rank engine's, and every rank must end in the same state (digest, versions)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import msgspec
import pytest
from mlx.utils import tree_flatten

from parallm.adapters import save_bytes
from parallm.adapters.sharded import full_dims, local_linear, shard_lora, shard_tensor, split
from parallm.adapters.formats import ModuleLoRA
from parallm.protocol import SamplingParams
from tests._adapter_helpers import adapter_tensors, lora_model
from tests._engine_helpers import greedy, make_engine, req, tiny_model
from tests._ring_helpers import run_ring

ROOT = Path(__file__).resolve().parents[1]
EVERY_PROJECTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                    "mlp.up_proj", "mlp.down_proj")


def adapter(seed: int, dora: bool = False) -> tuple[dict, bytes]:
    """A LoRA of every projection (both kinds of sharded layer), or a DoRA of q/v/gate (all-to-sharded)."""
    model = tiny_model("llama")
    keys = ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj") if dora else EVERY_PROJECTION
    config = lora_model(model, keys=keys, dora=dora, seed=seed, spread=0.3)
    return config, save_bytes(adapter_tensors(model))


def new_weights() -> dict[str, mx.array]:
    """Whole-model tensors of another random llama of the same shape (what a trainer sends)."""
    return dict(tree_flatten(tiny_model("llama", seed=7).parameters()))


def script(weights_dir: str) -> dict[int, list]:
    """What happens before each step: requests arrive, adapter versions are published, weights change."""
    prompts = [[(5 * i + 11 * j) % 97 + 1 for j in range(n)] for i, n in enumerate((6, 21, 35, 4, 13))]
    a1, a2, d1 = adapter(1), adapter(2), adapter(3, dora=True)

    def publish(name: str, cfg_bytes: tuple[dict, bytes]):
        return lambda e: e.load_adapter(name, config=cfg_bytes[0], weights=cfg_bytes[1])

    def submit(*requests):
        def add(e):
            for r in requests:
                e.add_request(r)
        return add

    return {
        0: [publish("a", a1), publish("d", d1),
            submit(req("base", prompts[0], greedy(10)), req("a-v1", prompts[1], greedy(14), adapter="a"),
                   req("d-v1", prompts[2], greedy(10), adapter="d"),
                   req("a-seeded", prompts[3], SamplingParams(temperature=0.9, max_tokens=12, seed=3), adapter="a"))],
        3: [publish("a", a2), submit(req("a-v2", prompts[4], greedy(8), adapter="a"),
                                     req("a-n2", prompts[1], greedy(5), adapter="a", n=2))],
        5: [lambda e: e.follow_latest()],  # running a-v1 moves to version 2 mid-stream
        # full-weight updates need no adapter merged into a base-weight copy: unload them first
        20: [lambda e: e.unload_adapter("a"), lambda e: e.unload_adapter("d"),
             lambda e: e.update_weights(tensors=new_weights()), submit(req("w1", prompts[2], greedy(8)))],
        24: [lambda e: e.update_weights(path=weights_dir), submit(req("w2", prompts[3], greedy(6)))],
    }


def drive(engine, weights_dir: str) -> dict[str, dict]:
    """Run the script; per (rid, index): its tokens and the (adapter, version) of each output."""
    events = script(weights_dir)
    got: dict[str, dict] = {}
    step = 0
    while engine.has_work() or step <= max(events):
        for event in events.get(step, []):
            event(engine)
        for o in engine.step():
            d = got.setdefault(f"{o.rid}/{o.index}", {"tokens": [], "versions": []})
            d["tokens"] += o.token_ids
            d["versions"].append(f"{o.adapter}@{o.version}")
        step += 1
    return got


def final_state(engine) -> dict:
    from parallm.engine.distributed import state_digest

    return {"digest": state_digest(engine), "policy": engine.policy(), "weights": engine.weights_version}


def rank_main(out_dir: str) -> int:
    from parallm.engine import distributed

    group = distributed.join(2, backend="ring")
    model = tiny_model("llama")
    distributed.shard_model(model, group)
    engine = make_engine(model)
    distributed.freeze_clock(engine)
    engine.warm_up()
    out = Path(out_dir)
    addresses = distributed.control_addresses(out_dir)
    if group.rank() > 0:
        code = distributed.follow(engine, group, addresses)
    else:
        leader = distributed.Leader(engine, group, addresses)
        (out / "tokens.json").write_text(json.dumps(drive(leader, str(out / "weights"))))
        # rank 1's acks arrive when it has replayed each batch; steps with no pass have no collective, so
        # it may still be replaying (an adapter or weights load) when rank 0 is done: wait for its last ack
        deadline = time.monotonic() + 30
        while (ranks := leader.stats().ranks)[1].step < ranks[0].step and time.monotonic() < deadline:
            time.sleep(0.02)
        (out / "ranks.json").write_text(json.dumps(msgspec.to_builtins(ranks)))
        leader.close()
        code = 0
    (out / f"state-{group.rank()}.json").write_text(json.dumps(final_state(engine)))
    return code


def test_adapters_and_weight_updates_on_two_ranks_match_one(tmp_path):
    (tmp_path / "weights").mkdir()
    mx.save_safetensors(str(tmp_path / "weights" / "model.safetensors"),
                        {k: v * 1.1 for k, v in new_weights().items()})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # a follower whose state digest differed from rank 0's would have exited 1
    assert run_ring(__file__, str(tmp_path), tmp_path, 2, env) == [0, 0]
    got = json.loads((tmp_path / "tokens.json").read_text())
    single = make_engine(tiny_model("llama"))
    want = drive(single, str(tmp_path / "weights"))
    assert got == want
    assert {"a@1", "a@2"} <= set(got["a-v1/0"]["versions"]), "a-v1 must move to version 2 mid-stream"
    assert got["d-v1/0"]["versions"][0] == "d@1" and got["w2/0"]["versions"][-1] == "@2"
    states = [json.loads((tmp_path / f"state-{r}.json").read_text()) for r in range(2)]
    assert states[0] == states[1] and states[0]["weights"] == 2
    ranks = json.loads((tmp_path / "ranks.json").read_text())  # rank 0's stats: what each rank serves
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[1]["agrees"] and ranks[1]["step"] > 24
    assert ranks[0]["policy"] == ranks[1]["policy"] == {"": 2}


# ------------------------------------------------------------------ slicing, on one process

class FakeGroup:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def sharded_layers(kind: str, size: int = 2, quantize: bool = False):
    """Rank r's slice of one whole linear layer (64 -> 96), made by mlx's own shard_linear."""
    import mlx.nn as nn
    from mlx.nn.layers.distributed import shard_linear

    mx.random.seed(0)
    whole = nn.Linear(64, 96, bias=True)
    if quantize:
        whole = nn.QuantizedLinear.from_linear(whole, group_size=32, bits=4)
    return whole, [shard_linear(whole, kind, group=FakeGroup(size, r)) for r in range(size)]


@pytest.mark.parametrize("quantize", [False, True])
def test_sliced_lora_sums_to_the_whole_update(quantize):
    """Concatenating the all-to-sharded ranks' outputs, or summing the sharded-to-all ranks' partial
    outputs, of base + sliced LoRA gives the whole layer with the whole LoRA."""
    x = mx.random.normal((3, 64))
    m = ModuleLoRA(a=mx.random.normal((64, 4)) * 0.2, b=mx.random.normal((4, 96)) * 0.2, scale=2.0)
    whole, ranks = sharded_layers("all-to-sharded", quantize=quantize)
    want = whole(x) + m.scale * (x @ m.a) @ m.b
    parts = []
    for layer in ranks:
        local = shard_lora("p", m, layer)
        parts.append(local_linear(layer)(x) + local.scale * (x @ local.a) @ local.b)
    assert full_dims(ranks[0]) == (64, 96)
    assert mx.allclose(mx.concatenate(parts, axis=-1), want, atol=1e-4)

    whole, ranks = sharded_layers("sharded-to-all", quantize=quantize)
    want = whole(x) + m.scale * (x @ m.a) @ m.b
    total = mx.zeros_like(want)
    for r, layer in enumerate(ranks):
        local, x_r = shard_lora("p", m, layer), split(x, 1, 1, 2, r)
        total = total + local_linear(layer)(x_r) + local.scale * (x_r @ local.a) @ local.b
    assert mx.allclose(total + whole.bias, want, atol=1e-4)


def test_a_mismatched_or_dora_update_of_a_sharded_to_all_layer_is_refused():
    from parallm.adapters import AdapterError

    _, ranks = sharded_layers("sharded-to-all")
    with pytest.raises(AdapterError, match="maps 32 -> 96 features in the adapter .* but 64 -> 96"):
        shard_lora("p", ModuleLoRA(a=mx.zeros((32, 4)), b=mx.zeros((4, 96)), scale=1.0), ranks[0])
    dora = ModuleLoRA(a=mx.zeros((64, 4)), b=mx.zeros((4, 96)), scale=1.0, m=mx.ones((96,)))
    with pytest.raises(AdapterError, match="DoRA on p is not supported on a tensor-parallel engine"):
        shard_lora("p", dora, ranks[0])


@pytest.mark.parametrize("kind", ["all-to-sharded", "sharded-to-all"])
def test_whole_tensors_are_sliced_as_mlx_shards_them(kind):
    whole, ranks = sharded_layers(kind, size=2)
    for layer in ranks:
        for leaf in ("weight", "bias"):
            assert mx.array_equal(shard_tensor(layer, leaf, whole[leaf]), layer[leaf])
    with pytest.raises(ValueError, match="before tensor-parallel sharding"):
        shard_tensor(ranks[0], "weight", ranks[0].weight)


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1]))
