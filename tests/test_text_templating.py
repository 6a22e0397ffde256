"""Templater: prompts, chat templates, id checks and vLLM's context-length errors."""

from __future__ import annotations

import pytest
from text_tokenizers import byte_bpe, raw_byte_bpe

from parallm.protocol import Detokenize, RequestError, RequestSpec, SamplingParams, TextSubmit, Tokenize, pack_ids
from parallm.text.templating import Templater, TemplateError


def submit(**kw):
    max_tokens = kw.pop("max_tokens", 16)
    return TextSubmit(rid="r", reply_to=b"c", spec=RequestSpec(params=SamplingParams(max_tokens=max_tokens)), **kw)


@pytest.fixture(scope="module")
def tok():
    return byte_bpe()


@pytest.fixture(scope="module")
def tpl(tok):
    return Templater(tok, max_model_len=64)


def error(fn, *args, **kwargs) -> TemplateError:
    with pytest.raises(TemplateError) as info:
        fn(*args, **kwargs)
    return info.value


def test_plain_prompt_and_special_tokens():
    bos_tok = byte_bpe(bos=True)
    t = Templater(bos_tok, 64)
    bos = bos_tok.convert_tokens_to_ids("<|endoftext|>")
    with_bos = t.encode(submit(prompt="hello"))
    without = t.encode(submit(prompt="hello", add_special_tokens=False))
    assert with_bos == [bos] + without
    assert bos_tok.decode(without) == "hello"


def test_chat_messages_render_through_the_template(tok, tpl):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 😀"}]
    ids = tpl.encode(submit(messages=msgs, add_special_tokens=False))
    assert tok.decode(ids) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi 😀<|im_end|>\n"
                               "<|im_start|>assistant\n")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3                      # special tokens are parsed, not spelled out
    no_gen = tpl.encode(submit(messages=msgs, add_generation_prompt=False))
    assert tok.decode(no_gen).endswith("hi 😀<|im_end|>\n")


def test_continue_final_message(tok, tpl):
    msgs = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "1, 2,"}]
    ids = tpl.encode(submit(messages=msgs, add_generation_prompt=False, continue_final_message=True))
    assert tok.decode(ids).endswith("<|im_start|>assistant\n1, 2,")
    e = error(tpl.encode, submit(messages=msgs, add_generation_prompt=True, continue_final_message=True))
    assert e.param == "continue_final_message" and "Cannot set both" in e.message


def test_content_part_lists_are_joined(tok, tpl):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    ids = tpl.encode(submit(messages=[{"role": "user", "content": parts}]))
    assert "user\nfirst\nsecond<|im_end|>" in tok.decode(ids)


def test_non_text_content_part_is_a_clear_error(tpl):
    parts = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "x"}}]
    e = error(tpl.encode, submit(messages=[{"role": "user", "content": parts}]))
    assert e.status == 400 and e.param == "messages[0].content[1].type" and "'image_url'" in e.message
    e = error(tpl.encode, submit(messages=[{"role": "user", "content": [{"type": "text"}]}]))
    assert e.param == "messages[0].content[0].text"
    e = error(tpl.encode, submit(messages=[{"content": "no role"}]))
    assert e.param == "messages[0].role"
    assert error(tpl.encode, submit(messages=[])).param == "messages"


def test_chat_template_kwargs_reach_the_template(tok, tpl):
    msgs = [{"role": "user", "content": "hi"}]
    ids = tpl.encode(submit(messages=msgs, chat_template_kwargs={"enable_thinking": True}))
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>")
    e = error(tpl.encode, submit(messages=msgs, chat_template_kwargs={"chat_template": "{{ 'x' }}"}))
    assert e.param == "chat_template_kwargs"


def test_template_that_raises_is_a_400():
    t = Templater(byte_bpe(chat_template="{{ raise_exception('roles must alternate') }}"), 64)
    e = error(t.encode, submit(messages=[{"role": "user", "content": "hi"}]))
    assert e.status == 400 and "roles must alternate" in e.message


