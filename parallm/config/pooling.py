"""The spelling of a served pooling model: `NAME[:TASK]=PATH` (model.pooling, --pooling-model) and the
tasks a pooling model serves. Here, below the pooling package, because the configuration checks
the entries where it is loaded; parallm/pooling/spec.py reads the model directories they name."""

from __future__ import annotations

TASKS = ("embed", "reward", "classify")


def parse_entry(text: str) -> tuple[str, str, str]:
    """'NAME[:TASK]=PATH' -> (name, task or '', path); PATH 'default' is the embedded all-MiniLM-L6-v2."""
    head, sep, path = text.partition("=")
    name, _, task = head.partition(":")
    name, task, path = name.strip(), task.strip(), path.strip()
    if not sep or not name or not path:
        raise ValueError(f"model.pooling entry {text!r} is not NAME=PATH or NAME:TASK=PATH")
    if task and task not in TASKS:
        raise ValueError(f"model.pooling entry {text!r}: task {task!r} is not one of {', '.join(TASKS)}")
    return name, task, path


TASK_MODELS = {"embed": "an embedding model", "reward": "a reward model", "classify": "a classifier model"}


def no_generator(model: str, task: str) -> str:
    """Why a server whose model.path is a pooling model refuses generation (ingress, the tokenizer and
    engine stages all say it in these words)."""
    return (f"this server runs no text generator: its model '{model}' is {TASK_MODELS.get(task, 'a pooling model')} "
            f"(model.task {task})")
