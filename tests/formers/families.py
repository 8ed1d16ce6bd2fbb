"""The PaddleFormers 1.2.0 causal-LM families test_families.py trains, as data (no Paddle
import: the test module reads it to parametrize, train_family.py to build the models).

Each entry: the family's package under ``paddleformers.transformers``, its config and model
classes (the plain-Paddle ones: for qwen2, qwen3, qwen2_moe, qwen3_moe and glm4_moe the
``*Deprecated`` classes -- their ``*ForCausalLM`` builds a paddlefleet ``GPTModel``), the tiny
config's own keys on top of :data:`COMMON`, and how the family calls Paddle's ``recompute``:

* ``"always_reentrant"``: without ``use_reentrant`` (Paddle's default, reentrant, whatever the
  config's ``recompute_use_reentrant`` says);
* ``"config"``: passes ``use_reentrant=config.recompute_use_reentrant``;
* ``None``: the family has no recompute at all.
"""

#: every family: 2 layers, tiny sizes, GQA (4 query heads, 2 key/value heads), fp32 on CPU;
#: ``fuse_rms_norm`` has no CPU kernel (NOTES.md)
COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    fuse_rms_norm=False,
)
#: 4 experts, top-2, tiny experts (the MoE families name these keys differently)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

FAMILIES = {
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", {}, "always_reentrant"),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLMDeprecated", {}, "always_reentrant"),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLMDeprecated", {}, "always_reentrant"),
    "qwen2_moe": (
        "qwen2_moe",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLMDeprecated",
        dict(_MOE, shared_expert_intermediate_size=32, output_router_logits=True),
        "always_reentrant",
    ),
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLMDeprecated",
        dict(_MOE, output_router_logits=True),
        "always_reentrant",
    ),
    # layer 0 dense, layer 1 MoE with one shared expert
    "glm4_moe": (
        "glm4_moe",
        "Glm4MoeConfig",
        "Glm4MoeForCausalLMDeprecated",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "always_reentrant",
    ),
    "phi3": ("phi3", "Phi3Config", "Phi3ForCausalLM", {}, "always_reentrant"),
    # sliding_window < sequence length: the local-attention layers mask differently
    "gemma3_text": (
        "gemma3_text",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(sliding_window=8),
        "always_reentrant",
    ),
    "ernie4_5": ("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", {}, "always_reentrant"),
    # multi-latent attention (low-rank q and kv), yarn rope (its attention reads the factor),
    # layer 0 dense, layer 1 MoE (noaux_tc routing, one shared expert)
    # its MoE layers need Paddle's fused MoE dispatch kernels (GPU only): every layer dense here
    # (moe_layer_start_index past the last layer), no multi-token prediction layer
    "ernie4_5_moe": (
        "ernie4_5_moe",
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=16,
            moe_layer_start_index=2,
            num_nextn_predict_layers=0,
        ),
        "always_reentrant",
    ),
    "deepseek_v3": (
        "deepseek_v3",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            topk_method="noaux_tc",
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        "config",
    ),
    "gpt_oss": (
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
        "config",
    ),
    # layer 0 gated-delta-net linear attention, layer 1 full attention; both MoE
    "qwen3_next": (
        "qwen3_next",
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            _MOE,
            shared_expert_intermediate_size=32,
            full_attention_interval=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        ),
        None,
    ),
}

#: families (causal LMs) that cannot train on CPU here: why, what to try, the error it gives
#: (test_families.test_families_that_cannot_run_on_cpu asserts each, so a change shows).
#: "import": the modeling module; "build": the model from the given config; "train": a
#: forward pass of the model built from the config (with family_standins.py installed).
_FLEET_ONLY = (
    "its *ForCausalLM is a paddlefleet GPTModel built by a model provider (no "
    "plain-Paddle class); paddlefleet is not on the package index"
)
CANNOT = {
    "ernie4_5_moe (MoE layers)": (
        "its MoE layer (MOEAllGatherLayerV2) always dispatches with Paddle's fused MoE "
        "kernels (expand_modality_expert_id, moe_gate_dispatch_partial_nosoftmaxtopk): "
        "no CPU kernel",
        "ernie4_5_moe",
        "train",
        dict(
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=16,
            moe_layer_start_index=1,
            num_nextn_predict_layers=0,
        ),
        "expand_modality_expert_id` is not registered",
    ),
    "deepseek_v32": (
        "its *ForCausalLM is built by deepseek_v3_2_provider from PaddleFormers' "
        "examples/experiments/paddlefleet (not in the wheel; needs paddlefleet, not on the "
        "package index)",
        "deepseek_v32",
        "build",
        {},
        "No module named 'deepseek_v3_2_provider'",
    ),
    "deepseek_v4": (_FLEET_ONLY, "deepseek_v4", "import", None, "paddlefleet is required"),
    "kimi_k2": (_FLEET_ONLY, "kimi_k2", "import", None, "paddlefleet is required"),
    "glm_moe_dsa": (_FLEET_ONLY, "glm_moe_dsa", "import", None, "paddlefleet is required"),
    "minimax_m2": (
        _FLEET_ONLY + " (its modeling module imports paddlefleet itself)",
        "minimax_m2",
        "import",
        None,
        "No module named 'paddlefleet'",
    ),
}
