"""Tasks: where a trainer's prompts come from and how completions are rewarded.

The interface is Atropos-style — messages in, scores out:

    class MyTask:
        def sample(self, rng: random.Random) -> TaskPrompt: ...          # one prompt to roll out
        def score(self, conversations: list[list[dict]], infos: list[dict]) -> list[float]: ...

`score` gets whole conversations (the prompt's messages followed by one
`{"role": "assistant", "content": completion}`), one per sample of a group, and for each the
`info` its prompt carried (e.g. the expected answer) plus the sample's `finish_reason` ("stop" or
"length"), and returns one reward per conversation. A task
that can rebuild its info from the prompt text (as the built-in ones do) can also score
rollouts other clients produced, which reach the trainer without an info.

`rl_training.task` names a built-in (`arithmetic`, `length`, `json`) or `module:attr`, where
`attr` is a Task class or a factory called with `rl_training.task_args` as keyword arguments.
"""

from __future__ import annotations

import importlib
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

Conversation = list[dict[str, Any]]


@dataclass
class TaskPrompt:
    messages: Conversation
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    def sample(self, rng: random.Random) -> TaskPrompt: ...

    def score(self, conversations: Sequence[Conversation], infos: Sequence[dict[str, Any]]) -> list[float]: ...


class TaskError(ValueError):
    """A task could not be built or scored; the message says which and why."""


def _user_text(conversation: Conversation) -> str:
    return next((str(m.get("content", "")) for m in conversation if m.get("role") == "user"), "")


def _reply(conversation: Conversation) -> str:
    last = conversation[-1] if conversation else {}
    return str(last.get("content", "")) if last.get("role") == "assistant" else ""


class ArithmeticTask:
    """Integer arithmetic with a verifiable answer: 1.0 when the last integer of the reply is right."""

    QUESTION = re.compile(r"What is (-?\d+) ([+\-*]) (-?\d+)\?")

    def __init__(self, max_operand: int = 20, operators: str = "+-", terse: bool = True) -> None:
        if max_operand < 1 or not operators or set(operators) - set("+-*"):
            raise TaskError("arithmetic: max_operand must be >= 1 and operators a subset of '+-*'")
        self.max_operand, self.operators, self.terse = max_operand, operators, terse

    @staticmethod
    def _answer(a: int, op: str, b: int) -> int:
        return a + b if op == "+" else a - b if op == "-" else a * b

    def sample(self, rng: random.Random) -> TaskPrompt:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.operators)
        text = f"What is {a} {op} {b}?" + (" Reply with the number only." if self.terse else "")
        return TaskPrompt([{"role": "user", "content": text}], {"answer": self._answer(a, op, b)})

    def _expected(self, conversation: Conversation, info: dict[str, Any]) -> int | None:
        if "answer" in info:
            return int(info["answer"])
        match = self.QUESTION.search(_user_text(conversation))
        return self._answer(int(match[1]), match[2], int(match[3])) if match else None

    def score(self, conversations: Sequence[Conversation], infos: Sequence[dict[str, Any]]) -> list[float]:
        out = []
        for conversation, info in zip(conversations, infos):
            expected = self._expected(conversation, info)
            numbers = re.findall(r"-?\d+", _reply(conversation))
            out.append(1.0 if expected is not None and numbers and int(numbers[-1]) == expected else 0.0)
        return out


