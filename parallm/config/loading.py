"""How a Config is built: defaults < TOML file < PARALLM_* env < CLI (< explicit overrides), each
layer's values parsed by the schema's types (parallm/config/schema.py), `auto` unsetting an optional
setting, and the whole checked once (`ConfigError` names every invalid setting)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Mapping, Sequence, Union, get_args, get_origin, get_type_hints

import msgspec
from msgspec import Meta, Struct

from .pooling import parse_entry
from .schema import (AUTO, ENV_PREFIX, TOOL_CALL_PARSERS, Config, PoliciesConfig, TrainerConfig, generates,
                     pooling_only_problems)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ALIASES", "ConfigError", "iter_options", "env_overrides", "add_cli_options", "cli_overrides",
           "build_config", "parse_args", "TRAINER_ENV_PREFIX", "build_trainer_config", "enabled_trainers"]



# Short CLI spellings for the options people type most.
ALIASES: dict[str, str] = {
    "model": "model.path",
    "host": "server.host",
    "port": "server.port",
    "dtype": "model.dtype",
    "api-key": "server.api_keys",
    "chat-template": "model.chat_template",
    "adapter": "adapters.preload",
    "pooling-model": "model.pooling",
    "task": "model.task",
    "trust-remote-code": "model.trust_remote_code",
    "generation-config": "model.generation_config",
    "policy-model": "policies.models",
}


class ConfigError(ValueError):
    """A setting from a file, the environment or the command line is invalid."""


def _fields(struct_type: type) -> list[tuple[str, Any, str]]:
    hints = get_type_hints(struct_type, include_extras=True)
    out = []
    for name in struct_type.__struct_fields__:
        hint = hints[name]
        desc = ""
        if get_origin(hint) is Annotated:
            base, *extras = get_args(hint)
            desc = next((m.description for m in extras if isinstance(m, Meta) and m.description), "")
        else:
            base = hint
        out.append((name, base, desc))
    return out


def iter_options(struct_type: type = Config, prefix: str = "") -> list[tuple[str, Any, str, Any]]:
    """Every leaf setting as (dotted name, type, description, default)."""
    defaults = struct_type()
    out = []
    for name, base, desc in _fields(struct_type):
        default = getattr(defaults, name)
        if isinstance(base, type) and issubclass(base, Struct):
            out.extend(iter_options(base, f"{prefix}{name}."))
        elif _struct_list(base):
            continue   # a list of sections ([[trainer]] entries): a file's setting only
        else:
            out.append((f"{prefix}{name}", base, desc, default))
    return out


def _parse_scalar(text: str, typ: Any, where: str) -> Any:
    origin = get_origin(typ)
    optional = [a for a in get_args(typ) if a is not type(None)] if origin in (Union, UnionType) else []
    if len(optional) == 1:
        if text.strip().lower() == AUTO:
            return None
        return _parse_scalar(text, optional[0], where)
    try:
        if typ is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {text!r}")
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
        if origin is list:
            return [item.strip() for item in text.split(",") if item.strip()]
        if origin is dict:
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError(f"not a JSON object: {text!r}")
            return value
        if origin is Literal:  # of strings or ints (kv.bits): the choice whose text it is
            for choice in get_args(typ):
                if str(choice) == text.strip():
                    return choice
            raise ValueError(f"{text!r} is not one of {', '.join(map(str, get_args(typ)))}")
        return text
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _struct_list(typ: Any) -> bool:
    return get_origin(typ) is list and any(isinstance(a, type) and issubclass(a, Struct) for a in get_args(typ))


def _is_optional(typ: Any) -> bool:
    return get_origin(typ) in (Union, UnionType) and type(None) in get_args(typ)


def _unset_autos(tree: Mapping, struct_type: type) -> dict:
    """`auto` (from a TOML file or overrides) as None for every optional setting of `struct_type`."""
    out = dict(tree)
    for name, base, _ in _fields(struct_type):
        if name not in out:
            continue
        value = out[name]
        if isinstance(base, type) and issubclass(base, Struct) and isinstance(value, Mapping):
            out[name] = _unset_autos(value, base)
        elif _is_optional(base) and isinstance(value, str) and value.strip().lower() == AUTO:
            out[name] = None
    return out


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def env_overrides(environ: Mapping[str, str], root: type = Config, prefix: str = ENV_PREFIX) -> dict:
    """PARALLM_ENGINE__MAX_NUM_SEQS=32 sets engine.max_num_seqs (double underscore between levels)."""
    known = {dotted: typ for dotted, typ, _, _ in iter_options(root)}
    tree: dict = {}
    for key, raw in environ.items():
        if not key.startswith(prefix) or key == ENV_PREFIX + "CONFIG":
            continue
        dotted = key[len(prefix):].lower().replace("__", ".")
        if dotted not in known:
            continue
        _set_dotted(tree, dotted, _parse_scalar(raw, known[dotted], key))
    return tree


def add_cli_options(parser: argparse.ArgumentParser, root: type = Config, *, env_prefix: str = ENV_PREFIX,
                    aliases: Mapping[str, str] | None = None, add_config: bool = True) -> None:
    """One --section.name option per setting of `root`, documented from its description and default."""
    if add_config:
        parser.add_argument("--config", metavar="FILE", help="TOML file with [model], [engine], ... sections "
                            f"(also {ENV_PREFIX}CONFIG)")
    reverse_alias = {v: k for k, v in (ALIASES if aliases is None else aliases).items()}
    for dotted, typ, desc, default in iter_options(root):
        flags = [f"--{dotted.replace('_', '-')}"]
        if dotted in reverse_alias:
            flags.insert(0, f"--{reverse_alias[dotted]}")
        shown = ",".join(default) if isinstance(default, list) else json.dumps(default) if isinstance(default, dict) \
            else AUTO if default is None and _is_optional(typ) else default
        env = env_prefix + dotted.upper().replace(".", "__")
        help_text = f"{desc} (default: {shown!s}; env {env})"
        action = "append" if get_origin(typ) is list else "store"
        parser.add_argument(*flags, dest=f"opt:{dotted}", metavar="LIST" if action == "append" else
                            typ.__name__.upper() if isinstance(typ, type) else "VALUE",
                            action=action, default=None, help=help_text)


def cli_overrides(namespace: argparse.Namespace, root: type = Config) -> dict:
    known = {dotted: typ for dotted, typ, _, _ in iter_options(root)}
    tree: dict = {}
    for key, value in vars(namespace).items():
        if not key.startswith("opt:") or value is None:
            continue
        dotted = key[4:]
        typ = known[dotted]
        where = f"--{dotted.replace('_', '-')}"
        if get_origin(typ) is list:
            parsed = [item for raw in value for item in _parse_scalar(raw, typ, where)]
        else:
            parsed = _parse_scalar(value, typ, where)
        _set_dotted(tree, dotted, parsed)
    return tree


def build_config(*, file: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None,
                 cli: dict | None = None, overrides: dict | None = None) -> Config:
    """Layer defaults < TOML file < environment < CLI < explicit overrides into a validated Config."""
    environ = os.environ if environ is None else environ
    tree: dict = {}
    file = file or environ.get(ENV_PREFIX + "CONFIG")
    if file:
        try:
            tree = _merge(tree, _trainer_entries(tomllib.loads(Path(file).read_text())))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {file}: {exc}") from None
    tree = _merge(tree, env_overrides(environ))
    tree = _merge(tree, cli or {})
    tree = _merge(tree, overrides or {})
    try:
        config = msgspec.convert(_unset_autos(tree, Config), type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
    _check(config)
    return config


def _trainer_entries(tree: dict) -> dict:
    """A file's `[[trainer]]` array of tables (several trainers) is Config.trainers; `[trainer]` stays one."""
    if isinstance(tree.get("trainer"), list):
        tree = dict(tree)
        tree["trainers"] = tree.pop("trainer")
    return tree


