"""A stream that fell behind gets its waiting outputs as one: same tokens, text, logprobs and usage."""

import json

import msgspec

from parallm import protocol
from parallm.api.sse import ChunkBuilder
from parallm.api.translate import Plan

TOKENS = [(11, "Hello", -0.25, [(11, -0.25), (12, -1.5)]), (13, ",", -0.5, [(13, -0.5), (14, -2.0)]),
          (15, " world", -0.125, [(15, -0.125), (16, -3.0)]), (17, "!", -1.0, [(17, -1.0), (18, -1.25)])]


def step_outputs(rid: str = "r", index: int = 0, version: int = 3) -> list[protocol.Output]:
    """One output per engine step, as the detokenizer sends them; the last one finishes."""
    outs = []
    for k, (tid, text, lp, top) in enumerate(TOKENS):
        top_ids, top_lps = protocol.pack_top([top])
        outs.append(protocol.Output(rid=rid, index=index, token_ids=protocol.pack_ids([tid]), text=text,
                                    logprobs=protocol.pack_floats([lp]), top_ids=top_ids, top_logprobs=top_lps,
                                    tokens=[text], top_tokens=[f"t{t}" for t, _ in top], version=version))
    outs[-1].finish_reason = "length"
    outs[-1].usage = protocol.Usage(prompt_tokens=7, completion_tokens=len(TOKENS))
    return outs


def test_consecutive_outputs_of_a_sequence_merge_into_one():
    outs = step_outputs()
    outs[0].prompt_text = "the prompt"
    (merged,) = protocol.coalesce_outputs(outs)
    assert protocol.unpack_ids(merged.token_ids) == [t for t, *_ in TOKENS]
    assert merged.text == "Hello, world!"
    assert protocol.unpack_floats(merged.logprobs) == [lp for _, _, lp, _ in TOKENS]
    assert protocol.unpack_top(merged.top_ids, merged.top_logprobs, len(TOKENS)) == \
        [top for *_, top in TOKENS]
    assert merged.tokens == [text for _, text, _, _ in TOKENS] and len(merged.top_tokens) == 2 * len(TOKENS)
    assert merged.finish_reason == "length" and merged.usage.completion_tokens == 4
    assert merged.prompt_text == "the prompt" and merged.version == 3


def test_samples_versions_and_finished_outputs_stay_apart():
    a, b = step_outputs(index=0), step_outputs(index=1)
    interleaved = [x for pair in zip(a, b) for x in pair]
    assert [o.index for o in protocol.coalesce_outputs(interleaved)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [o.index for o in protocol.coalesce_outputs(a[:2] + b[:2])] == [0, 1]
    newer = step_outputs(version=4)
    merged = protocol.coalesce_outputs(step_outputs()[:2] + newer[2:])
    assert [(o.version, protocol.count_ids(o.token_ids)) for o in merged] == [(3, 2), (4, 2)]
    finished = step_outputs()
    assert len(protocol.coalesce_outputs([finished[-1], finished[0]])) == 2


def _accumulate(plan: Plan, outputs: list[protocol.Output]) -> tuple[dict, int]:
    """What an OpenAI stream accumulator ends with, and the number of events it read."""
    builder = ChunkBuilder(plan)
    chunks = [*builder.opening()]
    for out in outputs:
        chunks += builder.add(0, out)
    chunks += builder.closing()
    content, logprobs, finish, usage = "", [], None, None
    for chunk in chunks:
        body = json.loads(msgspec.json.encode(chunk))
        usage = body.get("usage") or usage
        for choice in body["choices"]:
            content += choice["delta"].get("content") or ""
            logprobs += (choice.get("logprobs") or {}).get("content") or []
            finish = choice.get("finish_reason") or finish
    return {"content": content, "logprobs": logprobs, "finish": finish, "usage": usage}, len(chunks)


def test_a_coalesced_chat_stream_accumulates_to_the_same_message():
    plan = Plan(kind="chat", id="chatcmpl-1", model="m", submits=[], stream=True, include_usage=True, logprobs=2)
    per_step, events = _accumulate(plan, step_outputs())
    coalesced, fewer = _accumulate(plan, protocol.coalesce_outputs(step_outputs()))
    assert coalesced == per_step and fewer == events - 3
    assert per_step["content"] == "Hello, world!" and len(per_step["logprobs"]) == 4
    assert [alt["logprob"] for alt in per_step["logprobs"][2]["top_logprobs"]] == [-0.125, -3.0]
