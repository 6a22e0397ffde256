"""What the assistant-text tests share: feeding a splitter whole or in pieces, and accumulating
streamed tool-call fragments as a client does."""

from __future__ import annotations

from parallm.text.assistant import Split


def split_all(splitter, text: str, step: int | None) -> Split:
    """The splitter's output for `text` fed whole (step None) or `step` characters at a time."""
    total = Split()
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    for part in [*(splitter.feed(p) for p in pieces), splitter.finish()]:
        total.content += part.content
        total.reasoning += part.reasoning
        total.tool_calls += part.tool_calls
        total.tool_call_deltas += part.tool_call_deltas
    return total


def accumulated(deltas: list[dict]) -> list[dict]:
    """What a client accumulates (the openai SDK's stream state: strings concatenate, by index)."""
    calls: list[dict] = []
    for d in deltas:
        if d["index"] == len(calls):
            function = {"name": d["function"]["name"], "arguments": ""}
            calls.append({"id": d["id"], "type": d["type"], "function": function})
        calls[d["index"]]["function"]["arguments"] += d["function"].get("arguments", "")
    return calls
