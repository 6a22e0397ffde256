"""Tool calls streamed as they are generated: the name first, then pieces of the arguments.

mlx-lm's parsers read a call's whole text, so a call could only be sent once its end marker
arrived. For the formats whose arguments are JSON text after a recognisable header (Hermes/Qwen
`<tool_call>{"name": N, "arguments": {…}}`, Llama 3 `{"name": N, "parameters": {…}}`, Mistral
`N[ARGS]{…}`, several calls in a segment included), `CallStream` reads the segment's text as it
grows: once the header and the first character of an arguments object are in, it emits the call's
first fragment (index, id, type, name, empty arguments), then each new piece of the arguments
object as it arrives, up to the brace that closes it (strings and escapes tracked). These are
OpenAI's `delta.tool_calls` fragments (vLLM streams the same shape). The arguments are the model's
own text, so the call the fragments accumulate to is the call reported whole (`streamed_calls`).
Other formats, and text that does not fit the header, are sent whole at the end marker.
"""

from __future__ import annotations

import json
from typing import Any

import regex

_JSON_HEADER = regex.compile(r'[\s;,}]*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_MISTRAL_HEADER = regex.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([\w.-]+)\s*\[ARGS\]\s*")
HEADERS = {"json_tools": _JSON_HEADER, "llama3_json": _JSON_HEADER, "mistral": _MISTRAL_HEADER}


class _Call:
    __slots__ = ("index", "id", "name", "args", "depth", "in_string", "escape", "done")

    def __init__(self, index: int, call_id: str, name: str) -> None:
        self.index, self.id, self.name = index, call_id, name
        self.args = ""
        self.depth, self.in_string, self.escape, self.done = 0, False, False, False

    def take(self, text: str) -> int:
        """Read arguments text until the object closes; returns how many characters were part of it."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    self.args += text[:i + 1]
                    return i + 1
        self.args += text
        return len(text)

    def whole(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.args}}


class CallStream:
    """One tool-call segment's incremental calls. `feed(segment_text)` (the whole text so far)
    returns new fragments; `streamed_calls` the calls begun (each whole as streamed so far)."""

    def __init__(self, parser_name: str, first_index: int, new_id: Any) -> None:
        self.header = HEADERS.get(parser_name)
        self.next_index = first_index
        self.new_id = new_id
        self.calls: list[_Call] = []
        self.pos = 0  # segment text read so far
        self.stuck = self.header is None  # the text does not fit: the rest is sent whole at the end

    @property
    def streamed_calls(self) -> list[dict[str, Any]]:
        return [c.whole() for c in self.calls]

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while not self.stuck and self.pos < len(text):
            call = self.calls[-1] if self.calls and not self.calls[-1].done else None
            if call is not None:
                n = call.take(text[self.pos:])
                out.append({"index": call.index, "function": {"arguments": text[self.pos:self.pos + n]}})
                self.pos += n
                continue
            m = self.header.match(text, self.pos, partial=True)  # (a call's closing "}" is read as its prefix)
            if m is None:
                self.stuck = True
                break
            if m.partial or m.end() >= len(text):
                break  # the header, or the first character of the arguments, is still to come
            if text[m.end()] != "{":
                self.stuck = True  # arguments that are not an object (a JSON string...): sent whole at the end
                break
            name = json.loads(f'"{m.group(1)}"') if self.header is _JSON_HEADER else m.group(1)
            call = _Call(self.next_index, self.new_id(), name)
            self.next_index += 1
            self.calls.append(call)
            out.append({"index": call.index, "id": call.id, "type": "function",
                        "function": {"name": name, "arguments": ""}})
            self.pos = m.end()
        return [f for f in out if "id" in f or f["function"]["arguments"]]
