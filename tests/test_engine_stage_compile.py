"""Issue 30: a request's grammar compiles off the engine stage's loop (parallm/engine/compile_queue.py).

Before, `Engine.add_request` compiled it on the loop: a 60k-choice list held every other request's next
token for 3.7 s. A compile is made slow here on purpose (a real one of that size takes seconds too, but
the tiny vocabulary compiles anything fast), and the stage must keep stepping other requests meanwhile."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
import zmq

from parallm import protocol
from parallm.config import build_config
from parallm.engine.compile_queue import CompileQueue
from parallm.engine.constraints import Constraints
from parallm.runtime import StageRuntime
from parallm.stages.engine import EngineStage, warm_up
from parallm.text.grammar import GrammarError
from parallm.threads import BACKGROUND_NICE
from parallm.transport import Receiver, open_socket
from tests._engine_helpers import tiny_model
from tests.test_constraints import EOS, char_tokenizer, engine_on, text_of

SLOW_S = 1.0
CHOICE = protocol.Constraint(kind="choice", value=json.dumps(["yes", "no"]))


def slow(constraints: Constraints, seconds: float) -> None:
    compile_now = constraints._compile

    def compile_slowly(c):
        time.sleep(seconds)
        return compile_now(c)

    constraints._compile = compile_slowly


def submit(rid: str, constraint: protocol.Constraint | None = None, max_tokens: int = 4) -> protocol.Submit:
    params = protocol.SamplingParams(max_tokens=max_tokens, temperature=0.0, constraint=constraint)
    return protocol.Submit(rid=rid, reply_to=b"c", prompt_ids=protocol.pack_ids([5, 6, 7]),
                           spec=protocol.RequestSpec(params=params))


@pytest.fixture
def stage(tmp_path):
    config = build_config(environ={}, overrides={"transport": {"run_dir": str(tmp_path)},
                                                 "engine": {"constraint_timeout_s": 60.0}})
    ctx = zmq.Context()
    rt = StageRuntime(config, "engine", ctx=ctx)
    detok = Receiver(open_socket(ctx, zmq.PULL, rt.addrs.detok, bind=True), protocol.DetokInbound)
    engine = engine_on(tiny_model("llama"))
    s = EngineStage(config, rt, engine, {})
    s.detok = detok
    yield s
    ctx.destroy(0)


def outputs(stage: EngineStage, rid: str) -> list:
    """The outputs and errors of request `rid` sent so far (every other message read and dropped)."""
    got = []
    while (m := stage.detok.recv(timeout_ms=50)) is not None:
        got.extend(o for o in getattr(m, "outputs", []) if o.rid == rid)
        if isinstance(m, protocol.RequestError) and m.rid == rid:
            got.append(m)
    return got


def test_other_requests_decode_while_a_grammar_compiles(stage):
    slow(stage.engine.constraints, SLOW_S)
    stage.handle(submit("plain", max_tokens=200))
    t0 = time.monotonic()
    stage.handle(submit("constrained", CHOICE))
    assert time.monotonic() - t0 < SLOW_S / 2, "the loop waited for the compile"
    assert len(stage.compiling) == 1 and stage.in_flight() == 2
    steps = 0
    while stage.compiling:
        stage.send(stage.engine.step())
        stage.admit_compiled()
        steps += 1
    assert steps >= 5  # the plain request decoded while the grammar compiled
    while stage.engine.has_work():
        stage.send(stage.engine.step())
    done = outputs(stage, "constrained")
    assert not [m.message for m in done if isinstance(m, protocol.RequestError)]
    text = text_of([t for o in done for t in protocol.unpack_ids(o.token_ids)])
    assert text in ("yes", "no") and done[-1].finish_reason == "stop"
    # the compiled grammar is cached by content: the same constraint goes in at once
    t0 = time.monotonic()
    stage.handle(submit("again", protocol.Constraint(kind="choice", value=CHOICE.value)))
    assert time.monotonic() - t0 < SLOW_S / 2 and not stage.compiling and "again" in stage.engine.request_ids()


def test_a_grammar_that_compiles_too_long_is_refused_and_others_go_on(stage):
    stage.compiling.timeout_s = 0.2
    slow(stage.engine.constraints, SLOW_S)
    stage.handle(submit("plain", max_tokens=50))
    stage.handle(submit("slow", CHOICE))
    t0 = time.monotonic()
    while stage.compiling:
        stage.send(stage.engine.step())
        stage.admit_compiled()
    assert time.monotonic() - t0 < SLOW_S
    assert "slow" not in stage.engine.request_ids()
    [error] = outputs(stage, "slow")
    assert (error.status, error.code, error.param) == (400, "constraint_too_complex", "constraint")


def test_a_bad_grammar_is_refused_with_its_error_and_the_failure_cached(stage):
    bad = protocol.Constraint(kind="regex", value="(unclosed")
    stage.handle(submit("bad", bad))
    while stage.compiling:
        stage.admit_compiled()
        time.sleep(0.01)
    [error] = [m for m in outputs(stage, "bad") if isinstance(m, protocol.RequestError)]
    assert error.status == 400 and error.param == "constraint"
    assert stage.engine.constraints.cached(bad) and not stage.compiling.needs(bad)


def test_an_oversized_constraint_is_refused_before_any_compile():
    constraints = Constraints(8, [0])
    queue: CompileQueue = CompileQueue(constraints, 1.0, max_bytes=100)
    big = protocol.Constraint(kind="choice", value=json.dumps(["x" * 20] * 10))
    assert not queue.needs(big)  # add_request refuses it at once (engine.max_constraint_bytes)
    from parallm.text.grammar import check_size
    with pytest.raises(GrammarError, match="at most 100"):
        check_size(big, 100)


def test_a_rust_panic_is_not_shown_to_the_client():
    from parallm.text.grammar import explain

    panic = "thread '<unnamed>' panicked at src/earley/regexvec.rs:405:9:\nassertion failed\nstack backtrace:\n 0: ..."
    assert explain(panic) == "the grammar is too large or too complex to compile"
    assert explain("Unimplemented keys: [\"foo\"]") == "unsupported JSON Schema keyword(s): foo"


def with_tokenizer_source(engine, source) -> None:
    """The engine's constraints, their llguidance tokenizer built by `source` when first needed."""
    engine.constraints = engine.runner.constraints = Constraints(engine.vocab_size, [EOS], source,
                                                                 thinking=lambda: None)


