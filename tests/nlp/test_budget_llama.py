"""What a ``budget:`` plan counts for a kept value against what keeping it costs, on PaddleNLP's
own ``LlamaForCausalLM`` (:mod:`paddle_mgrad.recomputation.budget`): for each linear's output
kept alone, the step's peak (Paddle's host allocator) rises by no more than the planner counts
for it.  A count that is low lets a plan overrun its budget."""

import zlib  # noqa: F401  (before paddle)

import paddle
import pytest
from paddle.base import core
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from paddle_mgrad import stats
from paddle_mgrad._compat import HOST_MEMORY_RESET_PEAK  # a step's own peak (Paddle 3.x)
from paddle_mgrad.recomputation import policy as policy_mod

#: a wide llama's decoder layer (the benchmark's): smaller ones (hidden 64 to 512) do not
#: show a kept gate projection costing twice what the count of bytes backward does not save
#: anyway said, this one does
LAYERS, SEQ = 2, 512
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _llama():
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=1024,
        intermediate_size=2752,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_hidden_layers=LAYERS,
        max_position_embeddings=SEQ,
        seq_length=SEQ,
        use_flash_attention=False,
        use_fused_rms_norm=False,
        use_fused_rope=False,
        recompute=True,
        recompute_granularity="full",
        recompute_use_reentrant=False,
        dtype="float32",
    )
    paddle.seed(0)
    model = LlamaForCausalLM(config)
    for layer in model.sublayers(include_self=True):  # (as PaddleNLP's trainer switches it on)
        if hasattr(layer, "enable_recompute"):
            layer.enable_recompute = True
    MixPrecisionLayer(model, dtype="bfloat16")
    ids = paddle.randint(0, config.vocab_size, [1, SEQ + 1])
    return model, ids[:, :-1], ids[:, 1:]


@pytest.mark.skipif(
    HOST_MEMORY_RESET_PEAK is None, reason="Paddle 2.6 cannot reset the host allocator's peak"
)
def test_a_kept_linear_output_costs_no_more_than_the_plan_counts(monkeypatch):
    """Each linear of a 2-layer llama kept alone (a callable policy): the step's peak over
    full recompute's is at most what ``budget:`` counts for that candidate (its bytes in every
    block alive).  The gate and up projections' outputs, saved by the activation after them
    anyway, cost their bytes in the block being recomputed too: its backward holds a kept value
    to its end, where full recompute frees it once the activation's backward ran."""
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    monkeypatch.setattr(policy_mod, "_NAMED", {})
    monkeypatch.setattr(stats, "plans", {})
    model, inputs, labels = _llama()

    def step():
        base = core.host_memory_stat_current_value("Allocated", 0)
        HOST_MEMORY_RESET_PEAK("Allocated", 0)
        out = model(input_ids=inputs, labels=labels, use_cache=False)
        (out[0] if isinstance(out, (tuple, list)) else out.loss).backward()
        return core.host_memory_stat_peak_value("Allocated", 0) - base

    def peak(policy, steps=2):
        if policy is None:
            monkeypatch.delenv("PADDLE_MGRAD_RECOMPUTE_POLICY", raising=False)
        else:
            monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", policy)
        return [step() for _ in range(steps)][-1]  # (a first step allocates the main_grads)

    peak("budget:1", steps=3)  # measured (3 calls, a backward seen), then planned
    planner = policy_mod._NAMED["budget:1"].planner
    (kind,) = planner.kinds.values()
    assert planner.live == LAYERS and kind.chosen is not None
    costs = planner.accounting(kind)[1]
    full = peak(None)
    layers = model.llama.layers
    over = {}
    for name in LINEARS:
        path = next(p for p, _ in layers[0].named_parameters() if f".{name}.weight" in p)
        ids = {id(dict(layer.named_parameters())[path]) for layer in layers}
        policy_mod._NAMED[f"save:keep_{name}"] = policy_mod.Policy(
            name, chooser=lambda call, ids=ids: id(call.weight) in ids
        )
        kept = peak(f"save:keep_{name}") - full
        assert stats.snapshot()["policy"][name]["gemms_not_recomputed"] > 0
        if kept > costs["gemm:" + path]:
            over[path] = (kept, costs["gemm:" + path])
    assert not over, f"kept outputs that cost more than the plan counts (bytes, counted): {over}"
