"""Tiny random-weight configs (ModelArgs dicts) for every mlx-lm text-generation model type: the
support matrix (parallm.engine.matrix) and the engine's family tests build their models here.

Each entry builds in well under a second: hidden 64, 2-4 layers, vocab 101. `GENERIC` fills the
common field names (whatever the ModelArgs calls them); `OVERRIDES[name]` holds what a module
needs on top. `build(name)` returns (model, args_dict) with the tests' weight spreading.
"""

from __future__ import annotations

import dataclasses
import importlib

import mlx.core as mx
import mlx.nn as nn

V = 101  # vocabulary

GENERIC = dict(
    hidden_size=64, n_embd=64, d_model=64, model_dim=64, hidden_dim=64,
    num_hidden_layers=2, n_layer=2, n_layers=2, num_layers=2, num_transformer_layers=2,
    intermediate_size=128, ffn_hidden_size=128, n_inner=128, ff_intermediate_size=128,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4,
    num_key_value_heads=2, n_kv_heads=2, num_kv_heads=2,
    head_dim=16,
    vocab_size=V, num_vocab=V,
    rms_norm_eps=1e-5, layer_norm_eps=1e-5, layer_norm_epsilon=1e-5, norm_eps=1e-5, norm_epsilon=1e-5,
    layernorm_epsilon=1e-5,
    max_position_embeddings=512, n_positions=512, n_ctx=512, model_max_length=512,
    rope_theta=10000.0,
    # MoE
    moe_intermediate_size=32, num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_topk=2, moe_k=2, moe_top_k=2, n_shared_experts=1, num_shared_experts=1,
    shared_expert_intermediate_size=64, moe_shared_expert_intermediate_size=32, shared_intermediate_size=64,
    first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[],
    # MLA
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    # misc
    sliding_window=6, attention_bias=False, mlp_bias=False, use_bias=False, tie_word_embeddings=False,
)

# module name -> fields on top of GENERIC (a callable gets the filled dict and returns changes)
OVERRIDES: dict[str, dict] = {}


def _o(name: str, **kw) -> None:
    OVERRIDES[name] = kw


# ---------------------------------------------------------------- dense GQA
_o("llama")
_o("qwen2")
_o("qwen3")
_o("gemma", head_dim=16)
_o("gemma2", query_pre_attn_scalar=16.0)
_o("phi3")
_o("smollm3", no_rope_layer_interval=2)
_o("apertus", post_norm=False, qk_norm=True, mlp_bias=False)
_o("bitnet")
_o("cohere")
_o("dbrx", ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
   attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0})
_o("ernie4_5", use_bias=False)
_o("exaone", num_layers=2)
_o("glm")
_o("glm4", partial_rotary_factor=0.5)
_o("gpt2")
_o("gpt_bigcode")
_o("gpt_neox", rotary_emb_base=10000, rotary_pct=0.25)
_o("gptj", rotary_dim=8)
_o("granite", logits_scaling=2.0, attention_multiplier=0.25, embedding_multiplier=2.0, residual_multiplier=0.5)
_o("helium")
_o("hunyuan_v1_dense")
_o("internlm2")
_o("internlm3")
_o("lille-130m", block_size=512)
_o("mimo", num_nextn_predict_layers=0)
_o("minicpm", dim_model_base=32, scale_depth=1.4, scale_emb=2.0)
_o("nanochat")
_o("nemotron", hidden_act="relu2", partial_rotary_factor=0.5)
_o("olmo2")
_o("openelm", num_query_heads=[4, 4], num_kv_heads=[2, 2], ffn_multipliers=[2.0, 2.0], ffn_dim_divisor=16)
_o("phi", partial_rotary_factor=0.5)
_o("plamo", n_shared_head=2)
_o("qwen", kv_channels=16)
_o("seed_oss")
_o("stablelm", use_qkv_bias=False, partial_rotary_factor=0.25)
_o("starcoder2")
_o("talkie")
_o("telechat3")
_o("exaone4", rope_scaling=None, sliding_window_pattern="LG", num_hidden_layers=4)
_o("nemotron-nas", block_configs=[
    {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
     "ffn": {"ffn_mult": 2.0, "no_op": False, "replace_with_linear": False}},
    {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
     "ffn": {"ffn_mult": 2.0, "no_op": False, "replace_with_linear": False}},
    {"attention": {"n_heads_in_group": 4, "no_op": False, "replace_with_linear": False},
     "ffn": {"ffn_mult": 1.0, "no_op": False, "replace_with_linear": False}}], num_hidden_layers=3)
