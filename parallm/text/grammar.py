"""A request's Constraint as an llguidance grammar, checked without a tokenizer.

The API process checks every constraint here before anything is queued (an unsupported JSON
Schema keyword is a 400 naming it); the engine compiles the same grammar text against the
model's tokenizer (parallm/engine/constraints.py). llguidance is imported on first use.
"""

from __future__ import annotations

import json
import logging
import re
from functools import lru_cache

from parallm.protocol import Constraint

log = logging.getLogger("parallm.grammar")
KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
JSON_OBJECT = '{"type": "object"}'
# JSON laid out as json.dumps writes it (what models were trained on); free whitespace lets a
# sampled model wander in spaces and newlines until max_tokens. A schema's own "x-guidance"
# options win (e.g. {"whitespace_flexible": true}).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names what is wrong."""


def explain(err: str) -> str:
    """llguidance's error as a client may read it: an unsupported keyword named; a Rust panic (a grammar past
    one of its internal limits; the text carried a backtrace and source paths) replaced by what it means."""
    m = re.search(r"Unimplemented keys: \[([^\]]*)\]", err)
    if m:
        keys = ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
        return f"unsupported JSON Schema keyword(s): {keys}"
    if "panicked" in err or "backtrace" in err.lower() or ".rs:" in err:
        log.warning("llguidance failed on a grammar: %s", err)
        return "the grammar is too large or too complex to compile"
    return err.strip()


# ASCII characters a choice keeps as they are inside its regex: letters, digits and punctuation that means nothing
# in a regex (nor ends the Lark /.../ it sits in); any other ASCII character is written \x{HEX}
_REGEX_PLAIN = frozenset(" _,:;'\"!@%=<>`")
_REGEX_ESCAPES = {c: "\\x{%X}" % c for c in range(128) if not (chr(c).isalnum() or chr(c) in _REGEX_PLAIN)}


def choice_grammar(choices: list[str]) -> str:
    """A Lark grammar whose one lexeme is a regex of the choices' alternation, each choice escaped to match only
    itself. llguidance's own "choice" form (`start: "a" | "b" | ...`) makes each choice a lexeme of its own, and
    its lexer and parser row grow with them: for the 2,800 choices of a 64 KiB list on SmolLM2's tokenizer that
    compiled in 17 ms (matcher and first mask) and took 8.4 ms to validate, against 5.5 and 4.9 ms as one regex
    (whose masks while decoding cost 0.17 ms a choice against 1.6). Issue 30: three such lists at once, each
    compiled on the engine's compile thread, took a core from the OpenBLAS pool for that long, and other users'
    steps waited. The same strings are accepted (tests/test_constraints.py)."""
    return "start: /" + "|".join(c.translate(_REGEX_ESCAPES) for c in choices) + "/\n"


def build_text(kind: str, value: str) -> str:
    """The llguidance grammar of a constraint, not validated (llguidance checks it again when it compiles it);
    raises GrammarError naming the problem it found."""
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
            text = choice_grammar(choices)
        else:
            if not value:
                raise GrammarError(f"the {kind} constraint is empty")
            text = llguidance.grammar_from(kind, value)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError with a message
        raise GrammarError(explain(str(exc))) from None
    return text


@lru_cache(maxsize=256)
def grammar_text(kind: str, value: str) -> str:
    """The llguidance grammar of a constraint, validated; raises GrammarError naming the problem."""
    import llguidance

    text = build_text(kind, value)
    err = llguidance.LLMatcher.validate_grammar(text)
    if err:
        raise GrammarError(explain(err))
    return text


def check_size(c: Constraint, max_bytes: int) -> None:
    """GrammarError when the constraint's text is larger than `max_bytes` (engine.max_constraint_bytes): its
    compile time grows with it (60k choices: 3.7 s), so a size past the limit is refused before any work."""
    size = len(c.value.encode())
    if max_bytes and size > max_bytes:
        raise GrammarError(f"the constraint is {size} bytes; this server accepts at most {max_bytes} "
                           "(engine.max_constraint_bytes)")


def compile_text(c: Constraint) -> str:
    """The grammar the engine compiles: not validated first (the API process validated it, and the engine's
    LLMatcher reports what is wrong: validating again cost 5-8 ms of a 64 KiB grammar's compile)."""
    return build_text(c.kind, c.value)


def check(c: Constraint) -> None:
    """Raise GrammarError if the constraint cannot be compiled. A choice list needs only to be a non-empty list of
    strings: its regex escapes every choice, so llguidance's validation (4.9 ms for a 64 KiB list, in the API
    process, on the cores the engine steps on) can find nothing in it."""
    if c.kind == "choice":
        build_text(c.kind, c.value)
    else:
        grammar_text(c.kind, c.value)


def grammar_kind(text: str) -> str:
    """vLLM's `grammar` field holds Lark or GBNF: GBNF rules are written with `::=`."""
    return "gbnf" if "::=" in text else "lark"
