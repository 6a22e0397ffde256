"""Request fields that constrain what is generated, to one protocol Constraint, checked here in
the API process (an unsupported JSON Schema keyword is a 400 naming it before anything is
queued), and the tool-call plan of a chat request.

Sources, at most one per request: response_format (json_object, json_schema), vLLM's
structured_outputs {json, regex, choice, grammar, json_object} and its older guided_json /
guided_regex / guided_choice / guided_grammar, TRL's structured_outputs_regex /
guided_decoding_regex, and a chat request's tool_choice "required" or a named function (the
output is then the call itself: the named function's arguments, or a JSON array of
{"name", "parameters"} as vLLM constrains "required").
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from parallm.api.errors import APIError, invalid
from parallm.api.validate import unsupported
from parallm.protocol import Constraint
from parallm.text.grammar import GrammarError, check, check_size, grammar_kind

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# structured_outputs options that change nothing here (the engine is always llguidance)
STRUCTURED_OPTIONS = ("backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                      "whitespace_pattern", "structural_tag")


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise invalid(f"{param} is not valid JSON.", param) from None
    if not isinstance(schema, (dict, bool)):
        raise invalid(f"{param} must be a JSON schema object.", param)
    return json.dumps(schema)


def _choice(value: Any, param: str) -> Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise invalid(f"{param} must be a non-empty list of strings.", param)
    return Constraint(kind="choice", value=json.dumps(value))


def _grammar(value: Any, param: str) -> Constraint:
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"{param} must be a Lark or GBNF grammar (text).", param)
    return Constraint(kind=grammar_kind(value), value=value)


def _regex(value: Any, param: str) -> Constraint:
    if not isinstance(value, str) or not value:
        raise invalid(f"{param} must be a regular expression (text).", param)
    return Constraint(kind="regex", value=value)


def _response_format(rf: Any) -> Constraint | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint(kind="json_object")
    if rf.type == "json_schema":
        js = rf.json_schema
        if not isinstance(js, dict) or "schema" not in js:
            raise invalid("response_format json_schema needs json_schema.schema (and a name).",
                          "response_format.json_schema")
        return Constraint(kind="json_schema", value=_schema_text(js["schema"], "response_format.json_schema.schema"))
    raise unsupported(f"response_format type {rf.type!r} is not supported; use text, json_object or json_schema.",
                      "response_format.type")


def _structured_outputs(so: Any) -> Constraint:
    if not isinstance(so, dict):
        raise invalid("structured_outputs must be an object with one of json, regex, choice, grammar, json_object.",
                      "structured_outputs")
    unknown = sorted(set(so) - set(STRUCTURED_KEYS) - set(STRUCTURED_OPTIONS))
    if unknown:
        raise unsupported(f"structured_outputs.{unknown[0]} is not supported.", f"structured_outputs.{unknown[0]}")
    given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise invalid("structured_outputs needs exactly one of json, regex, choice, grammar, json_object.",
                      "structured_outputs")
    key = given[0]
    param = f"structured_outputs.{key}"
    value = so[key]
    if key == "json":
        return Constraint(kind="json_schema", value=_schema_text(value, param))
    if key == "json_object":
        return Constraint(kind="json_object")
    return {"regex": _regex, "choice": _choice, "grammar": _grammar}[key](value, param)


# --------------------------------------------------------------------------- tools

@dataclass
class ToolPlan:
    """How a chat request's output becomes tool calls. mode: named (the output is the arguments of
    `name`), required (a JSON array of {"name", "parameters"}), auto / none (text; no constraint)."""

    mode: str
    name: str = ""
    names: list[str] = field(default_factory=list)

    @property
    def constrained(self) -> bool:
        return self.mode in ("named", "required")


def new_tool_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}.", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"tools[{i}].function.name must be a non-empty string.", f"tools[{i}].function.name")
        if name in out:
            raise invalid(f"two tools are named {name!r}.", f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema object.",
                          f"tools[{i}].function.parameters")
        out[name] = params
    return out


def _required_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of calls, each one of the tools; the
    tools' $defs move to the top (conflicting ones are a 400)."""
    defs: dict[str, Any] = {}
    items = []
    for name, params in functions.items():
        params = dict(params)
        for key, value in (params.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise invalid(f"tools define $defs/{key} differently; rename one.", "tools")
            defs[key] = value
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                       "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_plan(req: Any) -> tuple[ToolPlan | None, Constraint | None]:
    """The tool plan of a chat request and the constraint it needs (None for auto and none)."""
    if req.functions or req.function_call not in (None, "none", "auto"):
        raise unsupported("functions / function_call (deprecated) are not supported; use tools and tool_choice.",
                          "functions" if req.functions else "function_call")
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools.", "tool_choice")
        return None, None
    functions = _functions(req.tools)
    parallel = req.parallel_tool_calls is not False
    if choice in (None, "auto"):
        return ToolPlan("auto", names=list(functions)), None
    if choice == "none":
        return ToolPlan("none", names=list(functions)), None
    if choice == "required":
        schema = _required_schema(functions, parallel)
        return ToolPlan("required", names=list(functions)), Constraint(kind="json_schema", value=json.dumps(schema))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise invalid(f"tool_choice names {name!r}, which is not one of the tools.", "tool_choice")
        return (ToolPlan("named", name=name, names=list(functions)),
                Constraint(kind="json_schema", value=json.dumps(functions[name])))
    raise invalid("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                  "tool_choice")


def tool_calls_of(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """The calls a constrained output holds; None when it is not complete (e.g. max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.mode == "named":
        return [_call(plan.name, text)]
    if not isinstance(value, list):
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or "name" not in item:
            return None
        calls.append(_call(item["name"], json.dumps(item.get("parameters", {}))))
    return calls


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": new_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_message(plan: ToolPlan | None, text: str, finish: str | None) -> tuple[str | None, list | None, str | None]:
    """(content, tool_calls, finish_reason) of a whole chat choice."""
    if plan is None or not plan.constrained or finish != "stop":
        return text, None, finish
    calls = tool_calls_of(plan, text)
    if calls is None:
        return text, None, finish
    return None, calls, "tool_calls"


class ToolStream:
    """One streamed choice's tool calls. Named: the first text carries the call's id, type and
    name, later text is arguments fragments. Required: the text is held back and the calls go out
    whole when the choice finishes (they are known only once the array is). Deltas accumulate to
    what tool_message gives the same text (the openai SDK's stream accumulator merges by index)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held: list[str] = []
        self.call_id = ""

    def feed(self, text: str, finish: str | None) -> tuple[str | None, list | None, str | None]:
        """(content, tool_calls delta, finish_reason) of one piece."""
        plan = self.plan
        if plan.mode == "named":
            deltas = None
            if text:
                if not self.call_id:
                    self.call_id = new_tool_call_id()
                    deltas = [{"index": 0, "id": self.call_id, "type": "function",
                               "function": {"name": plan.name, "arguments": text}}]
                else:
                    deltas = [{"index": 0, "function": {"arguments": text}}]
            self.held.append(text)
            if finish == "stop" and tool_calls_of(plan, "".join(self.held)) is not None:
                finish = "tool_calls"
            return None, deltas, finish
        self.held.append(text)
        if finish is None:
            return None, None, None
        content, calls, finish = tool_message(plan, "".join(self.held), finish)
        if calls is None:
            return content or None, None, finish
        return None, [{"index": i, **c} for i, c in enumerate(calls)], finish


# --------------------------------------------------------------------------- the request's constraint

def _checked(c: Constraint, param: str, max_bytes: int) -> Constraint:
    try:
        check_size(c, max_bytes)
        check(c)
    except GrammarError as exc:
        raise unsupported(f"{param}: {exc}", param) from None
    return c


def constraint_of(req: Any, tool_constraint: Constraint | None = None, *, max_bytes: int = 0) -> Constraint | None:
    """The one constraint a request asks for (checked: at most `max_bytes` of text, 0 = any), or None; two
    sources are a 400."""
    found: list[tuple[str, Constraint]] = []
    if tool_constraint is not None:
        found.append(("tool_choice", tool_constraint))
    rf = getattr(req, "response_format", None)
    c = _response_format(rf)
    if c is not None:
        found.append(("response_format", c))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        found.append(("structured_outputs", _structured_outputs(so)))
    for name, make in (("guided_json", lambda v, p: Constraint(kind="json_schema", value=_schema_text(v, p))),
                       ("guided_regex", _regex), ("guided_choice", _choice), ("guided_grammar", _grammar),
                       ("structured_outputs_regex", _regex), ("guided_decoding_regex", _regex)):
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, make(value, name)))
    if not found:
        return None
    if len(found) > 1:
        raise invalid(f"{found[0][0]} and {found[1][0]} both constrain the output; send one.", found[1][0])
    return _checked(found[0][1], found[0][0], max_bytes)


__all__ = ["APIError", "ToolPlan", "ToolStream", "constraint_of", "new_tool_call_id", "tool_calls_of", "tool_message",
           "tool_plan"]