def test_the_grammar_tokenizer_is_built_at_start_beside_the_warm_up(stage):
    """Built when a first grammar compiled, the llguidance tokenizer (0.6-0.9 s for SmolLM2's 49k tokens on a
    CPU, holding the GIL) held every running row's next token: a canary's p99 2.2-3.1x its idle p99 beside a
    first 64 KiB constraint. The stage's warm-up builds it on the compile thread before it serves."""
    builds: list[str] = []

    def source():
        builds.append(threading.current_thread().name)
        return char_tokenizer()

    with_tokenizer_source(stage.engine, source)
    stage.compiling.constraints = stage.engine.constraints
    warm_up(stage.engine)
    assert len(builds) == 1 and builds[0].startswith("parallm-grammar")
    stage.handle(submit("plain", max_tokens=30))
    stage.handle(submit("constrained", CHOICE))
    while stage.compiling:
        stage.send(stage.engine.step())
        stage.admit_compiled()
    while stage.engine.has_work():
        stage.send(stage.engine.step())
    done = outputs(stage, "constrained")
    assert text_of([t for o in done for t in protocol.unpack_ids(o.token_ids)]) in ("yes", "no")
    assert len(builds) == 1  # not built again for the first grammar


def test_a_model_without_a_usable_tokenizer_refuses_constraints_with_a_400(stage):
    def missing():
        raise FileNotFoundError("/models/x/tokenizer.json")

    with_tokenizer_source(stage.engine, missing)
    stage.compiling.constraints = stage.engine.constraints
    warm_up(stage.engine)  # logged, not fatal
    stage.handle(submit("constrained", CHOICE))
    while stage.compiling:
        stage.admit_compiled()
        time.sleep(0.01)
    [error] = [m for m in outputs(stage, "constrained") if isinstance(m, protocol.RequestError)]
    assert (error.status, error.param) == (400, "constraint")
    assert "tokenizer cannot be used for grammar constraints" in error.message and "/models" not in error.message


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")
def test_requests_grammars_compile_below_the_step_loops_priority():
    """Issue 30: a compile on the engine's own compile thread took a core from the step (the OpenBLAS governor counts
    only other processes), and a canary beside three 64 KiB grammars at once waited 0.6-0.8 s on a 3-token pass."""
    constraints = Constraints(64, [EOS])
    constraints.use_tokenizer(char_tokenizer())
    seen: list[int] = []
    compile_now = constraints._compile

    def compile_and_look(c):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return compile_now(c)

    constraints._compile = compile_and_look
    constraints.compile_later(CHOICE, time.monotonic() + 5).result(5)
    assert seen == [min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + BACKGROUND_NICE)]


def test_a_requests_compile_runs_inside_the_background_hook_and_a_cached_one_does_not():
    """Issue 30: the engine stage gives Constraints its OpenBLAS governor's `background`, so that the pool leaves a
    compiling grammar a core (a nice level alone did not: the compile thread still used 110-136 ms of CPU in a
    one-row step that took 150-280 ms instead of 30)."""
    constraints = Constraints(64, [EOS])
    constraints.use_tokenizer(char_tokenizer())
    events: list[str] = []
    compile_now = constraints._compile

    class Hook:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    def compile_and_note(c):
        events.append("compile")
        return compile_now(c)

    constraints._compile = compile_and_note
    constraints.background = Hook
    constraints.compile_later(CHOICE, time.monotonic() + 5).result(5)
    assert events == ["enter", "compile", "exit"]
    constraints.compile_later(CHOICE, time.monotonic() + 5).result(5)  # cached: no core taken
    assert events == ["enter", "compile", "exit"]