def _trainer_problems(config: Config) -> list[str]:
    entries = enabled_trainers(config)
    problems = []
    for key, what in ((lambda t: t.model.adapter, "model.adapter"), (lambda t: t.checkpointing.dir, "checkpointing.dir"),
                      (lambda t: t.name, "name")):
        values = [key(t) for t in entries]
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            problems.append(f"the trainers share {what} {', '.join(map(repr, twice))}: each [[trainer]] entry needs "
                            f"its own (each publishes its own adapter versions and checkpoints)")
    return problems


def enabled_trainers(config: Config) -> list[TrainerConfig]:
    """The trainers parallm-launch starts, each with its name: `[trainer]` when enabled (named "trainer"
    unless it says), then every enabled `[[trainer]]` entry (named "trainer-ADAPTER" unless it says)."""
    one = [msgspec.structs.replace(config.trainer, name=config.trainer.name or "trainer")] \
        if config.trainer.enabled else []
    return one + [msgspec.structs.replace(t, name=t.name or f"trainer-{t.model.adapter}")
                  for t in config.trainers if t.enabled]


def _check(config: Config) -> None:
    problems = _trainer_problems(config)
    if config.server.tool_call_parser:
        known = sorted(TOOL_CALL_PARSERS)
        if config.server.tool_call_parser not in known:
            problems.append(f"server.tool_call_parser {config.server.tool_call_parser!r} is not one of: "
                            + ", ".join(known))
    for entry in config.model.pooling:
        try:
            parse_entry(entry)
        except ValueError as exc:
            problems.append(str(exc))
    if not generates(config):
        problems += pooling_only_problems(config)
    if config.engine.pooling_batch_tokens < 1:
        problems.append("engine.pooling_batch_tokens must be >= 1")
    if config.engine.max_num_seqs < 1:
        problems.append("engine.max_num_seqs must be >= 1")
    engine = config.engine
    if engine.max_prefill_tokens is not None and engine.max_prefill_tokens < 1:
        problems.append("engine.max_prefill_tokens must be >= 1 (or unset: auto)")
    if engine.max_prefill_rows is not None and engine.max_prefill_rows < 1:
        problems.append("engine.max_prefill_rows must be >= 1 (or unset: auto)")
    if not 0 <= engine.training_share < 1:
        problems.append("engine.training_share must be in [0, 1)")
    if engine.prefill_pass_s is not None and not 0 <= engine.prefill_pass_s < float("inf"):
        problems.append("engine.prefill_pass_s must be >= 0 (0 = off, or unset: auto)")
    if engine.kv_budget_mb is not None and engine.kv_budget_mb <= 0:
        problems.append("engine.kv_budget_mb must be > 0 (or unset: auto)")
    if not 0 <= engine.prefix_pool_fraction < 1:
        problems.append("engine.prefix_pool_fraction must be in [0, 1)")
    if engine.priority_aging_s < 0:
        problems.append("engine.priority_aging_s must be >= 0 (0 = strict priority)")
    kv = config.kv
    if kv.disk_max_gb <= 0:
        problems.append("kv.disk_max_gb must be > 0")
    if kv.disk_ttl_s < 0:
        problems.append("kv.disk_ttl_s must be >= 0 (0 = no limit)")
    if kv.disk_queue_blocks < 1:
        problems.append("kv.disk_queue_blocks must be >= 1")
    if kv.pressure_threshold is not None and not 0 < kv.pressure_threshold <= 1:
        problems.append("kv.pressure_threshold must be in (0, 1] (or unset: no bound)")
    spec = config.spec
    if spec.k < 0:
        problems.append("spec.k must be >= 1 (or 0: the mode's own)")
    if spec.disable_batch_size < 1:
        problems.append("spec.disable_batch_size must be >= 1")
    if spec.verify_multiple < 1:
        problems.append("spec.verify_multiple must be >= 1")
    if not 1 <= spec.ngram_min <= spec.ngram_max:
        problems.append("spec.ngram_min and spec.ngram_max must satisfy 1 <= ngram_min <= ngram_max")
    if not 0 <= spec.min_acceptance < 1:
        problems.append("spec.min_acceptance must be in [0, 1)")
    if spec.mode == "draft" and not spec.draft_model.strip():
        problems.append("spec.mode draft needs spec.draft_model (the draft model's path: a smaller model "
                        "sharing the served model's vocabulary)")
    if spec.draft_model and spec.mode != "draft":
        problems.append("spec.draft_model is only read with spec.mode draft")
    if spec.draft_acceptance != "coupled" and spec.mode != "draft":
        problems.append("spec.draft_acceptance is only read with spec.mode draft")
    if config.adapters.weights_chunk_timeout_s <= 0:
        problems.append("adapters.weights_chunk_timeout_s must be > 0")
    if config.adapters.history < 1:
        problems.append("adapters.history must be >= 1")
    if config.engine.block_size is not None and config.engine.block_size < 1:
        problems.append("engine.block_size must be >= 1")
    if config.engine.tensor_parallel < 1:
        problems.append("engine.tensor_parallel must be >= 1")
    if config.engine.admit_delay_factor is not None and not 0 <= config.engine.admit_delay_factor <= 100:
        problems.append("engine.admit_delay_factor must be between 0 (off) and 100")
    if config.engine.warm_decode_rows is not None and config.engine.warm_decode_rows < 0:
        problems.append("engine.warm_decode_rows must be >= 0 (0 = none)")
    if config.engine.hang_floor_s < 0 or config.engine.hang_factor < 1:
        problems.append("engine.hang_floor_s must be >= 0 (0 = off) and engine.hang_factor >= 1")
    if config.engine.replicas < 1:
        problems.append("engine.replicas must be >= 1")
    if config.engine.hostfile and config.engine.tensor_parallel < 2:
        problems.append("engine.hostfile places tensor-parallel ranks: it needs engine.tensor_parallel >= 2")
    if config.engine.remote_replicas and config.transport.kind != "tcp":
        problems.append("engine.remote_replicas needs transport.kind tcp")
    for remote in config.engine.remote_replicas:
        host, _, port = remote.removeprefix("tcp://").rpartition(":")
        if not remote.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65535:
            problems.append(f"engine.remote_replicas entry {remote!r} is not tcp://HOST:PORT (PORT below 65535)")
    if config.tokenizer.replicas < 1:
        problems.append("tokenizer.replicas must be >= 1")
    if config.transport.max_message_mb < 1:
        problems.append("transport.max_message_mb must be >= 1")
    if config.server.max_logprobs < -1:
        problems.append("server.max_logprobs must be >= 0, or -1 (the vocabulary size)")
    model = config.model
    if (model.dtype == "quantized" and model.quantized_weights == "dequantize") or \
            (model.dtype not in (None, "quantized") and model.quantized_weights == "keep"):
        problems.append(f"model.dtype {model.dtype} contradicts model.quantized_weights {model.quantized_weights}; "
                        "set one of them")
    gen = config.model.generation_config
    if gen not in (None, "none") and not Path(gen).expanduser().is_dir():
        problems.append(f"model.generation_config must be auto, none or a directory (got {gen!r})")
    problems += _policy_problems(config.policies)
    if not 0 < config.server.port < 65536:
        problems.append("server.port must be in 1..65535")
    if problems:
        raise ConfigError("; ".join(problems))


