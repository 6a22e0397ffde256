"""Tool-call parsing and reasoning split of assistant text (parallm/text/assistant.py), on the
output formats real models emit (fixtures from mlx-lm's parsers and their tests), whole and
streamed in small pieces: the streamed split always equals the whole one."""

from __future__ import annotations

import json
import sys

import pytest

from parallm.text.assistant import AssistantSplitter, Split, infer_thinking, infer_tool_parser, tool_parser
from parallm.text.segments import MarkerSplitter

from _split_helpers import accumulated, split_all

TOOLS = [{"type": "function", "function": {"name": "multiply", "parameters": {
    "type": "object", "required": ["a", "b"], "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
A, B = 12234585, 48838483920
WANT = [("multiply", {"a": A, "b": B})]

# parser -> what the model emits for multiply(a, b)
SAMPLES = {
    "json_tools": f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {A}, "b": {B}}}}}\n</tool_call>',
    "qwen3_coder": f"<tool_call>\n<function=multiply>\n<parameter=a>\n{A}\n</parameter>\n<parameter=b>\n{B}\n"
                   f"</parameter>\n</function>\n</tool_call>",
    "mistral": f'[TOOL_CALLS]multiply[ARGS]{{"a": {A}, "b": {B}}}',
    "llama3_json": f'<|python_tag|>{{"name": "multiply", "parameters": {{"a": {A}, "b": {B}}}}}',
    "glm47": f"<tool_call>multiply<arg_key>a</arg_key><arg_value>{A}</arg_value><arg_key>b</arg_key>"
             f"<arg_value>{B}</arg_value></tool_call>",
    "minimax_m2": f'<minimax:tool_call>\n<invoke name="multiply">\n<parameter name="a">{A}</parameter>\n'
                  f'<parameter name="b">{B}</parameter>\n</invoke>\n</minimax:tool_call>',
    "pythonic": f"<|tool_call_start|>[multiply(a={A}, b={B})]<|tool_call_end|>",
    "gemma4": f"<|tool_call>call:multiply{{a:{A},b:{B}}}<tool_call|>",
    "kimi_k2": f'<|tool_calls_section_begin|><|tool_call_begin|>functions.multiply:0<|tool_call_argument_begin|>'
               f'{{"a": {A}, "b": {B}}}<|tool_call_end|><|tool_calls_section_end|>',
}


def calls(split: Split) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in split.tool_calls]


@pytest.mark.parametrize("step", [None, 1, 3, 7])
@pytest.mark.parametrize("name", SAMPLES)
def test_each_family_parses_whole_and_streamed(name, step):
    text = "<think>the user wants a product</think>" + SAMPLES[name]
    split = split_all(AssistantSplitter(("<think>", "</think>"), tool_parser(name), tools=TOOLS), text, step)
    assert calls(split) == WANT, split
    assert split.reasoning == "the user wants a product"
    assert split.content.strip() == "", split.content
    assert all(c["type"] == "function" and c["id"] for c in split.tool_calls)


