"""A thinking model under a constraint (issue 20, vLLM's reasoning-aware structured output): the
default model's weights with a tokenizer whose `<think>` / `</think>` are two of its added tokens
renamed (plain added tokens, as Qwen3's are) and a Qwen3-style template (`enable_thinking`). The
engine's grammar begins after `</think>` (its markers read from the model's tokenizer.json), and
the detokenizer puts the thinking in `reasoning` and the constrained answer in the text."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import PreTrainedTokenizerFast

from parallm.config import Config, EngineConfig, ModelConfig
from parallm.engine import Engine, EngineModel, make_request
from parallm.models import resolve_model
from parallm.protocol import Constraint, DetokSpec, SamplingParams, SeqDelta, pack_ids
from parallm.text.sequence import DetokState
from tests._default_model import EOS_TOKEN_ID, default_model

THINK, END = 8, 9  # <issue_start>, <issue_comment> in the default vocabulary, renamed
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
            "enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "rank"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    src = resolve_model(ModelConfig()).path
    out = tmp_path_factory.mktemp("thinking-model")
    for f in src.iterdir():
        if f.name.endswith(".safetensors"):
            (out / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copy2(f, out / f.name)
    tok = json.loads((out / "tokenizer.json").read_text())
    names = {THINK: "<think>", END: "</think>"}
    for t in tok["added_tokens"]:
        if t["id"] in names:
            old, t["content"], t["special"] = t["content"], names[t["id"]], False
            tok["model"]["vocab"][names[t["id"]]] = tok["model"]["vocab"].pop(old)
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((out / "tokenizer_config.json").read_text())
    for i, name in names.items():
        if str(i) in config.get("added_tokens_decoder", {}):
            config["added_tokens_decoder"][str(i)].update(content=name, special=False)
    config["chat_template"] = TEMPLATE
    for name, data in (("tokenizer_config.json", config),
                       ("special_tokens_map.json", json.loads((out / "special_tokens_map.json").read_text()))):
        data["additional_special_tokens"] = [t for t in data.get("additional_special_tokens", [])
                                             if t not in ("<issue_start>", "<issue_comment>")]
        (out / name).write_text(json.dumps(data))
    return out


@pytest.fixture(scope="module")
def engine(model_dir):
    config = Config(model=ModelConfig(path=str(model_dir)), engine=EngineConfig(kv_budget_mb=64, max_num_seqs=4))
    return Engine(EngineModel(default_model(), (EOS_TOKEN_ID,), 2048), config)


def answer(engine, tok, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
    """(output ids, reasoning, text) of one chat request, the text split as the detokenizer splits it."""
    rid = f"r{len(prompt_ids)}-{params.seed}"
    engine.add_request(make_request(rid, prompt_ids, params))
    state = DetokState(tok, rid, prompt_ids=prompt_ids, spec=DetokSpec(assistant=True))
    ids, reasoning, text = [], "", ""
    while engine.has_work():
        for o in engine.step():
            ids += o.token_ids
            out = state.update(SeqDelta(rid=rid, token_ids=pack_ids(o.token_ids), finish_reason=o.finish_reason))
            reasoning, text = reasoning + out.reasoning, text + out.text
    return ids, reasoning, text


@pytest.mark.parametrize("thinking", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_the_answer_is_constrained_after_the_thinking(engine, model_dir, thinking):
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=thinking)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    assert prompt_ids[-2 if thinking else -4] == THINK
    if thinking:  # the thinking begun (this model's first-step logits after "<think>\n" favour the end marker)
        prompt_ids += tok.encode("The user asks about France", add_special_tokens=False)
    c = Constraint(kind="json_schema", value=json.dumps(SCHEMA), after_reasoning=True)
    # the bias ends the thinking soon (the weights never learnt these markers) and keeps EOS out of it;
    # once the grammar begins, only its tokens (EOS at the end) are allowed whatever the bias
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=80, logit_bias={END: 14.0, EOS_TOKEN_ID: -50.0},
                            constraint=c)
    ids, reasoning, text = answer(engine, tok, prompt_ids, params)
    assert ids[-1] == EOS_TOKEN_ID, tok.decode(ids)
    doc = json.loads(text)
    assert set(doc) == {"city", "rank"} and 1 <= doc["rank"] <= 9
    if thinking:  # free text, then </think>, then the grammar's answer
        assert END in ids and ids.index(END) >= 2 and reasoning.strip() and "{" not in tok.decode(ids[:2])
    else:  # the template closed an empty segment: the answer at once
        assert END not in ids and reasoning == "" and text.startswith("{")
