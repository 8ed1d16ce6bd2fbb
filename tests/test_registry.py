"""The registry of replacements: every entry installs, and disable() restores each original by identity."""

import paddle

import paddle_mgrad
from helpers import PADDLE2
from paddle_mgrad import registry

# What enable() (both features) installs, written out per Paddle major -- the versions the
# suite pins, 2.6.2 and 3.3.1 -- rather than computed from the registry: an optional entry whose
# target vanishes from a new Paddle release would be skipped silently by the registry, and must
# fail here instead.
INSTALLED_ON_EVERY_PADDLE = {
    "recompute",
    "recompute_hybrid",
    "linear",
    "incubate_fused_linear",
    "InnerOverlapLinear",
    "varbase_help",
    "Tensor.backward",
    "Tensor.register_hook",
    "autograd.backward",
    "grad",
    "PyLayerContext.save_for_backward",
    "PyLayerContext.saved_tensor",
    "_C_ops.fused_linear_param_grad_add",
}
INSTALLED = (
    INSTALLED_ON_EVERY_PADDLE
    if PADDLE2
    else INSTALLED_ON_EVERY_PADDLE
    | {
        "SPInnerOverlapLinear",  # paddle.distributed.fleet.utils.sequence_parallel_utils, 3.x only
        "zero_bubble_grad_weight_fn",  # fleet.meta_parallel.zero_bubble_utils, 3.x only
    }
)


def _identity(rep):
    """What must be back, object for object, after disable()."""
    target = registry.resolve_target(rep)
    if target is None:
        return None
    owner, name, obj = target
    if rep.kind == "code":
        return (obj, obj.__code__, obj.__defaults__, obj.__kwdefaults__)
    return (owner, getattr(owner, name))


def _run_recompute():
    x = paddle.randn([4])
    x.stop_gradient = False
    paddle_mgrad.recompute(paddle.tanh, x, use_reentrant=False).sum().backward()


def test_every_entry_is_documented_and_unique():
    keys = [r.key for r in registry.REPLACEMENTS]
    assert len(keys) == len(set(keys))
    for r in registry.REPLACEMENTS:
        assert r.feature in registry.FEATURES + ("support",)
        assert r.kind in ("code", "attr")
        assert not r.create or r.kind == "attr", r.key
        assert len(r.why) > 30, r.key
        assert ":" in r.new, r.key


def test_enable_then_disable_restores_every_original_by_identity():
    before = {r.key: _identity(r) for r in registry.REPLACEMENTS}
    assert before["recompute"] is not None and before["linear"] is not None

    paddle_mgrad.enable(recompute=True, fused_linear=True)
    _run_recompute()  # installs the lazy (support) entries
    installed = set(registry.installed_keys())
    assert installed == INSTALLED, (sorted(INSTALLED - installed), sorted(installed - INSTALLED))
    # and the registry installs exactly the entries whose target this Paddle has
    assert installed == {
        r.key for r in registry.REPLACEMENTS if (before[r.key] is not None or r.create) and r.when()
    }
    for r in registry.REPLACEMENTS:
        if r.key in installed:
            assert _identity(r) != before[r.key], f"{r.key} was not replaced"

    paddle_mgrad.disable()
    assert registry.installed_keys() == []
    for r in registry.REPLACEMENTS:
        now = _identity(r)
        if before[r.key] is None:
            assert now is None
            continue
        assert len(now) == len(before[r.key])
        for a, b in zip(now, before[r.key]):
            assert a is b, f"{r.key}: {a!r} is not the original {b!r}"


def test_original_is_callable_while_replaced():
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    x = paddle.randn([3, 4])
    w = paddle.randn([4, 5])
    out = registry.original("linear")(x, w)
    assert out.shape == [3, 5]
    assert registry.original("linear") is not paddle.nn.functional.linear


def test_unknown_feature_is_an_error():
    import pytest

    with pytest.raises(ValueError, match="unknown feature"):
        registry.install("nope")
