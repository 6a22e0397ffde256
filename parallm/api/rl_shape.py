"""Which client's format a POST /generate body is in (docs/rl.md, "POST /generate: which format").

Four formats share the route: vLLM's /generate (Atropos' "vllm" type), TRL's `trl vllm-serve`,
the MLX RL Inference Server's and SGLang's native one. A body's format follows from the fields it
names, never from their order or a guess:
- every field the body names must be a field of its format (the request structs in rl_schemas are
  the lists; a field no format defines, such as `model` or slime's `return_routed_experts`, is
  ignored as before);
- two values narrow it further: a `prompt` that is a non-empty list of token ids is MLX RL's, one
  that is an object or a list of strings/objects is vLLM's; `logprobs` true/false is MLX RL's
  (vLLM's and TRL's are a count).
When only vLLM and MLX RL are left (a string prompt with shared sampling fields) the body is
vLLM's: an MLX RL body shows itself by `policy_version`, `step_id` or `request_id` (the MLX RL
README's example sends all three), a token-id prompt or a boolean `logprobs`. Nothing left (fields
of two formats) is a 400 `ambiguous_generate_body` naming each field's formats; a body without its
format's prompt field is a 400 naming it. /openapi.json states the same rule as a oneOf whose
members exclude each other (parallm/api/openapi_generate.py); tests/test_generate_formats.py holds
the two to each other.
"""

from __future__ import annotations

from typing import Any

from parallm.api.errors import APIError
from parallm.api.rl_schemas import (MlxRlGenerateRequest, Shape, SglangGenerateRequest, TrlGenerateRequest,
                                    VllmGenerateRequest)

FORMATS: dict[Shape, type] = {"vllm": VllmGenerateRequest, "trl": TrlGenerateRequest,
                              "mlx_rl": MlxRlGenerateRequest, "sglang": SglangGenerateRequest}
NAMES: dict[Shape, str] = {"vllm": "vLLM", "trl": "TRL", "mlx_rl": "MLX RL", "sglang": "SGLang"}
# the fields that carry the prompt: a body of the format has one of them, not null
PROMPT_FIELDS: dict[Shape, tuple[str, ...]] = {"vllm": ("prompt", "prompt_token_ids"), "trl": ("prompts",),
                                               "mlx_rl": ("prompt",), "sglang": ("input_ids", "text")}
MLX_RL_MARKERS = ("policy_version", "step_id", "request_id")
ALL: frozenset[Shape] = frozenset(FORMATS)
# field name -> the formats whose request struct has it
FIELD_FORMATS: dict[str, frozenset[Shape]] = {
    name: frozenset(s for s, struct in FORMATS.items() if name in struct.__struct_fields__)
    for struct in FORMATS.values() for name in struct.__struct_fields__}


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def formats_of(name: str, value: Any) -> frozenset[Shape]:
    """The formats a body naming `name` with `value` can be in (ALL for a field no format defines)."""
    formats = FIELD_FORMATS.get(name, ALL)
    if name == "prompt":
        if _token_ids(value):
            return frozenset({"mlx_rl"})
        if isinstance(value, dict) or (isinstance(value, list) and any(isinstance(p, (str, dict)) for p in value)):
            return frozenset({"vllm"})
    if name == "logprobs" and isinstance(value, bool):
        return formats & {"mlx_rl"}
    return formats


def _names(formats: frozenset[Shape]) -> str:
    return ", ".join(NAMES[s] for s in FORMATS if s in formats)


def _mixed(narrowing: list[tuple[str, frozenset[Shape]]]) -> APIError:
    """A 400 naming the fewest fields whose formats have nothing in common."""
    left, named = set(ALL), []
    for name, formats in sorted(narrowing, key=lambda item: len(item[1])):
        if not left <= formats:
            named.append((name, formats))
            left &= formats
        if not left:
            break
    fields = ", ".join(f"{name} ({_names(formats) or 'no format with this value'})" for name, formats in named)
    return APIError(400, f"This /generate body mixes the fields of different formats: {fields}. Send the fields "
                    "of one format: vLLM, TRL, MLX RL or SGLang (docs/rl.md, POST /generate: which format).",
                    param=named[-1][0], code="ambiguous_generate_body")


def _has_prompt(body: dict[str, Any], shape: Shape) -> bool:
    return any(body.get(name) is not None for name in PROMPT_FIELDS[shape])


def shape_of(body: dict[str, Any]) -> Shape:
    """The format of a /generate body (see the module docstring); an APIError 400 when it has none."""
    left = set(ALL)
    narrowing: list[tuple[str, frozenset[Shape]]] = []
    for name, value in body.items():
        formats = formats_of(name, value)
        if formats != ALL:
            narrowing.append((name, formats))
            left &= formats
    if not left:
        raise _mixed(narrowing)
    shape: Shape = "vllm" if "vllm" in left else next(s for s in FORMATS if s in left)
    if _has_prompt(body, shape):
        return shape
    if len(left) == 1:
        marked = next((name for name, formats in narrowing if formats == {shape}), narrowing[-1][0])
        wanted = " or ".join(PROMPT_FIELDS[shape])
        raise APIError(400, f"This /generate body is in {NAMES[shape]}'s format (it has {marked}), which needs "
                       f"{wanted} (not null).", param=PROMPT_FIELDS[shape][0], code="missing_required_parameter")
    raise APIError(400, "Missing the prompt: a /generate body gives prompt or prompt_token_ids (vLLM), prompts (TRL), "
                   "prompt with policy_version, step_id or request_id (MLX RL), or input_ids or text (SGLang).",
                   param="prompt", code="missing_required_parameter")
