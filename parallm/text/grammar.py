"""A request's Constraint as an llguidance grammar, checked without a tokenizer.

The API process checks every constraint here before anything is queued (an unsupported JSON
Schema keyword is a 400 naming it); the engine compiles the same grammar text against the
model's tokenizer (parallm/engine/constraints.py). llguidance is imported on first use.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from parallm.protocol import Constraint

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
JSON_OBJECT = '{"type": "object"}'
# JSON laid out as json.dumps writes it (what models were trained on); free whitespace lets a
# sampled model wander in spaces and newlines until max_tokens. A schema's own "x-guidance"
# options win (e.g. {"whitespace_flexible": true}).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names what is wrong."""


def _explain(err: str) -> str:
    m = re.search(r"Unimplemented keys: \[([^\]]*)\]", err)
    if m:
        keys = ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
        return f"unsupported JSON Schema keyword(s): {keys}"
    return err.strip()


@lru_cache(maxsize=256)
def grammar_text(kind: str, value: str) -> str:
    """The llguidance grammar of a constraint; raises GrammarError naming the problem."""
    import llguidance

    if kind not in KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r}; expected one of {', '.join(KINDS)}")
    try:
        if kind == "json_object":
            text = llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT, defaults=JSON_LAYOUT)
        elif kind == "json_schema":
            try:
                schema = json.loads(value)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object")
            text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
        elif kind == "choice":
            try:
                choices = json.loads(value)
            except ValueError:
                choices = None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice needs a non-empty list of strings")
            text = llguidance.grammar_from("choice", json.dumps(choices))
        else:
            if not value:
                raise GrammarError(f"the {kind} constraint is empty")
            text = llguidance.grammar_from(kind, value)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError with a message
        raise GrammarError(_explain(str(exc))) from None
    err = llguidance.LLMatcher.validate_grammar(text)
    if err:
        raise GrammarError(_explain(err))
    return text


def compile_text(c: Constraint) -> str:
    return grammar_text(c.kind, c.value)


def check(c: Constraint) -> None:
    """Raise GrammarError if the constraint cannot be compiled."""
    grammar_text(c.kind, c.value)


def grammar_kind(text: str) -> str:
    """vLLM's `grammar` field holds Lark or GBNF: GBNF rules are written with `::=`."""
    return "gbnf" if "::=" in text else "lark"