def test_tool_call_arguments_are_parsed_for_templates():
    tmpl = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}{% endfor %}"
    t = Templater(byte_bpe(chat_template=tmpl), 64)
    call = {"id": "1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    assert t.render(msgs, add_generation_prompt=False) == "Oslo"
    assert call["function"]["arguments"] == '{"city": "Oslo"}'      # the request is not mutated


def test_missing_chat_template_is_a_400():
    for tokenizer in (byte_bpe(chat_template=None), raw_byte_bpe()):
        e = error(Templater(tokenizer, 64).encode, submit(messages=[{"role": "user", "content": "hi"}]))
        assert e.status == 400 and "no chat template" in e.message and e.param == "messages"


def test_prompt_ids_are_checked_against_the_vocabulary(tok, tpl):
    assert tpl.encode(submit(prompt_ids=pack_ids([0, 5, len(tok) - 1]))) == [0, 5, len(tok) - 1]
    for bad in (len(tok), -1):
        e = error(tpl.encode, submit(prompt_ids=pack_ids([3, bad])))
        assert e.param == "prompt" and f"Token id {bad} is out of vocabulary" in e.message
    assert Templater(tok, 64, vocab_size=len(tok) + 8).encode(submit(prompt_ids=pack_ids([len(tok)]))) == [len(tok)]


def test_context_length_check_matches_vllm(tok):
    t = Templater(tok, max_model_len=20)
    ids = t.encode(submit(prompt_ids=pack_ids([1] * 12), max_tokens=8))     # exactly fits
    assert len(ids) == 12
    e = error(t.encode, submit(prompt_ids=pack_ids([1] * 12), max_tokens=9))
    assert e.message == ("This model's maximum context length is 20 tokens. However, you requested 21 tokens "
                         "(12 in the messages, 9 in the completion). Please reduce the length of the messages "
                         "or completion.")
    assert e.status == 400 and e.param == "prompt"
    e = error(t.encode, submit(messages=[{"role": "user", "content": "a long message " * 5}]))
    assert e.param == "messages" and "in the completion" in e.message
    e = error(t.check_length, 20, None)
    assert "you requested 20 tokens in the messages" in e.message
    t.check_length(19, None)


def test_exactly_one_input_and_not_empty(tpl):
    assert "exactly one" in error(tpl.encode, submit()).message
    assert "exactly one" in error(tpl.encode, submit(prompt="a", messages=[{"role": "user", "content": "b"}])).message
    assert error(tpl.encode, submit(prompt="", add_special_tokens=False)).message == "The decoder prompt cannot be empty"
    assert error(tpl.encode, submit(prompt_ids=b"")).param == "prompt"


def test_tokenize_and_detokenize(tok, tpl):
    ids = tpl.tokenize(Tokenize(qid="q", reply_to=b"c", prompt="naïve 你好", add_special_tokens=False))
    assert tok.decode(ids) == "naïve 你好"
    chat = tpl.tokenize(Tokenize(qid="q", reply_to=b"c", messages=[{"role": "user", "content": "x" * 200}]))
    assert len(chat) > 64                                   # no length check on /tokenize
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert tpl.detokenize(Detokenize(qid="q", reply_to=b"c", ids=pack_ids(ids + [eos]))) == "naïve 你好<|im_end|>"
    assert tpl.detokenize(Detokenize(qid="q", reply_to=b"c", ids=pack_ids(ids + [eos]),
                                     skip_special_tokens=True)) == "naïve 你好"
    assert error(tpl.detokenize, Detokenize(qid="q", reply_to=b"c", ids=pack_ids([10**6]))).param == "tokens"


def test_error_converts_to_a_request_error():
    err = TemplateError("bad", "messages").to_error("r1", b"id")
    assert err == RequestError(rid="r1", reply_to=b"id", status=400, message="bad", param="messages")


def test_a_huge_prompt_is_refused_without_being_tokenized_whole(tok):
    """Issue 30: a prompt just under the 8 MB body limit was tokenized whole (4-7.5 s of the tokenizer's loop,
    other clients waiting) before its context-length 400. Now only a slice of it is, or none."""
    t = Templater(tok, max_model_len=64)
    seen: list[int] = []
    encode = t.tok.encode
    t.tok.encode = lambda text, add_special_tokens=True: seen.append(len(text)) or encode(text, add_special_tokens)
    try:
        for prompt in ("word " * 200_000, "x" * 2_000_000):
            seen.clear()
            e = error(t.encode, submit(prompt=prompt))
            assert e.param == "prompt" and "you requested at least" in e.message
            assert sum(seen) <= 64 * 8, seen
        # chat messages too
        seen.clear()
        e = error(t.encode, submit(messages=[{"role": "user", "content": "word " * 200_000}]))
        assert e.param == "messages" and "at least" in e.message and sum(seen) <= 64 * 8
        # what fits is tokenized as before, whole and once
        seen.clear()
        fits = "word " * 8
        assert t.encode(submit(prompt=fits, max_tokens=4)) == encode(fits)
        assert seen == [len(fits)]
    finally:
        del t.tok.encode
    assert t.tok.longest_token_chars >= max(len(t.tok.token_bytes(i)) for i in range(t.tok.vocab_size))