def _policy_problems(policies: PoliciesConfig) -> list[str]:
    problems = []
    names = [entry.partition("=")[0] for entry in policies.models]
    for entry in policies.models:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            problems.append(f"policies.models entry {entry!r} is not NAME=PATH")
    if len(set(names)) != len(names):
        problems.append("policies.models names two policies alike")
    if policies.max_queued_rows < policies.max_batch:
        problems.append("policies.max_queued_rows must be >= policies.max_batch")
    if policies.max_batch < 1:
        problems.append("policies.max_batch must be >= 1")
    if policies.flush_us < 0:
        problems.append("policies.flush_us must be >= 0")
    if policies.episode_ttl_s <= 0 or policies.max_episodes < 1:
        problems.append("policies.episode_ttl_s must be > 0 and policies.max_episodes >= 1")
    if policies.lm is False and not policies.models:
        problems.append("policies.lm false needs at least one policies.models entry (else nothing is served)")
    return problems


def parse_args(argv: Sequence[str] | None = None, *, prog: str = "parallm-launch",
               description: str = "") -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_cli_options(parser)
    namespace = parser.parse_args(argv)
    try:
        config = build_config(file=namespace.config, cli=cli_overrides(namespace))
    except ConfigError as exc:
        parser.error(str(exc))
    return config, namespace


