"""--server.tool-call-parser (vLLM's --tool-call-parser): the parser a chat request with tools and
tool_choice auto asks the detokenizer for, instead of the one inferred from the model."""

import pytest
from starlette.testclient import TestClient

from parallm.api.app import build_app
from parallm.config import ConfigError, ServerConfig, build_config
from test_api_fakes import FakeBackend

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _parser_asked(server: ServerConfig) -> str:
    backend = FakeBackend()
    client = TestClient(build_app(backend, server))
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "weather in Paris?"}],
                                                  "tools": TOOLS, "tool_choice": "auto"})
    assert r.status_code == 200, r.text
    return backend.submits[0].spec.detok.tool_parser


def test_the_flag_names_the_parser_and_unset_means_inferred():
    assert _parser_asked(ServerConfig()) == "auto"
    assert _parser_asked(ServerConfig(tool_call_parser="mistral")) == "mistral"
    assert _parser_asked(ServerConfig(tool_call_parser="llama3_json")) == "llama3_json"


def test_an_unknown_parser_is_refused_at_startup_naming_the_known_ones():
    with pytest.raises(ConfigError, match="tool_call_parser 'hermes2' is not one of: .*mistral"):
        build_config(environ={}, overrides={"server": {"tool_call_parser": "hermes2"}})
    assert build_config(environ={}, overrides={"server": {"tool_call_parser": "qwen3_coder"}}) \
        .server.tool_call_parser == "qwen3_coder"


def test_every_template_rule_names_a_parser_the_config_accepts():
    from parallm.config import TOOL_CALL_PARSERS
    from parallm.text.assistant import _TEMPLATE_RULES

    assert {name for name, _ in _TEMPLATE_RULES} <= set(TOOL_CALL_PARSERS)
    assert len(set(TOOL_CALL_PARSERS)) == len(TOOL_CALL_PARSERS)
