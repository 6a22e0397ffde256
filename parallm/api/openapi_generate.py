"""POST /generate's request body in /openapi.json: a oneOf of the four formats (parallm/api/rl_shape.py).

OpenAPI's `discriminator` needs one property whose value names the schema; none of these clients
sends such a property, so the members are made to exclude each other instead, which is the rule
rl_shape.shape_of applies:
- each member forbids every field of the other formats that its own format lacks (`not` anyOf
  `required`), so a body naming fields of two formats matches no member;
- each member requires its prompt field, not null (vLLM: `prompt` or `prompt_token_ids`, one of
  them; SGLang: `input_ids` or `text`, one of them);
- MLX RL's member also requires what tells it from vLLM's: `policy_version`, `step_id` or
  `request_id`, a token-id `prompt`, or a boolean `logprobs`.
`x-parallm-format` names each member's format and `x-parallm-discriminator` lists, per format, the
fields only that format has. tests/test_generate_formats.py checks that a body matches exactly the
member shape_of picks (and none when shape_of refuses it).
"""

from __future__ import annotations

import copy
from typing import Any

from parallm.api.rl_schemas import RLSampling, TokensPrompt
from parallm.api.rl_shape import FIELD_FORMATS, FORMATS, MLX_RL_MARKERS, NAMES, PROMPT_FIELDS

GENERATION_KWARGS = frozenset(RLSampling.__struct_fields__) | {"logprobs"}  # what rl_plan.parse merges from TRL's
REFUSED = ("input_embeds",)  # images are served (docs/vision.md); embeddings as input are not
RULE = ("One route, four formats told apart by their fields (docs/rl.md, POST /generate: which format): every "
        "field must belong to the body's format; a token-id `prompt` or a boolean `logprobs` is MLX RL's, an "
        "object `prompt` vLLM's; a string `prompt` with no MLX RL field (policy_version, step_id, request_id) is "
        "vLLM's. Fields of two formats are a 400 ambiguous_generate_body.")


class GenerateBodies:
    """The `body` of the /generate RouteDocs (openapi._schema calls `schema`)."""

    types = tuple(FORMATS.values())

    def schema(self, ref: dict[Any, Any], components: dict[str, Any]) -> dict[str, Any]:
        members = [_member(shape, ref, components) for shape in FORMATS]
        only = {shape: sorted(name for name, formats in FIELD_FORMATS.items() if formats == {shape})
                for shape in FORMATS}
        return {"description": RULE, "oneOf": members, "x-parallm-discriminator": only}


def given(schema: dict[str, Any]) -> dict[str, Any]:
    """A property's schema without null: the field given."""
    alternatives = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def _non_empty(schema: Any) -> Any:
    """`schema` with every list in it (refs aside) non-empty: an empty prompt or token-id list is a 400."""
    if isinstance(schema, list):
        return [_non_empty(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _non_empty(v) for k, v in schema.items()}
    if out.get("type") == "array":
        out["minItems"] = max(1, out.get("minItems", 0))
    return out


def _one_of_fields(struct: dict[str, Any], fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """Parts requiring exactly one of `fields`, given (the others absent or null)."""
    props = struct["properties"]
    return [{"required": [name], "properties": {other: _given_field(other, props[other]) if other == name
                                                else {"type": "null"} for other in fields}} for name in fields]


def _given_field(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    if name == "input_ids":  # SGLang: one prompt's token ids, or a list of such lists (not a mix)
        ids = _non_empty(next(s for s in schema["anyOf"] if s.get("type") == "array")["items"]["anyOf"][1])
        return {"anyOf": [ids, {"type": "array", "items": ids, "minItems": 1}]}
    return _non_empty(given(schema))


def _member(shape: str, ref: dict[Any, Any], components: dict[str, Any]) -> dict[str, Any]:
    struct_type = FORMATS[shape]  # type: ignore[index]
    struct = components[struct_type.__name__]
    others = sorted(name for name, formats in FIELD_FORMATS.items() if shape not in formats)
    refused = {name: {"type": "null", "description": "not supported: a 400 naming it unless absent or null"}
               for name in REFUSED if name in struct["properties"]}
    refused["stream"] = {"type": "boolean", "enum": [False], "description": "streaming: use /v1/completions"}
    base = [ref[struct_type], {"not": {"anyOf": [{"required": [name]} for name in others]}},
            {"properties": refused}]
    fields = PROMPT_FIELDS[shape]  # type: ignore[index]
    if len(fields) > 1:
        parts = _one_of_fields(struct, fields)
    elif shape == "mlx_rl":
        prompt, logprobs = struct["properties"]["prompt"], struct["properties"]["logprobs"]
        ids = _non_empty(next(s for s in prompt["anyOf"] if s.get("type") == "array"))
        flag = next(s for s in logprobs["anyOf"] if s.get("type") == "boolean")
        parts = [*({"required": [name], "properties": {"prompt": _non_empty(prompt)}} for name in MLX_RL_MARKERS),
                 {"required": ["prompt"], "properties": {"prompt": ids}},
                 {"required": ["logprobs"], "properties": {"logprobs": flag, "prompt": _non_empty(prompt)}}]
    elif shape == "trl":
        props = struct["properties"]
        kwargs = {"type": "object", "additionalProperties": False,
                  "properties": {name: props[name] for name in sorted(GENERATION_KWARGS)}}
        parts = [{"required": ["prompts"], "properties": {"prompts": _non_empty(props["prompts"]),
                                                          "generation_kwargs": {"anyOf": [kwargs, {"type": "null"}]}}}]
    else:
        parts = [{"required": list(fields)}]
    return {"title": NAMES[shape], "x-parallm-format": shape,  # type: ignore[index]
            "allOf": [*base, parts[0] if len(parts) == 1 else {"anyOf": parts}]}


def exactly_one_prompt(components: dict[str, Any]) -> None:
    """vLLM's {prompt_token_ids} / {prompt} object takes exactly one of the two (rl_plan checks it)."""
    name = TokensPrompt.__name__
    obj = components[name]
    plain = {k: v for k, v in obj.items() if k not in ("title", "description")}
    components[name] = {k: v for k, v in obj.items() if k in ("title", "description")} | {
        "anyOf": [_merge(copy.deepcopy(plain), part) for part in _one_of_fields(obj, ("prompt_token_ids", "prompt"))]}


def _merge(obj: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    obj["properties"] = {**obj.get("properties", {}), **part.get("properties", {})}
    obj["required"] = sorted({*obj.get("required", []), *part.get("required", [])})
    return obj