def test_parsers_load_without_importing_mlx_lm():
    import subprocess

    code = ("import sys; from parallm.text.assistant import tool_parser; tool_parser('qwen3_coder'); "
            "assert 'mlx_lm' not in sys.modules and 'mlx.core' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("step", [None, 1, 4])
def test_several_calls_with_text_around(step):
    text = ('I will call two tools.<tool_call>\n{"name": "multiply", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    split = split_all(AssistantSplitter(None, tool_parser("json_tools")), text, step)
    assert calls(split) == [("multiply", {"a": 1, "b": 2}), ("multiply", {"a": 3, "b": 4})]
    assert split.content.strip() == "I will call two tools."


def test_llama3_bare_json_and_plain_json_content():
    bare = '{"name": "multiply", "parameters": {"a": 1, "b": 2}}'
    assert calls(split_all(AssistantSplitter(None, tool_parser("llama3_json")), bare, 5)) == [("multiply", {"a": 1, "b": 2})]
    plain = '{"answer": 42}'
    split = split_all(AssistantSplitter(None, tool_parser("llama3_json")), plain, 3)
    assert split.content == plain and not split.tool_calls


def test_a_malformed_call_stays_text():
    text = "<tool_call>{not json</tool_call> done"
    split = split_all(AssistantSplitter(None, tool_parser("json_tools")), text, 2)
    assert not split.tool_calls and split.content == text


@pytest.mark.parametrize("step", [None, 1, 2, 5])
def test_reasoning_split_streamed_and_not(step):
    split = split_all(AssistantSplitter(("<think>", "</think>")), "<think>a < b, so </thin k</think>The answer is 4.", step)
    assert (split.reasoning, split.content) == ("a < b, so </thin k", "The answer is 4.")
    # the template opened the thinking segment (Qwen3 with enable_thinking): no start marker in the output
    split = split_all(AssistantSplitter(("<think>", "</think>"), in_reasoning=True), "hmm</think>\n\n4", step)
    assert (split.reasoning, split.content) == ("hmm", "\n\n4")
    # an unclosed thinking segment (max_tokens) is all reasoning
    split = split_all(AssistantSplitter(("<think>", "</think>")), "<think>still thinking <", step)
    assert (split.reasoning, split.content) == ("still thinking <", "")


def test_marker_splitter_holds_back_only_possible_markers():
    m = MarkerSplitter({"a": [("<think>", "b")], "b": []}, "a")
    assert m.feed("x <th") == [("a", "x ")]
    assert m.feed("ink>y") == [("b", ""), ("b", "y")]
    assert m.flush() == []


def test_inference_from_template_and_vocab():
    assert infer_tool_parser("{% for tool in tools %}<tool_call>{{ tool_call.name }}") == "json_tools"
    assert infer_tool_parser("<tool_call>\n<function={{ name }}>") == "qwen3_coder"
    assert infer_tool_parser("[TOOL_CALLS] [AVAILABLE_TOOLS]") == "mistral"
    assert infer_tool_parser("<|python_tag|>{{ x }}") == "llama3_json"
    assert infer_tool_parser("{{ messages }}", {"hello"}) is None
    assert infer_thinking({"<think>", "</think>"}) == ("<think>", "</think>")
    assert infer_thinking({"<s>"}) is None
    with pytest.raises(ValueError, match="unknown tool parser"):
        tool_parser("nope")


# --------------------------------------------------------------------------- in the detokenizer (DetokState)

def _tokenizer():
    from text_tokenizers import byte_bpe

    tok = byte_bpe(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}{# <tool_call> tool_call.name #}")
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    return tok


@pytest.mark.parametrize("step", [1, 3, 100])
def test_detokenizer_splits_reasoning_and_calls_and_keeps_every_token(step):
    from parallm.protocol import DetokSpec, SeqDelta, pack_floats, pack_ids, unpack_floats, unpack_ids
    from parallm.text.sequence import DetokState

    tok = _tokenizer()
    text = ('<think>need the product</think>Sure.<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}'
            '\n</tool_call>')
    ids = tok.encode(text, add_special_tokens=False)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids.append(eos)
    state = DetokState(tok, "r", prompt_ids=tok.encode("hi", add_special_tokens=False),
                       spec=DetokSpec(assistant=True, tool_parser="auto", tools=TOOLS))
    outs = []
    for i in range(0, len(ids), step):
        chunk = ids[i:i + step]
        last = i + step >= len(ids)
        outs.append(state.update(SeqDelta(rid="r", token_ids=pack_ids(chunk), logprobs=pack_floats([-0.5] * len(chunk)),
                                          finish_reason="stop" if last else None)))
    assert "".join(o.reasoning for o in outs) == "need the product"
    assert "".join(o.text for o in outs) == "Sure."
    got = [c for o in outs for c in o.tool_calls]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == [("multiply", {"a": 2, "b": 3})]
    assert sum(len(unpack_ids(o.token_ids)) for o in outs) == len(ids)  # token ids and logprobs cover every token
    assert sum(len(unpack_floats(o.logprobs)) for o in outs) == len(ids)
    assert state.rollout().text == text  # trainers get the raw text


def test_detokenizer_reasoning_opened_by_the_template_and_no_split_without_assistant():
    from parallm.protocol import DetokSpec, SeqDelta, pack_ids
    from parallm.text.sequence import DetokState

    tok = _tokenizer()
    prompt = tok.encode("question<think>", add_special_tokens=False)
    ids = tok.encode("hmm</think>42", add_special_tokens=False)
    state = DetokState(tok, "r", prompt_ids=prompt, spec=DetokSpec(assistant=True))
    out = state.update(SeqDelta(rid="r", token_ids=pack_ids(ids), finish_reason="length"))
    assert (out.reasoning, out.text) == ("hmm", "42")
    plain = DetokState(tok, "r", prompt_ids=prompt, spec=DetokSpec())
    out = plain.update(SeqDelta(rid="r", token_ids=pack_ids(ids), finish_reason="length"))
    assert (out.reasoning, out.text) == ("", "hmm</think>42")


@pytest.fixture(scope="module")
def mistral_like():
    """The default model's tokenizer with Mistral's tool markers added as special tokens (no Mistral
    tokenizer is installed here; in Mistral's own, [TOOL_CALLS] and [ARGS] are special control tokens)."""
    from parallm.config import ModelConfig
    from parallm.models import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(ModelConfig()))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{# [TOOL_CALLS] #}"
    return tok


@pytest.mark.parametrize("step", [1, 4, 100])
def test_a_marker_that_is_a_special_token_reaches_the_parser_while_content_hides_special_tokens(mistral_like, step):
    from parallm.protocol import DetokSpec, SeqDelta, pack_ids
    from parallm.text.sequence import DetokState

    tok = mistral_like
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert marker in tok.all_special_ids
    text = ('Let me<|im_start|> check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
            '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}')
    ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert ids.count(marker) == 2 and tok.convert_tokens_to_ids("<|im_start|>") in ids
    outs = []
    for spec in (DetokSpec(assistant=True, tool_parser="auto"), DetokSpec()):
        state = DetokState(tok, "r", prompt_ids=tok.encode("hi", add_special_tokens=False), spec=spec)
        outs.append([state.update(SeqDelta(rid="r", token_ids=pack_ids(ids[i:i + step]),
                                           finish_reason="stop" if i + step >= len(ids) else None))
                     for i in range(0, len(ids), step)])
    split, plain = outs
    assert "".join(o.text for o in split) == "Let me check."
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for o in split for c in o.tool_calls]
    assert got == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    # without a split, skip_special_tokens hides every special token, markers included
    assert "".join(o.text for o in plain) == 'Let me check.get_weather{"city": "Paris"}get_time{"tz": "CET"}'


def test_a_views_inferred_markers_die_with_it(mistral_like):
    """The inferred markers were once cached by id(view): a later view given a dead one's id (the
    suite's order made one) read the other tokenizer's markers, and [TOOL_CALLS] stayed text."""
    import gc

    from parallm.text import assistant
    from parallm.text.vocab import TokenizerView

    gc.collect()
    before = len(assistant._MODEL_SYNTAX)
    view = TokenizerView(mistral_like)
    assert assistant.model_syntax(view)[1] == "mistral"
    assert view in assistant._MODEL_SYNTAX
    del view
    gc.collect()
    assert len(assistant._MODEL_SYNTAX) <= before


# --------------------------------------------------------------------------- calls streamed as fragments

STREAMED = {  # formats whose arguments are streamed as they come (tool_stream.CallStream)
    "json_tools": f'Sure.<tool_call>\n{{"name": "multiply", "arguments": {{"a": {A}, "b": {B}}}}}\n</tool_call>'
                  '<tool_call>\n{"name": "note", "arguments": {"text": "a \\"}\\" brace"}}\n</tool_call>',
    "mistral": f'[TOOL_CALLS]multiply[ARGS]{{"a": {A}, "b": {B}}}[TOOL_CALLS]note[ARGS]{{"text": "a \\"}}\\" brace"}}',
    "llama3_json": f'<|python_tag|>{{"name": "multiply", "parameters": {{"a": {A}, "b": {B}}}}}; '
                   '{"name": "note", "parameters": {"text": "a \\"}\\" brace"}}',
}
WANT2 = [("multiply", {"a": A, "b": B}), ("note", {"text": 'a "}" brace'})]


@pytest.mark.parametrize("name", sorted(STREAMED))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_calls_stream_name_first_then_argument_pieces(name, step):
    text = STREAMED[name]
    splitter = AssistantSplitter(parser=tool_parser(name), tools=TOOLS)
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    deltas, whole, fed_when = [], [], {}
    for k, part in enumerate([*(splitter.feed(p) for p in pieces), splitter.finish()]):
        for d in part.tool_call_deltas:
            fed_when.setdefault(d["index"], k)
        deltas += part.tool_call_deltas
        whole += part.tool_calls
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == WANT2
    assert accumulated(deltas) == whole  # the fragments accumulate to the calls reported whole
    first = [d for d in deltas if d["index"] == 0]
    assert "id" in first[0] and first[0]["function"] == {"name": "multiply", "arguments": ""}
    assert len(first) >= 3 and all(set(d) == {"index", "function"} for d in first[1:])  # then argument pieces
    end_of_first = text.index(str(B)) + len(str(B))
    assert fed_when[0] * step < end_of_first  # the name went out before the arguments were complete


def test_a_format_not_read_incrementally_streams_each_call_whole():
    splitter = AssistantSplitter(parser=tool_parser("qwen3_coder"), tools=TOOLS)
    split = split_all(splitter, SAMPLES["qwen3_coder"], 3)
    assert calls(split) == WANT and accumulated(split.tool_call_deltas) == split.tool_calls
    assert len(split.tool_call_deltas) == 1 and split.tool_call_deltas[0]["index"] == 0
