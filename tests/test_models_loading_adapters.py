"""--adapter NAME=PATH (adapters.preload): adapters loaded when the engine starts; a bad entry
stops the start with a message naming it."""

from __future__ import annotations

import pytest

from _adapter_helpers import lora_model, save_mlx
from _engine_helpers import greedy, make_engine, reference_greedy, req, run_all, tiny_model
from parallm.config import parse_args
from parallm.models.preload import load_adapters_at_start, parse_adapter_specs


def test_adapters_given_at_start_serve_their_requests(tmp_path):
    adapted = tiny_model("llama")
    config = lora_model(adapted)
    path = save_mlx(adapted, config, tmp_path / "a1")
    engine = make_engine(tiny_model("llama"))
    assert load_adapters_at_start(engine, [f"one={path}"]) == ["one"]
    prompt = [5, 17, 33, 2]
    res = run_all(engine, [req("r", prompt, greedy(8), adapter="one")])
    assert res[("r", 0)]["tokens"] == reference_greedy(adapted, prompt, 8)


def test_bad_entries_are_named(tmp_path):
    with pytest.raises(ValueError, match="is not NAME=PATH"):
        parse_adapter_specs(["just-a-path"])
    with pytest.raises(ValueError, match="does not exist"):
        parse_adapter_specs([f"a={tmp_path / 'missing'}"])
    with pytest.raises(ValueError, match="twice"):
        parse_adapter_specs([f"a={tmp_path}", f"a={tmp_path}"])


def test_the_cli_spelling_repeats():
    config, _ = parse_args(["--adapter", "a=/x", "--adapter", "b=/y"])
    assert config.adapters.preload == ["a=/x", "b=/y"]
