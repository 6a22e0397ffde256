"""An assistant's generated text split into reasoning, content and tool calls.

Thinking segments (`<think>…</think>` and the other markers mlx-lm knows) become reasoning; the
model's tool-call syntax becomes calls, parsed by mlx-lm's own parsers (`mlx_lm.tool_parsers`,
loaded without importing mlx) plus parallm's Llama-3 JSON parser, which mlx-lm lacks. The parser
and the thinking markers are chosen from the chat template and the vocabulary the way mlx-lm's
tokenizer_utils chooses them (tables copied: that module imports mlx). A call is emitted whole
once its end marker (or the end of the text) arrives, as mlx_lm.server streams it. Markers that
are special tokens reach the split although skip_special_tokens hides the others
(kept_special_ids).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
import types
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Container

from parallm.config import TOOL_CALL_PARSERS
from parallm.text.harmony import HarmonySplitter
from parallm.text.segments import MarkerSplitter
from parallm.text.tool_stream import CallStream

# mlx-lm's _infer_tool_parser order: (parser, test on the chat template)
_TEMPLATE_RULES: list[tuple[str, Callable[[str], bool]]] = [
    ("harmony", lambda t: "<|channel|>" in t and "<|message|>" in t),  # gpt-oss (parallm's: text/harmony.py)
    ("minimax_m2", lambda t: "<minimax:tool_call>" in t),
    ("gemma4", lambda t: "<|tool_call>" in t and "<tool_call|>" in t),
    ("function_gemma", lambda t: "<start_function_call>" in t),
    ("longcat", lambda t: "<longcat_tool_call>" in t),
    ("glm47", lambda t: "<arg_key>" in t),
    ("pythonic", lambda t: "<|tool_call_start|>" in t),
    ("qwen3_coder", lambda t: "<tool_call>\n<function=" in t),
    ("kimi_k2", lambda t: "<|tool_calls_section_begin|>" in t),
    ("minicpm5", lambda t: '<function name="' in t and '<param name="' in t),
    ("mistral", lambda t: "[TOOL_CALLS]" in t),
    ("muse_spark", lambda t: "<atem:function_calls>" in t),
    ("json_tools", lambda t: "<tool_call>" in t and "tool_call.name" in t),
    ("llama3_json", lambda t: "<|python_tag|>" in t or ("tools_in_user_message" in t and "parameters" in t)),
]
THINK_PAIRS = [("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"), ("<|think:start|>", "<|think:end|>")]
PARSERS = TOOL_CALL_PARSERS  # every rule's parser, and the ones only a name selects (glm47, laguna, kimi_k3)


def infer_tool_parser(chat_template: str | None, vocab: Container[str] = ()) -> str | None:
    """The tool-call parser for a model (mlx-lm's choice, plus Llama-3 JSON); None: no tool syntax."""
    t = chat_template or ""
    for name, test in _TEMPLATE_RULES:
        if test(t):
            return name
    if "<|open|>" in vocab and "<|sep|>" in vocab:
        return "kimi_k3"
    if "<|tool_call_start|>" in vocab and "<|tool_call_end|>" in vocab:
        return "pythonic"
    return None


def infer_thinking(vocab: Container[str]) -> tuple[str, str] | None:
    """The thinking markers a vocabulary has (mlx-lm's single-token pairs, then Gemma-4's)."""
    for start, end in THINK_PAIRS:
        if start in vocab and end in vocab:
            return start, end
    if "<|channel>" in vocab and "<channel|>" in vocab:
        return "<|channel>thought", "<channel|>"
    return None


# --------------------------------------------------------------------------- parsers

@dataclass(frozen=True)
class ToolParser:
    name: str
    start: str
    end: str                                       # "" = the call runs to the end of the text
    parse: Callable[[str, Any], Any]               # the text between the markers -> dict or list of dicts
    source: str = ""                               # the parser's code: the special tokens it reads are named there


def _mlx_lm_parser_module(name: str) -> Any:
    """mlx_lm.tool_parsers.<name> without running mlx_lm/__init__ (which imports mlx)."""
    pkg_name = "_parallm_mlx_lm_tool_parsers"
    pkg = sys.modules.get(pkg_name)
    if pkg is None:
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("mlx-lm is not installed, so its tool parsers are not available")
        pkg = types.ModuleType(pkg_name)
        pkg.__path__ = [spec.submodule_search_locations[0] + "/tool_parsers"]
        sys.modules[pkg_name] = pkg
    return importlib.import_module(f"{pkg_name}.{name}")


def _llama3_parse(text: str, tools: Any = None) -> Any:
    """Llama 3.x: `{"name": ..., "parameters": {...}}` (or `arguments`), one per line or `;`-joined."""
    calls = []
    for part in (p.strip() for p in text.replace(";", "\n").splitlines()):
        if not part:
            continue
        obj = json.loads(part)
        if not isinstance(obj, dict) or "name" not in obj:
            raise ValueError(f"not a tool call: {part}")
        calls.append({"name": obj["name"], "arguments": obj.get("parameters", obj.get("arguments", {}))})
    if not calls:
        raise ValueError("no tool call")
    return calls


def tool_parser(name: str) -> ToolParser:
    if name == "harmony":
        raise ValueError("harmony is split by parallm.text.harmony.HarmonySplitter, not a ToolParser")
    if name == "llama3_json":
        return ToolParser(name, "<|python_tag|>", "", _llama3_parse)
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(set(PARSERS)))}")
    mod = _mlx_lm_parser_module(name)
    try:
        source = inspect.getsource(mod)
    except (OSError, TypeError):
        source = ""
    return ToolParser(name, mod.tool_call_start, mod.tool_call_end or "", mod.parse_tool_call, source)


