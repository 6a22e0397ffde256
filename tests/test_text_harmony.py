"""gpt-oss harmony output (parallm/text/harmony.py) on the examples of the format's specification
(openai/harmony v0.0.8, docs/format.md), whole and streamed in small pieces, and through the
detokenizer with the harmony markers as special tokens."""

from __future__ import annotations

import json

import pytest

from parallm.text.assistant import Split, infer_tool_parser, new_call_id
from parallm.text.harmony import HarmonySplitter

from _split_helpers import accumulated, split_all

REASON = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
          '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.')
CALL = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>'
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}')
PREAMBLE = ('<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant<|channel|>commentary'
            '<|message|>**Action plan**: generate the file<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.generate_file<|constrain|>json<|message|>{"template": "basic_html", "path": "index.html"}')
ROLE_RECIPIENT = ('<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.get_weather'
                  '<|channel|>commentary json<|message|>{"location": "Paris"}<|call|>')
BROWSER = ('<|channel|>analysis to=browser.search<|message|>{"query": "gpt-oss"}<|end|><|start|>assistant'
           '<|channel|>final<|message|>Found it.<|return|>')

CASES = {  # text -> (reasoning, content, calls)
    "reason": (REASON, 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", []),
    "call": (CALL, "Need to use function get_weather.", "", [("get_weather", {"location": "San Francisco"})]),
    "preamble": (PREAMBLE, "{long chain of thought}", "**Action plan**: generate the file",
                 [("generate_file", {"template": "basic_html", "path": "index.html"})]),
    "role_recipient": (ROLE_RECIPIENT, "Look it up.", "", [("get_weather", {"location": "Paris"})]),
    "browser": (BROWSER, '{"query": "gpt-oss"}', "Found it.", []),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("step", [None, 1, 3, 7])
def test_channels_split_whole_and_streamed(case, step):
    text, reasoning, content, want = CASES[case]
    got = split_all(HarmonySplitter(Split, new_call_id), text, step)
    assert (got.reasoning, got.content) == (reasoning, content)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got.tool_calls] == want
    assert accumulated(got.tool_call_deltas) == got.tool_calls
    if want and step == 1:  # the name goes out first, then pieces of the arguments
        assert len(got.tool_call_deltas) > 3 and got.tool_call_deltas[0]["function"]["arguments"] == ""


def test_text_outside_any_message_is_content():
    """A constrained answer from the first token (no channel header) is not lost."""
    got = split_all(HarmonySplitter(Split, new_call_id), '{"city": "Paris"}', 4)
    assert got.content == '{"city": "Paris"}' and not got.reasoning


def test_without_tool_parsing_a_call_stays_content_and_harmony_is_inferred():
    got = split_all(HarmonySplitter(Split, new_call_id, calls=False), CALL, 5)
    assert got.tool_calls == [] and got.content == '{"location":"San Francisco"}'
    template = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}{% endfor %}"
    assert infer_tool_parser(template) == "harmony"


@pytest.fixture(scope="module")
def harmony_tokenizer():
    """The default model's tokenizer with the harmony markers added as special tokens (as in o200k_harmony)."""
    from parallm.config import ModelConfig
    from parallm.models import load_tokenizer, resolve_model
    from parallm.text.harmony import MARKERS

    tok = load_tokenizer(resolve_model(ModelConfig()))
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    tok.chat_template = ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>"
                         "{% endfor %}<|start|>assistant")
    return tok


@pytest.mark.parametrize("tool_parser", ["auto", ""])
def test_the_detokenizer_splits_harmony_with_its_markers_as_special_tokens(harmony_tokenizer, tool_parser):
    from parallm.protocol import DetokSpec, SeqDelta, pack_ids
    from parallm.text.sequence import DetokState

    tok = harmony_tokenizer
    ids = tok.encode(PREAMBLE, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|call|>")]
    assert tok.convert_tokens_to_ids("<|message|>") in ids
    spec = DetokSpec(assistant=True, tool_parser=tool_parser, skip_special_tokens=True)
    state = DetokState(tok, "r", prompt_ids=tok.encode("hi", add_special_tokens=False), spec=spec)
    outs = [state.update(SeqDelta(rid="r", token_ids=pack_ids(ids[i:i + 2]),
                                  finish_reason="stop" if i + 2 >= len(ids) else None)) for i in range(0, len(ids), 2)]
    reasoning, text = "".join(o.reasoning for o in outs), "".join(o.text for o in outs)
    calls = [c for o in outs for c in o.tool_calls]
    assert reasoning == "{long chain of thought}"
    if tool_parser:
        assert text == "**Action plan**: generate the file"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [("generate_file", {"template": "basic_html", "path": "index.html"})]
    else:  # no tools asked: the call's arguments are text, the markers still hidden
        assert not calls
        assert text == '**Action plan**: generate the file{"template": "basic_html", "path": "index.html"}'