_o("phi3small", dense_attention_every_n_layers=2, gegelu_limit=20.0, blocksparse_block_size=32,
   blocksparse_num_local_blocks=1, blocksparse_vert_stride=2, mup_width_multiplier=1.0, vocab_size=100352)
_o("nanbeige")
_o("iquestloopcoder", loop_num=2, loop_window_size=6)
_o("youtu_llm")
_o("minicpm3", dim_model_base=32, scale_depth=1.4, scale_emb=2.0,
   rope_scaling={"original_max_position_embeddings": 512, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4})

# ---------------------------------------------------------------- sliding window / local-global
_o("gemma3_text", query_pre_attn_scalar=16.0, sliding_window=5, sliding_window_pattern=2, num_hidden_layers=4)
_o("cohere2", sliding_window=6, sliding_window_pattern=2, num_hidden_layers=4)
_o("olmo3", layer_types=["sliding_attention", "full_attention"])
_o("ministral3", layer_types=["sliding_attention", "full_attention"],
   rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
                    "original_max_position_embeddings": 16})
_o("gear", layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16.0)
_o("plamo3", window_size=6, sliding_window_pattern=2, num_hidden_layers=4)
_o("muse_glimmer", layer_types=["sliding_attention", "full_attention"])
_o("spark2_5", rope_parameters={"sliding_attention": {"rope_theta": 10000.0},
                                "full_attention": {"rope_theta": 100000.0, "partial_rotary_factor": 0.5}},
   layer_types=["sliding_attention", "full_attention"])

