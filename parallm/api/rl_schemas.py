"""Request bodies of the token-level RL routes (POST /generate, /v1/pause, /v1/abort), as msgspec Structs.

POST /generate takes four formats on one route, told apart by their fields (rl_shape.shape_of):
- "trl": TRL's vLLM client (`trl vllm-serve`): `prompts` (a list of strings or token-id lists);
- "sglang": SGLang's native /generate: `input_ids` or `text`, `sampling_params`, `return_logprob`
  (translated to the vLLM shape by rl_native.py);
- "mlx_rl": the MLX RL Inference Server: `policy_version`, `step_id` or `request_id`, a `prompt`
  that is a list of token ids, or a boolean `logprobs`;
- "vllm": vLLM's own /generate (what Atropos' "vllm" server type posts), e.g.
  `{"prompt": {"prompt_token_ids": [...]}, "logprobs": 0, "n": 4, ...}` or `{"prompt": "text"}`.
Each format is answered in its own shape (docs/rl.md).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from parallm.api.schemas import INT32, PRIORITY_DOC, Int64, NonNegInt, NotYetSupported, TokenId

Shape = Literal["vllm", "trl", "mlx_rl", "sglang", "tito"]   # tito: vLLM's /inference/v1/generate

class RLSampling(NotYetSupported, kw_only=True):
    """Sampling fields shared by every /generate shape (vLLM's SamplingParams names and defaults)."""

    n: Annotated[int, Meta(ge=1, lt=INT32)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, lt=INT32)] = -1
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    seed: Int64 | None = None
    max_tokens: Annotated[int, Meta(ge=1, lt=INT32)] | None = None
    min_tokens: NonNegInt = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    priority: Annotated[int, Meta(ge=-INT32, lt=INT32, description=PRIORITY_DOC)] = 0
    # constrained output, as on the OpenAI routes (parallm/api/structured.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # parallm extensions
    adapter: str = ""
    adapter_version: Annotated[int, Meta(ge=0, lt=INT32)] = 0
    min_policy_version: Annotated[int, Meta(ge=0, lt=INT32)] = 0
    max_staleness: Annotated[int, Meta(ge=-1, lt=INT32)] = -1


class TokensPrompt(Struct, kw_only=True):
    """vLLM's TokensPrompt / TextPrompt: `{"prompt_token_ids": [...]}` or `{"prompt": "text"}`."""

    prompt_token_ids: list[TokenId] | None = None
    prompt: str | None = None
    multi_modal_data: dict[str, Any] | None = None  # {"image": an image or a list}: a vision-language model's


class VllmGenerateRequest(RLSampling, kw_only=True):
    """vLLM's /generate (vllm/entrypoints/api_server.py), as Atropos posts it."""

    prompt: str | TokensPrompt | list[str | TokensPrompt] | None = None
    prompt_token_ids: list[TokenId] | None = None
    logprobs: Annotated[int, Meta(ge=0, lt=INT32)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, lt=INT32)] | None = 16
    prompt_logprobs: Annotated[int, Meta(ge=0, lt=INT32)] | None = None  # Atropos' get_logprobs


class TrlGenerateRequest(RLSampling, kw_only=True):
    """TRL's VLLMClient.generate body (`trl vllm-serve` POST /generate/)."""

    prompts: Annotated[list[str | list[TokenId]], Meta(min_length=1)]
    images: list[Any] | None = None
    max_tokens: Annotated[int, Meta(ge=1, lt=INT32)] | None = 16
    truncate_prompt_tokens: Annotated[int, Meta(ge=1, lt=INT32)] | None = None
    guided_decoding_regex: str | None = None
    structured_outputs_regex: str | None = None  # TRL >= 0.20's name for guided_decoding_regex
    generation_kwargs: dict[str, Any] | None = None
    logprobs: Annotated[int, Meta(ge=0, lt=INT32)] | None = 0  # TRL >= 0.29 (its presence picks the answer)


class MlxRlGenerateRequest(RLSampling, kw_only=True):
    """The MLX RL Inference Server's /generate: one prompt, metadata echoed back."""

    prompt: str | list[TokenId]
    logprobs: bool | Annotated[int, Meta(ge=0, lt=INT32)] | None = None
    policy_version: Int64 | None = None
    step_id: Int64 | str | None = None
    request_id: str | Int64 | None = None


class PauseRequest(Struct, kw_only=True):
    mode: Literal["keep", "abort"] = "keep"


class AbortRequest(Struct, kw_only=True):
    request_ids: list[str] = []
    all: bool = False


class GenerateTokensRequest(Struct, kw_only=True):
    """vLLM's POST /inference/v1/generate (token in, token out): what prime-rl / verifiers (through
    `renderers`), SkyRL and TRL's image path post. `sampling_params` is vLLM's SamplingParams."""

    token_ids: Annotated[list[TokenId], Meta(min_length=1)]
    sampling_params: dict[str, Any] = {}
    model: str | None = None
    request_id: str | None = None
    cache_salt: str | None = None   # parallm's prefix cache is keyed by adapter version: accepted, not needed
    priority: Annotated[int, Meta(ge=-INT32, lt=INT32, description=PRIORITY_DOC)] = 0
    return_token_ids: bool = False
    stream: bool = False
    features: Any = None            # multimodal inputs: refused (text models only)
    content_parts: Any = None


class SglangSampling(Struct, kw_only=True):
    """SGLang's sampling_params (names and defaults of sglang 0.5.23 SamplingParams)."""

    max_new_tokens: Annotated[int, Meta(ge=1, lt=INT32)] = 128
    min_new_tokens: NonNegInt = 0
    n: Annotated[int, Meta(ge=1, lt=INT32)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, lt=INT32)] = -1
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Int64 | None = None
    # change what is generated and are not done here: a 400 naming them
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None
    logit_bias: Any = None
    custom_params: Any = None


class SglangGenerateRequest(Struct, kw_only=True):
    """SGLang's native POST /generate (GenerateReqInput): slime, Atropos' sglang type, SkyRL-train."""

    input_ids: list[TokenId | list[TokenId]] | None = None   # one prompt, or a batch of them
    text: str | list[str] | None = None
    sampling_params: SglangSampling | None = None
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, Meta(ge=0, lt=INT32)] = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: Annotated[int, Meta(ge=-1, lt=INT32)] = -1
    stream: bool = False
    rid: str | None = None
    lora_path: str | None = None    # the adapter's name, as SGLang's LoRA registry names them
    priority: Annotated[int, Meta(ge=-INT32, lt=INT32, description=PRIORITY_DOC)] = 0
    input_embeds: Any = None
    image_data: Any = None
