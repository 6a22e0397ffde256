"""Issue 30: a large prompt that fits is tokenized off the tokenizer stage's loop
(stages/tokenizer_offload.py), so a small request is answered while a large one tokenizes.

The tiny test tokenizer encodes anything fast, so the large prompt's tokenization is made slow here on
purpose (a real one of a few MB takes seconds on the CPU)."""

from __future__ import annotations

import sys
import time

import pytest
import zmq
from text_tokenizers import byte_bpe

from parallm import protocol, routing
from parallm.config import build_config
from parallm.runtime import StageRuntime
from parallm.stages.tokenizer import TokenizerStage
from parallm.stages.tokenizer_offload import LARGE_TEXT_CHARS, text_chars
from parallm.text.templating import Templater
from parallm.transport import Receiver, open_socket

SLOW_S = 1.0


@pytest.fixture
def stage(tmp_path):
    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path)}})
    ctx = zmq.Context()
    rt = StageRuntime(config, "tokenizer", ctx=ctx)
    engine = Receiver(open_socket(ctx, zmq.PULL, routing.engine_address(rt.addrs, 0, config.engine), bind=True),
                      protocol.EngineInbound)
    detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
    templater = Templater(byte_bpe(), max_model_len=1_000_000)
    encode_now = templater.encode

    def encode(message):
        if len(message.prompt or "") > LARGE_TEXT_CHARS:
            time.sleep(SLOW_S)
        return encode_now(message)

    templater.encode = encode
    s = TokenizerStage(config, rt, templater)
    s.engine, s.detok = engine, detok
    yield s
    s.offload.close()
    ctx.destroy(0)


def text_submit(rid: str, prompt: str) -> protocol.TextSubmit:
    return protocol.TextSubmit(rid=rid, reply_to=b"c", prompt=prompt,
                               spec=protocol.RequestSpec(params=protocol.SamplingParams(max_tokens=4)))


def arrivals(stage: TokenizerStage, count: int, seconds: float = 10.0) -> list[tuple[str, float]]:
    """(rid, seconds) of the Submits the engine receives, in order, while the stage's loop works."""
    got, t0 = [], time.monotonic()
    while len(got) < count and time.monotonic() - t0 < seconds:
        stage.work()
        while (m := stage.engine.recv(timeout_ms=5)) is not None:
            got.append((m.rid, time.monotonic() - t0))
    return got


def test_a_small_request_goes_on_while_a_large_one_tokenizes(stage):
    t0 = time.monotonic()
    stage.handle(text_submit("large", "word " * 20_000))
    stage.handle(text_submit("small", "Hello"))
    assert time.monotonic() - t0 < SLOW_S / 2  # neither handler waited for the large tokenization
    got = arrivals(stage, 2)
    assert [rid for rid, _ in got] == ["small", "large"]
    assert got[0][1] < SLOW_S / 2 <= SLOW_S <= got[1][1] + 0.1
    assert stage.offload.offloaded == 1 and stage.in_flight() == 0


def test_a_large_request_that_does_not_fit_is_refused_from_the_worker(stage):
    stage.templater.max_model_len = 1000
    stage.handle(text_submit("large", "word " * 20_000))
    t0 = time.monotonic()
    while (m := stage.detok.recv(timeout_ms=5)) is None and time.monotonic() - t0 < 10:
        stage.work()
    assert isinstance(m, protocol.RequestError) and m.rid == "large" and m.status == 400


def test_text_chars_counts_every_string_of_the_messages():
    assert text_chars([None, [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]]) == len("usertextabc")
    assert text_chars(["x" * 10, None]) == 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")
def test_large_tokenizations_run_below_the_stage_loops_priority():
    import os
    import threading

    from parallm.stages.tokenizer_offload import Offload
    from parallm.threads import BACKGROUND_NICE

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    offload = Offload()
    got: list[int] = []
    offload.submit(nice, lambda done: got.append(done.result()))
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        offload.finish()
        time.sleep(0.01)
    offload.close()
    assert got == [min(19, nice() + BACKGROUND_NICE)]
