import subprocess
import sys

import pytest

from parallm.config import Config, ConfigError, build_config, iter_options, parse_args


def test_defaults_are_valid_and_round_trip():
    config = build_config(environ={})
    assert config == Config()
    assert Config.decode(config.encode()) == config


def test_layering_file_env_cli(tmp_path):
    path = tmp_path / "parallm.toml"
    path.write_text('[engine]\nmax_num_seqs = 8\nblock_size = 32\n[server]\nport = 9001\n')
    config = build_config(file=path, environ={"PARALLM_ENGINE__MAX_NUM_SEQS": "12"},
                          cli={"server": {"port": 9002}})
    assert config.engine.block_size == 32          # file
    assert config.engine.max_num_seqs == 12        # env beats file
    assert config.server.port == 9002              # cli beats file


def test_config_file_from_env(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('log_level = "debug"\n')
    assert build_config(environ={"PARALLM_CONFIG": str(path)}).log_level == "debug"


@pytest.mark.parametrize("environ, fragment", [
    ({"PARALLM_ENGINE__MAX_NUM_SEQS": "many"}, "PARALLM_ENGINE__MAX_NUM_SEQS"),
    ({"PARALLM_ENGINE__OVERLAP": "perhaps"}, "not a boolean"),
    ({"PARALLM_MODEL__DTYPE": "int3"}, "is not one of"),
    ({"PARALLM_ENGINE__MAX_NUM_SEQS": "0"}, "max_num_seqs"),
    ({"PARALLM_SPEC__MODE": "draft"}, "spec.mode draft needs spec.draft_model"),
    ({"PARALLM_SPEC__DRAFT_MODEL": "/d"}, "only read with spec.mode draft"),
    ({"PARALLM_SPEC__DRAFT_ACCEPTANCE": "rejection"}, "spec.draft_acceptance is only read with spec.mode draft"),
    ({"PARALLM_SPEC__MODE": "draft", "PARALLM_SPEC__DRAFT_MODEL": "/d", "PARALLM_SPEC__DRAFT_ACCEPTANCE": "maybe"},
     "is not one of"),
    ({"PARALLM_ENGINE__HANG_FACTOR": "0.5"}, "engine.hang_factor >= 1"),
    ({"PARALLM_ENGINE__HANG_FLOOR_S": "-1"}, "engine.hang_floor_s must be >= 0"),
])
def test_bad_values_name_the_setting(environ, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_config(environ=environ)


def test_draft_mode_flags():
    config, _ = parse_args(["--spec.mode", "draft", "--spec.draft-model", "/models/small", "--spec.k", "3"])
    assert (config.spec.mode, config.spec.draft_model, config.spec.k) == ("draft", "/models/small", 3)
    assert config.spec.draft_acceptance == "coupled"  # the default: seeds give plain decoding's tokens
    config, _ = parse_args(["--spec.mode", "draft", "--spec.draft-model", "/m", "--spec.draft-acceptance", "rejection"])
    assert config.spec.draft_acceptance == "rejection"


def test_unknown_file_key_is_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nmax_num_sequences = 3\n")
    with pytest.raises(ConfigError, match="max_num_sequences"):
        build_config(file=path, environ={})


def test_cli_options_cover_every_setting():
    config, _ = parse_args(["--model", "/x.gguf", "--port", "8100", "--engine.max-num-seqs", "4",
                            "--api-key", "a,b", "--server.api-keys", "c"])
    assert config.model.path == "/x.gguf"
    assert config.server.port == 8100
    assert config.engine.max_num_seqs == 4
    assert config.server.api_keys == ["a", "b", "c"]


def test_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "parallm.launch", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for dotted, _, desc, _ in iter_options():
        assert f"--{dotted.replace('_', '-')}" in out, dotted
        assert desc, f"{dotted} has no description"


def test_auto_is_the_one_spelling_of_unset_everywhere(tmp_path):
    """Every setting decided for the machine is None when unset; `auto` unsets it from any layer."""
    optional = [dotted for dotted, typ, _, default in iter_options() if default is None]
    assert {"engine.max_prefill_tokens", "engine.kv_budget_mb", "engine.overlap", "engine.fast_math",
            "adapters.merge_mb", "model.dtype", "supervisor.blas", "supervisor.allocator"} <= set(optional)
    assert not [dotted for dotted, _, _, default in iter_options() if default == "auto"]
    path = tmp_path / "c.toml"
    path.write_text('[engine]\noverlap = "auto"\nkv_budget_mb = 64\n[model]\ndtype = "auto"\n')
    config = build_config(file=path, environ={"PARALLM_ENGINE__MAX_PREFILL_TOKENS": "auto"},
                          cli={"adapters": {"merge_mb": None}})
    assert (config.engine.overlap, config.engine.max_prefill_tokens, config.model.dtype) == (None, None, None)
    assert config.engine.kv_budget_mb == 64
    config, _ = parse_args(["--engine.fast-math", "auto", "--supervisor.blas", "auto", "--engine.kv-budget-mb", "0.5"])
    assert config.engine.fast_math is None and config.supervisor.blas is None and config.engine.kv_budget_mb == 0.5
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        build_config(environ={"PARALLM_ENGINE__MAX_PREFILL_TOKENS": "0"})


def test_sections_are_named_for_what_they_hold():
    config = build_config(environ={"PARALLM_ADAPTERS__STALENESS_POLICY": "hold",
                                   "PARALLM_DETOKENIZER__ROLLOUT_HWM": "7"})
    assert config.adapters.staleness_policy == "hold" and config.detokenizer.rollout_hwm == 7
    assert not hasattr(config, "rl")


def test_help_texts_claim_nothing_that_does_not_exist():
    out = subprocess.run([sys.executable, "-m", "parallm.launch", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "fuse the decode step" not in out
    assert "(default: auto;" in out