TRAINER_ENV_PREFIX = ENV_PREFIX + "TRAINER__"


def build_trainer_config(*, file: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None,
                         cli: dict | None = None) -> TrainerConfig:
    """`parallm-train`'s settings: defaults < TOML file < PARALLM_TRAINER__* env < CLI. The file is
    either a trainer file ([server], [model], [lora], [rl_training], [checkpointing] at the top) or
    a parallm-launch file, whose [trainer] section is used."""
    environ = os.environ if environ is None else environ
    tree: dict = {}
    if file:
        try:
            tree = tomllib.loads(Path(file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {file}: {exc}") from None
        if isinstance(tree.get("trainer"), dict):
            tree = tree["trainer"]
        elif isinstance(tree.get("trainer"), list):
            if len(tree["trainer"]) != 1:
                raise ConfigError(f"config file {file} has {len(tree['trainer'])} [[trainer]] entries; parallm-train "
                                  "runs one (give it that entry as a file of its own)")
            tree = tree["trainer"][0]
    tree = _merge(tree, env_overrides(environ, TrainerConfig, TRAINER_ENV_PREFIX))
    tree = _merge(tree, cli or {})
    try:
        return msgspec.convert(_unset_autos(tree, TrainerConfig), type=TrainerConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid trainer configuration: {exc}") from None