# ---------------------------------------------------------------- MoE (plain attention)
_o("mixtral")
_o("qwen2_moe")
_o("qwen3_moe")
_o("olmoe")
_o("phimoe")
_o("phixtral", rotary_dim=8)
_o("granitemoe", logits_scaling=2.0, attention_multiplier=0.25, embedding_multiplier=2.0, residual_multiplier=0.5)
_o("deepseek")
_o("Klear")
_o("dots1")
_o("ernie4_5_moe", use_bias=False, moe_intermediate_size=32, moe_layer_start_index=1)
_o("bailing_moe")
_o("glm4_moe", rope_scaling=None, use_qk_norm=True, partial_rotary_factor=0.5)
_o("solar_open", partial_rotary_factor=1.0)
_o("minimax", rotary_dim=8)
_o("hunyuan", moe_topk=2, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=False,
   cla_share_factor=2, rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"})
_o("llama4_text", intermediate_size_mlp=128, no_rope_layers=[1, 0], use_qk_norm=True)

# ---------------------------------------------------------------- MoE + sliding window / sinks
_o("gpt_oss", layer_types=["sliding_attention", "full_attention"])
_o("afmoe", layer_types=["sliding_attention", "full_attention"], num_dense_layers=1, mup_enabled=False)
_o("exaone_moe", layer_types=["sliding_attention", "full_attention"], is_moe_layer=[False, True])
_o("laguna", layer_types=["sliding_attention", "full_attention"])
_o("mellum", layer_types=["sliding_attention", "full_attention"],
   rope_parameters={"sliding_attention": {"rope_theta": 10000.0}, "full_attention": {"rope_theta": 100000.0}})
_o("step3p5", num_attention_groups=2, layer_types=["sliding_attention", "full_attention"],
   moe_layers_enum="1", share_expert_dim=32)
_o("mimo_v2_flash", hybrid_layer_pattern=[1, 0], moe_layer_freq=[0, 1], add_swa_attention_sink_bias=True,
   add_full_attention_sink_bias=False, sliding_window_size=6, topk_method="noaux_tc", scoring_func="sigmoid",
   swa_rope_theta=10000.0, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
   swa_v_head_dim=16, partial_rotary_factor=1.0)
_o("muse_spark")

# ---------------------------------------------------------------- MLA
_o("deepseek_v2", n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
   rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
_o("deepseek_v3", n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)
_o("glm4_moe_lite", num_nextn_predict_layers=0)
_o("mistral4", rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 128, "llama_4_scaling_beta": 0.1,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
_o("longcat_flash", attention_method="MLA", zero_expert_type="identity", expert_ffn_hidden_size=32,
   zero_expert_num=2, mla_scale_q_lora=True, mla_scale_kv_lora=True)
_o("deepseek_v32", index_head_dim=16, index_n_heads=2, index_topk=4)
_o("glm_moe_dsa", index_head_dim=16, index_n_heads=2, index_topk=4, topk_method="noaux_tc",
   scoring_func="sigmoid", moe_layer_freq=1, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})

# ---------------------------------------------------------------- recurrent / hybrid
_o("mamba", state_size=8, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=8)
_o("mamba2", num_heads=8, head_dim=16, state_size=8, conv_kernel=4, n_groups=1, use_bias=False,
   use_conv_bias=True, time_step_limit=(0.0, float("inf")), time_step_rank=8)
_o("qwen3_next", linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
   linear_value_head_dim=16, linear_conv_kernel_dim=4, partial_rotary_factor=0.25, full_attention_interval=2,
   num_hidden_layers=4)
_o("lfm2", conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
   block_auto_adjust_ff_dim=False, block_ff_dim=128, full_attn_idxs=[1], num_hidden_layers=3)
_o("lfm2_moe", use_expert_bias=True, num_dense_layers=1, conv_bias=False, conv_L_cache=3, full_attn_idxs=[1],
   num_hidden_layers=3)
_o("falcon_h1", mamba_d_ssm=64, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
   mamba_chunk_size=16, mamba_d_conv=4)
_o("nemotron_h", hybrid_override_pattern="M*-E", num_hidden_layers=4, mamba_num_heads=4, mamba_head_dim=16,
   mamba_proj_bias=False, ssm_state_size=8, conv_kernel=4, n_groups=1, use_conv_bias=True,
   moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_group=1, n_routed_experts=4,
   n_shared_experts=1, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=1.0)
_o("granitemoehybrid", layer_types=["mamba", "attention", "mamba"], num_hidden_layers=3, mamba_n_heads=4,
   mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=8, mamba_d_conv=4, mamba_n_groups=1,
   mamba_conv_bias=True, logits_scaling=2.0, attention_multiplier=0.25, embedding_multiplier=2.0,
   residual_multiplier=0.5, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
   position_embedding_type="rope")
_o("jamba", attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
   mamba_d_conv=4, mamba_d_state=8, mamba_expand=2)
_o("plamo2", hidden_size_per_head=16, attention_window_size=6, mamba_d_state=8, mamba_d_conv=4,
   mamba_num_heads=4, mamba_step=2, mamba_chunk_size=16, num_hidden_layers=4)
_o("recurrent_gemma", conv1d_width=4, logits_soft_cap=30.0, attention_window_size=6,
   block_types=["recurrent", "attention"], num_hidden_layers=3)
_o("rwkv7", head_dim=16, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8, decay_low_rank_dim=8)
_o("bailing_moe_linear", layer_group_size=2, group_norm_size=1, num_hidden_layers=4)
_o("bailing_hybrid", layer_group_size=2, group_norm_size=1, num_hidden_layers=4)
_o("bailing_moe_v3", layer_group_size=2, num_hidden_layers=4, moe_shared_expert_intermediate_size=32)
_o("kimi_linear", linear_attn_config={"full_attn_layers": [2], "kda_layers": [1], "num_heads": 4,
                                      "head_dim": 16, "short_conv_kernel_size": 4},
   num_experts=4, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1)
_o("olmo_hybrid", linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
   linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
   layer_types=["linear_attention", "full_attention"])
_o("baichuan_m1", sliding_window_layers=[0], conv_window=2)

# ---------------------------------------------------------------- KV sharing / exotic
_o("afm7", hidden_dim=64, num_layers=3, num_kv_reuse_layers=1, num_heads=4, num_kv_heads=2)
_o("gemma4_text", num_hidden_layers=4, num_kv_shared_layers=2, sliding_window_pattern=2, global_head_dim=32,
   hidden_size_per_layer_input=8, vocab_size_per_layer_input=V, head_dim=16, final_logit_softcapping=30.0,
   rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 100000.0,
                                       "rope_type": "proportional"},
                    "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000.0,
                                          "rope_type": "default"}})
