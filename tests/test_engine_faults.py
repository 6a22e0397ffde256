"""A pass that raises ends only the requests it concerns (parallm/engine/faults.py): a prompt whose
prefill fails ends with finish_reason "error" while the prompts computed with it and the running rows
go on with mlx-lm's greedy tokens, and no KV block leaks (the `engines` fixture checks at teardown)."""

import pytest

from parallm.engine import make_request

from _engine_helpers import greedy, reference_greedy, run_all, tiny_model, tracked_engine


def poison(engine, rid: str, method: str) -> list[int]:
    """Make engine.runner.<method> raise for every pass that holds a prompt of request `rid`; returns
    the list that counts the failures."""
    real = getattr(engine.runner, method)
    failures: list[int] = []

    def failing(*args):
        work = args[-1] if method == "prefill" else args[3]
        if any(s.rid == rid for s in work.seqs):
            failures.append(len(work.seqs))
            raise RuntimeError("injected: a kernel failed on this prompt")
        return real(*args)

    setattr(engine.runner, method, failing)
    return failures


@pytest.mark.parametrize("mixed", [False, True])
def test_a_failing_prompt_ends_alone(engines, mixed):
    model = tiny_model("llama")
    running = {f"r{i}": [1 + i, 5, 9, 2 + i, 7, 3][: 4 + i % 3] for i in range(3)}
    late = {"bad": [4, 8, 15, 16, 23, 42], "r3": [3, 1, 4, 1, 5], "r4": [2, 7, 1, 8]}
    engine = tracked_engine(engines, model, mixed_passes=mixed, max_prefill_rows=8)
    mixed_failures = poison(engine, "bad", "mixed") if mixed else []
    prefill_failures = poison(engine, "bad", "prefill")
    results = run_all(engine, [make_request(rid, p, greedy(10)) for rid, p in running.items()],
                      arrivals={2: [make_request(rid, p, greedy(10)) for rid, p in late.items()]})
    assert results[("bad", 0)]["finish"] == "error" and results[("bad", 0)]["tokens"] == []
    # the three late prompts shared one pass (riding in the decode pass when mixed); it failed and was
    # undone, then each prompt ran alone and only "bad" failed again
    assert mixed_failures == ([3] if mixed else []) and prefill_failures == [3, 1]
    for rid, prompt in {**running, **{k: v for k, v in late.items() if k != "bad"}}.items():
        assert results[(rid, 0)]["tokens"] == reference_greedy(model, prompt, 10), rid
        assert results[(rid, 0)]["finish"] == "length"
    assert engine.failed_rows == 1
    # the engine keeps serving
    after = run_all(engine, [make_request("next", [6, 6, 6, 1], greedy(6))])
    assert after[("next", 0)]["tokens"] == reference_greedy(model, [6, 6, 6, 1], 6)
