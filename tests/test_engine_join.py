"""Issue 30: a request that arrives while a step's prefill pass runs rides in that step's decode pass.

Beside a client that sends short (constrained) requests back to back, a canary that arrived while the other
client's prompt was prefilled waited for that step's decode pass, then for the next step's prefill pass and
decode pass: two steps where an idle canary needs one (p99 2.2x its idle p99 on the CPU; three such clients
3.1x). `Engine.step(arrivals=...)` lets the caller add what arrived between the two passes; the new prompts
are prefilled in the decode pass (a mixed pass) and sample their first token in the same step.
"""

from __future__ import annotations

import random

import numpy as np

from _engine_helpers import TINY_VOCAB, greedy, make_engine, run_all, tiny_model, req


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TINY_VOCAB) for _ in range(n)]


def collect(results: dict, outputs: list) -> None:
    for o in outputs:
        d = results.setdefault(o.rid, {"tokens": [], "logprobs": [], "finish": None})
        d["tokens"].extend(o.token_ids)
        d["logprobs"].extend(o.logprobs or [])
        if o.finish_reason is not None:
            d["finish"] = o.finish_reason


def test_a_request_arriving_during_the_prefill_pass_gets_its_first_token_in_the_same_step():
    model = tiny_model("llama")
    engine = make_engine(model, max_prefill_tokens=64)
    other = req("other", prompt(5, 1), greedy(4, logprobs=True))
    canary = req("canary", prompt(3, 2), greedy(2, logprobs=True))
    engine.add_request(other)
    called = []

    def arrive() -> None:
        called.append(True)
        engine.add_request(canary)

    results: dict = {}
    collect(results, engine.step(emit=lambda outs: collect(results, outs), arrivals=arrive))
    assert called == [True]
    # the canary's prompt rode in the other request's decode pass: its first token is out after one step
    assert len(results["canary"]["tokens"]) == 1 and len(results["other"]["tokens"]) == 2
    assert engine.stats().mixed_passes == 1
    record = engine.trace.current.slowest[0][2]
    assert record.kind == "prefill+mixed"
    while engine.has_work():
        collect(results, engine.step())
    engine.check_integrity()
    # the same tokens and logprobs as when the canary waits for the next step
    alone = run_all(make_engine(model, max_prefill_tokens=64), [req("other", other.prompt_ids, other.params)],
                    arrivals={1: [req("canary", canary.prompt_ids, canary.params)]})
    for rid in ("other", "canary"):
        assert results[rid]["tokens"] == alone[(rid, 0)]["tokens"] and results[rid]["finish"] == "length"
        np.testing.assert_allclose(results[rid]["logprobs"], alone[(rid, 0)]["logprobs"], rtol=1e-4, atol=1e-5)


def test_nothing_joins_while_a_prompt_is_still_being_chunked_or_without_mixed_passes():
    model = tiny_model("llama")
    engine = make_engine(model, max_prefill_tokens=16)
    engine.add_request(req("long", prompt(60, 3), greedy(3)))
    long_seq = engine._requests["long"][0]
    asked = []
    while engine.has_work():
        engine.step(arrivals=lambda: asked.append(long_seq.status.name))
    # a chunked prompt keeps its share of the steps: asked once, after its last chunk (then decode steps only)
    assert asked == ["RUNNING"]
    engine.check_integrity()
    engine = make_engine(model, mixed_passes=False)  # no mixed pass to ride in: never asked
    engine.add_request(req("short", prompt(3, 4), greedy(4)))
    while engine.has_work():
        engine.step(arrivals=lambda: asked.append(None))
    assert None not in asked


def test_arrivals_that_cannot_ride_in_a_mixed_pass_are_prefilled_before_the_decode_pass():
    model = tiny_model("llama")
    engine = make_engine(model)
    engine.add_request(req("other", prompt(5, 1), greedy(4)))
    late = req("logprobs", prompt(4, 5), greedy(2, prompt_logprobs=1))  # prompt logprobs: never in a mixed pass
    results: dict = {}
    collect(results, engine.step(emit=lambda outs: collect(results, outs), arrivals=lambda: engine.add_request(late)))
    assert len(results["logprobs"]["tokens"]) == 2 and len(results["other"]["tokens"]) == 2
    assert engine.stats().mixed_passes == 0
    while engine.has_work():
        collect(results, engine.step())
    engine.check_integrity()
    assert results["logprobs"]["finish"] == "length" and len(results["other"]["tokens"]) == 4