class LengthTask:
    """A format/length task: answer in about `target_words` words. Reward 1 - |words - target| / target,
    floored at 0, and 0 for a reply cut off by max_tokens (the model must learn to stop)."""

    TOPICS = ("the sea", "a cat", "winter", "coffee", "the moon", "trains", "music", "rain", "bread",
              "a library", "mountains", "the city", "friendship", "a garden", "the wind", "snow")
    TARGET = re.compile(r"in (\d+) words")

    def __init__(self, target_words: int = 5, topics: Sequence[str] | None = None) -> None:
        if target_words < 1:
            raise TaskError("length: target_words must be >= 1")
        self.target_words = target_words
        self.topics = tuple(topics or self.TOPICS)

    def sample(self, rng: random.Random) -> TaskPrompt:
        topic = rng.choice(self.topics)
        text = f"Describe {topic} in {self.target_words} words."
        return TaskPrompt([{"role": "user", "content": text}], {"target_words": self.target_words})

    def score(self, conversations: Sequence[Conversation], infos: Sequence[dict[str, Any]]) -> list[float]:
        out = []
        for conversation, info in zip(conversations, infos):
            if info.get("finish_reason") == "length":
                out.append(0.0)
                continue
            match = self.TARGET.search(_user_text(conversation))
            target = int(info.get("target_words") or (match[1] if match else self.target_words))
            words = len(_reply(conversation).split())
            out.append(max(0.0, 1.0 - abs(words - target) / target))
        return out


class JsonTask:
    """Exact-match JSON: 1.0 when the reply (code fences allowed) parses to the requested object,
    0.25 when it parses as JSON but differs, else 0."""

    NAMES = ("Ada", "Linus", "Grace", "Alan", "Edsger", "Barbara", "Ken", "Margaret")
    REQUEST = re.compile(r'"name" set to "([^"]*)" and "age" set to (\d+)')

    def sample(self, rng: random.Random) -> TaskPrompt:
        name, age = rng.choice(self.NAMES), rng.randint(18, 90)
        text = (f'Output a JSON object with "name" set to "{name}" and "age" set to {age}. '
                "Output only the JSON.")
        return TaskPrompt([{"role": "user", "content": text}], {"expected": {"name": name, "age": age}})

    def _expected(self, conversation: Conversation, info: dict[str, Any]) -> Any:
        if "expected" in info:
            return info["expected"]
        match = self.REQUEST.search(_user_text(conversation))
        return {"name": match[1], "age": int(match[2])} if match else None

    @staticmethod
    def _parse(reply: str) -> Any:
        text = reply.strip()
        fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)
        if fenced:
            text = fenced[1]
        try:
            return json.loads(text)
        except ValueError:
            return _NOT_JSON

    def score(self, conversations: Sequence[Conversation], infos: Sequence[dict[str, Any]]) -> list[float]:
        out = []
        for conversation, info in zip(conversations, infos):
            parsed = self._parse(_reply(conversation))
            expected = self._expected(conversation, info)
            out.append(0.0 if parsed is _NOT_JSON else 1.0 if parsed == expected else 0.25)
        return out


_NOT_JSON = object()

BUILTIN: dict[str, Callable[..., Task]] = {"arithmetic": ArithmeticTask, "length": LengthTask, "json": JsonTask}


def load_task(spec: str, args: dict[str, Any] | None = None) -> Task:
    """A built-in task by name, or `module:attr` (a Task class or factory) called with `args`."""
    args = dict(args or {})
    if spec in BUILTIN:
        factory: Any = BUILTIN[spec]
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise TaskError(f"task {spec!r}: {exc}") from None
    else:
        raise TaskError(f"unknown task {spec!r}: give one of {', '.join(BUILTIN)} or 'module:callable'")
    try:
        task = factory(**args) if callable(factory) else factory
    except TypeError as exc:
        raise TaskError(f"task {spec!r} rejected its arguments {args}: {exc}") from None
    if not isinstance(task, Task):
        raise TaskError(f"task {spec!r} gave {type(task).__name__}, which lacks sample(rng) and "
                        "score(conversations, infos)")
    return task


def score_group(task: Task, conversations: Sequence[Conversation], infos: Sequence[dict[str, Any]]) -> list[float]:
    """The task's rewards, checked: one finite number per conversation."""
    rewards = task.score(conversations, infos)
    try:
        values = [float(r) for r in rewards]
    except (TypeError, ValueError):
        raise TaskError(f"the task's score() returned {rewards!r}, not numbers") from None
    if len(values) != len(conversations):
        raise TaskError(f"the task's score() returned {len(values)} rewards for {len(conversations)} conversations")
    if any(v != v or v in (float("inf"), float("-inf")) for v in values):
        raise TaskError(f"the task's score() returned a non-finite reward: {values}")
    return values