_o("gemma3n.TextConfig", model_type="gemma3n_text", num_hidden_layers=4, num_kv_shared_layers=2,
   vocab_size_per_layer_input=V, rope_local_base_freq=10000.0, final_logit_softcapping=30.0,
   layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
   hidden_size_per_layer_input=8, altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
   altup_active_idx=0, laurel_rank=8)
_o("llama4.TextArgs", model_type="llama4_text", attention_chunk_size=6, interleave_moe_layer_step=2,
   intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
   rope_scaling=None, use_qk_norm=True, num_hidden_layers=4,
   floor_scale=4)  # the NoPE layer's attention temperature then changes every 4 positions
_o("longcat_flash_ngram", expert_ffn_hidden_size=32, zero_expert_num=2, mla_scale_q_lora=True,
   mla_scale_kv_lora=True, ngram_vocab_size_ratio=2, emb_neighbor_num=3, emb_split_num=2)
_o("deepseek_v41", num_hidden_layers=3, head_dim=32, q_lora_rank=24, qk_rope_head_dim=8, o_groups=2,
   o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, sliding_window=6,
   compress_ratios=(0, 4, 4), index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2,
   candidate_topk_blocks=4, candidate_block_size=4)
_o("minimax_m3_vl.TextArgs", model_type="minimax_m3", intermediate_size=32, dense_intermediate_size=128,
   shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8,
   moe_layer_freq=[0, 1])
_o("muse_spark.TextArgs", post_norm_eps=1e-8, rope_parameters={"rope_theta": 10000.0},
   layer_rope_theta=[10000.0, 0], layer_types=["sliding_attention", "full_attention"],
   final_logit_softcapping=20.0, output_multiplier=0.2, num_local_experts=4, num_experts_per_tok=2,
   moe_hidden_size=64, moe_intermediate_size=32, mlp_layer_types=["sparse", "sparse"], num_shared_experts=0)
_o("kimi_vl.TextArgs", n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)
_o("kimi_k3.TextArgs", model_type="kimi_linear", num_hidden_layers=4, q_lora_rank=24,
   linear_attn_config={"full_attn_layers": [2, 4], "kda_layers": [1, 3], "num_heads": 4, "head_dim": 16,
                       "short_conv_kernel_size": 4},
   num_experts=4, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
   attn_res_block_size=2)


def _text(cfg_name: str, wrapper_type: str, **extra) -> dict:
    return dict(model_type=wrapper_type, vocab_size=V, text_config={**fill(cfg_name), **extra})


def fill(name: str, cls_name: str = "ModelArgs", **extra) -> dict:
    """GENERIC values for the fields this module's args class has, then the module's overrides."""
    mod = importlib.import_module(f"mlx_lm.models.{name}")
    fields = {f.name for f in dataclasses.fields(getattr(mod, cls_name))}
    cfg = {k: v for k, v in GENERIC.items() if k in fields}
    cfg.update(OVERRIDES.get(name if cls_name == "ModelArgs" else f"{name}.{cls_name}", {}))
    cfg.update(extra)
    if "model_type" in fields and "model_type" not in cfg:
        cfg["model_type"] = name
    return cfg


# VLM / wrapper modules: the text backbone's config under text_config
WRAPPERS = {
    "gemma3": lambda: _text("gemma3_text", "gemma3"),
    "gemma4": lambda: _text("gemma4_text", "gemma4"),
    "qwen2_vl": lambda: _text("qwen2", "qwen2_vl"),
    "qwen3_vl": lambda: _text("qwen3", "qwen3_vl"),
    "qwen3_vl_moe": lambda: _text("qwen3_moe", "qwen3_vl_moe"),
    "pixtral": lambda: _text("llama", "pixtral"),
    "mistral3": lambda: _text("ministral3", "mistral3"),
    "lfm2-vl": lambda: _text("lfm2", "lfm2-vl"),
    "kimi_k25": lambda: dict(model_type="kimi_k25", text_config=fill("deepseek_v3")),
    "kimi_vl": lambda: dict(model_type="kimi_vl", text_config=fill("kimi_vl", "TextArgs")),
    "kimi_k3": lambda: dict(model_type="kimi_k3", text_config=fill("kimi_k3", "TextArgs")),
    "gemma3n": lambda: dict(model_type="gemma3n", text_config=fill("gemma3n", "TextConfig")),
    "llama4": lambda: dict(model_type="llama4", text_config=fill("llama4", "TextArgs")),
    "minimax_m3_vl": lambda: dict(model_type="minimax_m3_vl", text_config=fill("minimax_m3_vl", "TextArgs")),
    "muse_spark": lambda: dict(model_type="muse_spark", text_config=fill("muse_spark", "TextArgs")),
    "qwen3_5": None,  # filled below
    "qwen3_5_moe": None,
}


