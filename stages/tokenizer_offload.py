"""Large tokenizations off the tokenizer stage's message loop.

A prompt that fits the context may still be large (tens of thousands of characters of text, or a long
conversation through the chat template); tokenized on the stage's loop it held every request behind it
(issue 30: a prompt of a few MB took 4-7.5 s, and three at once pushed another client's request to 20 s).
The stage hands the work of a request whose text is over LARGE_TEXT_CHARS to a worker thread here (the
tokenizers library releases the GIL while it encodes) and keeps handling small requests; what the worker
computed is sent from the loop, in the order the work finishes. The worker runs below the loop's OS
priority (parallm.threads.lower_priority), so a large prompt's tokenization takes no core from the engine
or from the small requests the loop handles.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from parallm.threads import background_worker

LARGE_TEXT_CHARS = 16_384  # characters of prompt or message text: smaller ones are tokenized on the loop (~ms)


def text_chars(value: Any) -> int:
    """Characters of text in a prompt or in chat messages (every string in them, keys excepted)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


class Offload:
    """Work running on a worker thread, each with what the loop does with its finished future."""

    def __init__(self, workers: int = 1, on_done: Callable[[Future], None] = lambda _: None) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="parallm-tokenize",
                                        initializer=background_worker)  # below the loop's priority
        self._pending: list[tuple[Future, Callable[[Future], None]]] = []
        self._on_done = on_done  # on the worker thread, as each work finishes (the stage's Waker.wake)
        self.offloaded = 0

    def submit(self, work: Callable[[], Any], then: Callable[[Future], None]) -> None:
        future = self._pool.submit(work)
        self._pending.append((future, then))
        future.add_done_callback(self._on_done)
        self.offloaded += 1

    def finish(self) -> int:
        """Run `then` of every finished work (on the caller's thread: the loop); how many finished."""
        done: list[tuple[Future, Callable[[Future], None]]] = []
        pending: list[tuple[Future, Callable[[Future], None]]] = []
        for entry in self._pending:
            (done if entry[0].done() else pending).append(entry)
        self._pending = pending
        for future, then in done:
            then(future)
        return len(done)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __len__(self) -> int:
        return len(self._pending)