def new_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


def _as_calls(parsed: Any) -> list[dict[str, Any]]:
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for item in items:
        args = item.get("arguments", {})
        calls.append({"id": item.get("id") or new_call_id(), "type": "function",
                      "function": {"name": item["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return calls


# --------------------------------------------------------------------------- the split

@dataclass
class Split:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # complete calls, once complete
    tool_call_deltas: list[dict[str, Any]] = field(default_factory=list)  # OpenAI delta.tool_calls fragments

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.tool_call_deltas)


class AssistantSplitter:
    """Streamed assistant text -> content, reasoning and tool calls: each call whole once complete
    (`tool_calls`) and as the fragments a stream sends (`tool_call_deltas`: name first, then
    pieces of the arguments as they are generated where tool_stream.CallStream reads the format,
    else the whole call at its end marker), which accumulate to the whole calls.

    `thinking`: the (start, end) markers, or None; `in_reasoning`: the prompt opened a thinking
    segment (the template ended with the start marker). `parser`: the tool syntax, or None. A tool
    call's text that does not parse, and none of which was streamed, is given back as content,
    markers included."""

    def __init__(self, thinking: tuple[str, str] | None = None, parser: ToolParser | None = None, *,
                 in_reasoning: bool = False, tools: Any = None) -> None:
        tr: dict[str, list[tuple[str, str]]] = {"content": [], "reasoning": [], "tool": []}
        if thinking is not None:
            tr["content"].append((thinking[0], "reasoning"))
            tr["reasoning"].append((thinking[1], "content"))
        if parser is not None:
            tr["content"].append((parser.start, "tool"))
            if parser.end:
                tr["tool"].append((parser.end, "content"))
        self.parser, self.tools, self.thinking = parser, tools, thinking
        self.markers = tuple(m for m in (*(thinking or ()), *((parser.start, parser.end) if parser else ())) if m)
        self._sm = MarkerSplitter(tr, "reasoning" if in_reasoning and thinking else "content")
        self._call = ""
        self._stream: CallStream | None = None  # the current tool segment's incremental calls
        self._count = 0  # calls begun: the next call's index
        self._llama_bare = parser is not None and parser.name == "llama3_json"
        self._seen_text = False
        self._bare: list[str] | None = None  # llama3_json: output that began with "{", held as a possible call

    def feed(self, text: str) -> Split:
        out = Split()
        if self._llama_bare and not self._seen_text and self._sm.state == "content":
            stripped = text.lstrip()
            if stripped:
                self._seen_text = True
                if stripped.startswith("{"):
                    self._bare = []
        if self._bare is not None:
            self._bare.append(text)
            return out
        for state, piece in self._sm.feed(text):
            self._route(out, state, piece)
        return out

    def _route(self, out: Split, state: str, piece: str) -> None:
        if state == "reasoning":
            out.reasoning += piece
        elif state == "tool":
            self._call += piece
            if self._stream is None:
                assert self.parser is not None
                self._stream = CallStream(self.parser.name, self._count, new_call_id)
            if piece:
                out.tool_call_deltas += self._stream.feed(self._call)
        else:
            if self._call or self._stream is not None:
                self._end_call(out)
            out.content += piece

    def _end_call(self, out: Split) -> None:
        """The segment ended: its calls whole. The calls streamed keep the text they were streamed
        with; any further call the parser finds goes out whole (one fragment each)."""
        text, self._call = self._call, ""
        streamed = self._stream.streamed_calls if self._stream is not None else []
        self._stream = None
        assert self.parser is not None
        try:
            parsed = _as_calls(self.parser.parse(text, self.tools)) if text.strip() else []
        except Exception:  # noqa: BLE001 - a malformed call stays visible as text (unless streamed)
            if not streamed:
                out.content += self.parser.start + text + self.parser.end
                return
            parsed = []
        self._add_calls(out, streamed, parsed[len(streamed):])

    def _add_calls(self, out: Split, streamed: list[dict[str, Any]], whole: list[dict[str, Any]]) -> None:
        out.tool_calls += streamed + whole
        out.tool_call_deltas += [{"index": self._count + len(streamed) + i, **c} for i, c in enumerate(whole)]
        self._count += len(streamed) + len(whole)

    def finish(self) -> Split:
        """What the end of the text completes: held-back text, an open call (Mistral, Llama-3)."""
        out = Split()
        if self._bare is not None:
            text, self._bare = "".join(self._bare), None
            try:
                self._add_calls(out, [], _as_calls(_llama3_parse(text)))
            except Exception:  # noqa: BLE001 - plain JSON content, not a call
                out.content = text
            return out
        for state, piece in self._sm.flush():
            self._route(out, state, piece)
        if self._sm.state == "tool" or self._call or self._stream is not None:
            self._end_call(out)
        return out


# Keyed by the view object itself, weakly: an id() key outlives its view, and a later view given the
# same id (another tokenizer or template) would read the dead one's markers.
_MODEL_SYNTAX: weakref.WeakKeyDictionary[Any, tuple[tuple[str, str] | None, str | None]] = weakref.WeakKeyDictionary()
_KEPT: weakref.WeakKeyDictionary[Any, dict[tuple, frozenset[int]]] = weakref.WeakKeyDictionary()


def kept_special_ids(tok: Any, splitter: AssistantSplitter) -> frozenset[int]:
    """The special tokens the split must see although `skip_special_tokens` hides the others:
    those whose text is (part of) a thinking or tool-call marker (Mistral's `[TOOL_CALLS]`,
    Llama 3's `<|python_tag|>`) or that the tool parser's code names (Mistral's `[ARGS]`, Kimi's
    `<|tool_call_begin|>`). They reach the splitter, which consumes the markers, so `content`
    still shows no special token."""
    parser, thinking = splitter.parser, splitter.thinking
    key = (parser.name if parser else getattr(splitter, "name", None), thinking)
    per_view = _KEPT.setdefault(tok, {})
    kept = per_view.get(key)
    if kept is None:
        markers = splitter.markers
        source = parser.source if parser else ""
        kept = frozenset(i for i in tok.special_ids if (text := tok.added.get(i))
                         and (any(text in m for m in markers) or text in source))
        per_view[key] = kept
    return kept


def model_syntax(tok: Any) -> tuple[tuple[str, str] | None, str | None]:
    """(thinking markers, tool parser name) of a TokenizerView's model, inferred once per view."""
    found = _MODEL_SYNTAX.get(tok)
    if found is None:
        vocab = set(tok.added.values())
        template = tok.chat_template
        if isinstance(template, dict):  # several named templates
            template = "\n".join(str(v) for v in template.values())
        found = _MODEL_SYNTAX[tok] = (infer_thinking(vocab), infer_tool_parser(template, vocab))
    return found


def splitter_for(tok: Any, spec: Any, prompt_ids: list[int]) -> AssistantSplitter | HarmonySplitter:
    """The splitter of a request (DetokSpec.assistant): the model's thinking markers, and its tool
    parser when the request parses tool calls (spec.tool_parser "auto" or a name). A harmony model
    (gpt-oss) has its own, which splits its reasoning whether or not tool calls are parsed."""
    thinking, inferred = model_syntax(tok)
    name = inferred if spec.tool_parser == "auto" else spec.tool_parser or None
    if name == "harmony" or (inferred == "harmony" and not spec.tool_parser):
        return HarmonySplitter(Split, new_call_id, calls=name == "harmony")
    parser = tool_parser(name) if name else None
    in_reasoning = False
    if thinking is not None and prompt_ids:
        tail = tok.decode(prompt_ids[-64:], skip_special_tokens=False)
        in_reasoning = tail.rfind(thinking[0]) > tail.rfind(thinking[1])
    return AssistantSplitter(thinking, parser, in_reasoning=in_reasoning, tools=spec.tools or None)
