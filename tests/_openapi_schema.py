"""The JSON-schema subset /openapi.json uses (msgspec's output plus parallm/api/openapi_generate.py's
oneOf): `from_schema` draws values valid for a schema (hypothesis; hypothesis-jsonschema 0.23 breaks
on current hypothesis' internals) and `matches` checks a value against one (no jsonschema package in
the test extras). Shared by tests/test_generate_formats.py and tests/e2e/test_fuzz.py."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                               max_size=4),
                    max_leaves=12)


def resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        schema = target
    return schema


def from_schema(schema: dict, root: dict, depth: int = 0) -> st.SearchStrategy:
    """Values valid for `schema` (`not` is honoured by drawing only the properties a schema names),
    refs resolved in `root`."""
    schema = resolve(schema, root)
    if "allOf" in schema:  # a struct with more fields required: merge the parts
        parts = [resolve(part, root) for part in schema["allOf"]]
        choice = next((p for p in parts if "anyOf" in p or "oneOf" in p), None)
        if choice is not None:  # allOf[A, anyOf[B, C]] = anyOf[allOf[A, B], allOf[A, C]]
            rest = [p for p in parts if p is not choice]
            return st.one_of([from_schema({"allOf": [*rest, alt]}, root, depth + 1)
                              for alt in choice.get("anyOf", choice.get("oneOf"))])
        merged: dict = {"type": "object", "properties": {}, "required": []}
        for part in parts:
            merged["properties"].update(part.get("properties", {}))
            merged["required"] += part.get("required", [])
        return from_schema(merged, root, depth + 1)
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s, root, depth + 1) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, root, depth) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind in ("integer", "number"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        if kind == "integer":
            lo = None if lo is None else int(lo) + (1 if "exclusiveMinimum" in schema else 0)
            hi = None if hi is None else int(hi) - (1 if "exclusiveMaximum" in schema else 0)
            return st.integers(lo if lo is not None else -2**40, hi if hi is not None else 2**40)
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=max(schema.get("minLength", 0), 24))
    if kind == "array":
        lo = schema.get("minItems", 0)
        if depth >= 6 and not lo:
            return st.just([])  # deep enough: an empty list is valid, a list of nulls is not
        items = from_schema(schema.get("items", {}), root, depth + 1)
        return st.lists(items, min_size=lo, max_size=min(schema.get("maxItems", lo + 3), lo + 3))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        if depth > 6:
            return st.fixed_dictionaries({k: from_schema(props[k], root, depth + 1) for k in required})
        return st.fixed_dictionaries({k: from_schema(v, root, depth + 1) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v, root, depth + 1) for k, v in props.items()
                                               if k not in required})
    return JSON


_TYPES = {"null": lambda v: v is None, "boolean": lambda v: isinstance(v, bool),
          "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "string": lambda v: isinstance(v, str), "array": lambda v: isinstance(v, list),
          "object": lambda v: isinstance(v, dict)}


def matches(value: Any, schema: dict, root: dict) -> bool:
    """Whether `value` is valid for `schema` (type, enum/const, anyOf/oneOf/allOf/not, required,
    properties, additionalProperties, items, min/max, minItems/maxItems, minLength/maxLength)."""
    schema = resolve(schema, root)
    if not all(matches(value, s, root) for s in schema.get("allOf", [])):
        return False
    if "anyOf" in schema and not any(matches(value, s, root) for s in schema["anyOf"]):
        return False
    if "oneOf" in schema and sum(matches(value, s, root) for s in schema["oneOf"]) != 1:
        return False
    if "not" in schema and matches(value, schema["not"], root):
        return False
    if "enum" in schema and value not in schema["enum"] or "const" in schema and value != schema["const"]:
        return False
    kinds = schema.get("type")
    if kinds is not None and not any(_TYPES[k](value) for k in (kinds if isinstance(kinds, list) else [kinds])):
        return False
    if _TYPES["number"](value):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            return False
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            return False
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            return False
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        if "items" in schema and not all(matches(v, schema["items"], root) for v in value):
            return False
    if isinstance(value, dict):
        if any(name not in value for name in schema.get("required", [])):
            return False
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for name, v in value.items():
            sub = props.get(name, extra)
            if sub is False or isinstance(sub, dict) and not matches(v, sub, root):
                return False
    return True
