"""A large request body is planned (decoded, checked, its grammar validated) off the ingress event loop,
on a thread below the loop's priority (issue 30: a 62 KiB tool schema's validation held the loop 32-43 ms and
took a core from the engine's step)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import pytest

from parallm.api.errors import APIError
from parallm.api.generation import LARGE_BODY_BYTES, GenerationRoutes
from parallm.api.schemas import ChatCompletionRequest
from parallm.api.translate import chat_plan
from parallm.api.validate import decode
from parallm.config import ServerConfig
from test_api_fakes import FakeBackend


def big_tool_body(properties: int = 1250, schema_type: str = "string") -> bytes:
    """perf/bench_isolation.py's tool_required_64k request: one tool of `properties` string fields, required."""
    props = {f"field_{i:05d}": {"type": schema_type} for i in range(properties)}
    return json.dumps({
        "model": "default", "messages": [{"role": "user", "content": "Fill the form."}], "max_tokens": 4,
        "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "form", "parameters": {
            "type": "object", "properties": props, "required": list(props)}}}]}).encode()


def make_chat(body: bytes, limits):
    return chat_plan(decode(body, ChatCompletionRequest), limits)


def test_a_large_tool_schemas_plan_lets_the_loop_run_while_its_grammar_is_validated():
    body = big_tool_body()
    assert len(body) >= LARGE_BODY_BYTES
    spans: list[tuple[float, float]] = []

    def timed(b: bytes, limits):
        t0 = time.perf_counter()
        try:
            return make_chat(b, limits)
        finally:
            spans.append((t0, time.perf_counter()))

    async def scenario() -> tuple[list[float], object]:
        gen = GenerationRoutes(FakeBackend(model_name="default"), ServerConfig())
        ticks: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.005)
        plan = await gen.plan(body, timed)
        done.set()
        await task
        return ticks, plan

    ticks, plan = asyncio.run(scenario())
    (start, end), = spans
    assert plan.submits[0].spec.params.constraint is not None  # the tool's grammar was built and validated
    assert end - start > 0.005, "the validation was expected to take a few ms at least"
    assert any(start < t < end for t in ticks), "the event loop did not run while the large body was planned"


def test_a_large_bodys_errors_still_come_from_its_plan():
    bad = big_tool_body(schema_type="no-such-type")
    assert len(bad) >= LARGE_BODY_BYTES

    async def scenario() -> APIError:
        gen = GenerationRoutes(FakeBackend(model_name="default"), ServerConfig())
        with pytest.raises(APIError) as caught:
            await gen.plan(bad, make_chat)
        return caught.value

    err = asyncio.run(scenario())
    assert err.status == 400 and err.param == "tool_choice"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")
def test_large_bodies_are_planned_below_the_loops_priority_and_small_ones_on_the_loop():
    from parallm.threads import BACKGROUND_NICE

    def where(body: bytes, limits) -> tuple[int, int]:
        return threading.get_ident(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def scenario() -> tuple[tuple[int, int], tuple[int, int], int]:
        gen = GenerationRoutes(FakeBackend(), ServerConfig())
        small = await gen.plan(b"x" * (LARGE_BODY_BYTES - 1), where)
        large = await gen.plan(b"x" * LARGE_BODY_BYTES, where)
        return small, large, threading.get_ident()

    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    small, large, loop_thread = asyncio.run(scenario())
    assert small == (loop_thread, loop_nice)
    assert large[0] != loop_thread and large[1] == min(19, loop_nice + BACKGROUND_NICE)