def config(name: str) -> dict:
    if name in CUSTOM:
        return CUSTOM[name]()
    if name in WRAPPERS and WRAPPERS[name] is not None:
        return WRAPPERS[name]()
    return fill(name)


_QWEN35_TEXT = dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=V,
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                    rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                    max_position_embeddings=512)

CUSTOM = {
    "qwen3_5": lambda: dict(model_type="qwen3_5", text_config=dict(_QWEN35_TEXT)),
    "qwen3_5_moe": lambda: dict(model_type="qwen3_5_moe", text_config=dict(
        _QWEN35_TEXT, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=64,
        moe_intermediate_size=32)),
}


def _finish(model, seed: int, spread: float):
    """Spread the random weights (ndim >= 2: times `spread`, as tests/_engine_helpers does for 2-D)
    and give every all-zero parameter small random values: many modules start biases, gates,
    mixing coefficients, conv weights or norm weights at zero, which leaves a tiny model
    degenerate (rwkv7's output then ignores its recurrent state; recurrent_gemma's conv and
    gates do nothing), so a test could not see a wrong state."""
    mx.random.seed(seed + 1)

    def fix(p):
        if not mx.issubdtype(p.dtype, mx.floating):
            return p
        if p.size and float(mx.abs(p).max()) == 0.0:
            return (0.3 * mx.random.normal(p.shape)).astype(p.dtype)
        return p * spread if p.ndim >= 2 else p

    model.update(nn.utils.tree_map(fix, model.parameters()))
    mx.eval(model.parameters())
    return model


def build(name: str, seed: int = 0, spread: float = 3.0):
    """The tiny model for module `name` (see _finish for the weight changes)."""
    mod = importlib.import_module(f"mlx_lm.models.{name}")
    cfg = config(name)
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    return _finish(model, seed, spread), cfg


# ---------------------------------------------------------------- variants (module, changes)
def _variant(module: str, top: dict | None = None, text: dict | None = None):
    def make():
        cfg = config(module)
        if text:
            cfg = dict(cfg, text_config={**cfg["text_config"], **text})
        return {**cfg, **(top or {})}
    return module, make


VARIANTS = {
    "hunyuan+cla": _variant("hunyuan", {"use_cla": True, "cla_share_factor": 2}),
    "gemma4_text+moe+keqv": _variant("gemma4_text", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                                     "moe_intermediate_size": 32, "attention_k_eq_v": True,
                                                     "num_global_key_value_heads": 1}),
    "minimax_m3_vl+sparse": _variant("minimax_m3_vl", text={"index_n_heads": 2, "index_head_dim": 16,
                                                            "index_block_size": 4, "index_topk_blocks": 2,
                                                            "index_local_blocks": 1,
                                                            "sparse_attention_freq": [1, 1]}),
    "llama+sliding": _variant("llama", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}),
    "deepseek_v3+noqlora": _variant("deepseek_v3", {"q_lora_rank": None}),
    "nanbeige+loops": _variant("nanbeige", {"num_loops": 2}),
    "qwen3_moe+sparse_step": _variant("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 4,
                                                    "mlp_only_layers": [0]}),
}


def build_any(name: str, seed: int = 0, spread: float = 3.0):
    """build() for a module name or a VARIANTS key."""
    if name not in VARIANTS:
        return build(name, seed, spread)
    module, make = VARIANTS[name]
    mod = importlib.import_module(f"mlx_lm.models.{module}")
    cfg = make()
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    return _finish(model, seed, spread), cfg
