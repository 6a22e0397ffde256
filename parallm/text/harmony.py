"""gpt-oss output in OpenAI's harmony format, split into reasoning, content and tool calls.

mlx-lm (0.32) has no harmony parser, and the openai-harmony package needs its o200k_harmony
vocabulary file (a download), so this reads the text itself, per the format's specification
(openai/harmony v0.0.8, docs/format.md, "Message format", "Reasoning", "Receiving tool calls",
"Preambles"): the model writes messages `[<|start|>assistant]<|channel|>{channel}[ to={recipient}]
[ <|constrain|>{type}]<|message|>{content}` ended by `<|end|>`, `<|call|>` or `<|return|>` (the
first message's `<|start|>assistant` is the prompt's end; the recipient may also follow the role).

- `analysis` (chain of thought, and built-in tools such as `browser.search` or `python`) → reasoning;
- `commentary` with `to=functions.NAME` → a tool call NAME whose arguments are the message's content
  (streamed: the name fragment when `<|message|>` arrives, then pieces of the arguments);
- `final`, and a `commentary` preamble without a recipient → content.

The markers are special tokens; they reach the splitter through kept_special_ids like any marker.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from parallm.text.segments import MarkerSplitter

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class HarmonySplitter:
    """Streamed harmony text -> Split(content, reasoning, tool_calls, tool_call_deltas), with the
    interface of assistant.AssistantSplitter. `calls`: whether `functions.*` recipients become tool
    calls (the request parses tool calls); otherwise their content is content."""

    name = "harmony"

    def __init__(self, split_type: Callable[[], Any], new_id: Callable[[], str], *, calls: bool = True) -> None:
        self._split = split_type
        self._new_id = new_id
        self.calls = calls
        transitions = {"header": [("<|message|>", "body")], "body": [(m, "between") for m in _ENDS],
                       "between": [("<|start|>", "header")]}
        self._sm = MarkerSplitter(transitions, "header")
        self._header = ""
        self._to = "content"  # where the body goes: content, reasoning or call
        self._call: dict[str, Any] | None = None
        self._count = 0

    # the interface kept_special_ids and the detokenizer read
    parser = None
    thinking = None
    markers = MARKERS

    def feed(self, text: str) -> Any:
        out = self._split()
        for state, piece in self._sm.feed(text):
            self._route(out, state, piece)
        return out

    def finish(self) -> Any:
        out = self._split()
        for state, piece in self._sm.flush():
            self._route(out, state, piece)
        if self._sm.state == "body":
            self._close(out)  # the stop token (<|return|>, <|call|>) is not in the text
        elif self._header and "<|channel|>" not in self._header:
            out.content += self._header  # text outside any message (e.g. a constraint from the first token)
            self._header = ""
        return out

    def _route(self, out: Any, state: str, piece: str) -> None:
        if state == "header":
            self._header += piece
        elif state == "body":
            if self._header is not None:
                self._open(out)
            if piece:
                self._body(out, piece)
        elif self._header is None:  # a body just ended
            self._close(out)

    def _open(self, out: Any) -> None:
        """`<|message|>` arrived: the header says where the body goes."""
        header, self._header = self._header, None
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        channel_name = channel.group(1) if channel else ""
        to = recipient.group(1) if recipient else ""
        if to.startswith("functions.") and self.calls:
            self._to = "call"
            self._call = {"index": self._count, "id": self._new_id(), "type": "function",
                          "function": {"name": to[len("functions."):], "arguments": ""}}
            self._count += 1
            out.tool_call_deltas.append({**self._call, "function": dict(self._call["function"])})
        elif channel_name == "analysis" or (to and not to.startswith("functions.")):
            self._to = "reasoning"
        else:
            self._to = "content"

    def _body(self, out: Any, piece: str) -> None:
        if self._to == "call":
            assert self._call is not None
            self._call["function"]["arguments"] += piece
            out.tool_call_deltas.append({"index": self._call["index"], "function": {"arguments": piece}})
        elif self._to == "reasoning":
            out.reasoning += piece
        else:
            out.content += piece

    def _close(self, out: Any) -> None:
        if self._header is None and self._to == "call" and self._call is not None:
            call = self._call
            out.tool_calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
        self._call = None
        self._header = ""
