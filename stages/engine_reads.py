"""Adapter and weight directories named by path are read off the engine's step loop.

Loading an adapter or a full-weight update from a directory read its files on the stage's loop: a file on
a slow disk or mount (or one that never ends) held every other request's next token for as long as the
read took, up to the 30 s file timeout (issue 30). The stage parks such a message here instead: a reader
thread reads the files through once (parallm.files.prefetch_regular: regular files only, within the
timeout), bringing them into the page cache, while the loop keeps stepping; once read, the loop loads
them as before, from memory. A read that fails or times out is answered with the error (the load is not
tried again on the loop). Messages are handed back in arrival order, so versions load in the order sent.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Generic, TypeVar

from parallm.files import DEFAULT_TIMEOUT_S, UnsafeFile, prefetch_regular
from parallm.threads import background_worker

T = TypeVar("T")


class FileReads(Generic[T]):
    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, on_done: Callable[[Future], None] = lambda _: None) -> None:
        self.timeout_s = timeout_s
        self._on_done = on_done  # on the reader thread, as each read finishes (the stage's Waker.wake)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="parallm-file-read",
                                        initializer=background_worker)  # below the step loop's priority
        self._queue: list[tuple[T, Future]] = []
        self.read_bytes = 0

    def add(self, message: T, files: Callable[[], list[Path]]) -> None:
        """Read the files `files()` names (called on the reader thread) before `message` is handed back."""
        future = self._pool.submit(lambda: prefetch_regular(files(), timeout_s=self.timeout_s))
        self._queue.append((message, future))
        future.add_done_callback(self._on_done)

    def take(self) -> list[tuple[T, str | None]]:
        """Messages whose files were read, in arrival order (stopping at the first still being read), each
        with None or why its read failed (UnsafeFile's text; other errors are left to the load, which
        names them as it always did)."""
        done: list[tuple[T, str | None]] = []
        while self._queue and self._queue[0][1].done():
            message, future = self._queue.pop(0)
            exc = future.exception()
            if exc is None:
                self.read_bytes += future.result()
            done.append((message, str(exc) if isinstance(exc, UnsafeFile) else None))
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __len__(self) -> int:
        return len(self._queue)


def adapter_files(path: str) -> list[Path]:
    """The files of an adapter directory (or the directory of a file in it) that a load reads."""
    from parallm.adapters.formats import CONFIG_FILE, MLX_FILE, PEFT_FILE

    p = Path(path)
    if p.is_file():
        p = p.parent
    return [f for f in (p / CONFIG_FILE, p / MLX_FILE, p / PEFT_FILE) if f.exists()]


def weight_files(path: str) -> list[Path]:
    """The *.safetensors files of a weight directory (none when it is not one: the load says why)."""
    root = Path(path)
    return sorted(root.glob("*.safetensors")) if root.is_dir() else []
