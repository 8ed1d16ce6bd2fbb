"""How tests fake devices and tiers: ``ops.override`` (places, a forced tier) and the loader's
``settled`` / ``unloaded`` (what the load settled).  While an override is in effect the fast
paths step aside, so the faked answers reach every call; and the override's state is read in
one place outside its own module (the fast paths' step-aside check)."""

import ast
import os

import numpy as np
import paddle
import pytest

from helpers import require_cpp_op
from paddle_mgrad import FusedLinearError, ops
from paddle_mgrad.ops import _build, _reference, devices, dispatch, loader

OPS_DIR = os.path.dirname(os.path.abspath(ops.__file__))


@pytest.fixture
def reference_calls(monkeypatch):
    """Every call of the pure-Paddle reference, recorded (it still computes)."""
    calls = []
    real = _reference.fused_linear_param_grad_add

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(_reference, "fused_linear_param_grad_add", spy)
    return calls


def test_the_fast_paths_step_aside_while_an_override_is_in_effect(reference_calls):
    """A plain CPU call runs through the fast entry; under ``override(tier="python")`` the same
    call is checked in Python and runs on the forced tier, the reference."""
    require_cpp_op()
    x, dy = paddle.randn([6, 4]), paddle.randn([6, 3])
    assert ops.cpu_entry("float32") is not None and ops.cpu_runner("float32") is not None
    ops.fused_linear_param_grad_add(x, dy, paddle.zeros([4, 3]), None, True, False)
    assert reference_calls == []
    with loader.settled(gpu="cuda"):  # our CUDA tier: the GPU entry is handed out, but not now
        with ops.override(tier="python"):
            assert ops.cpu_entry("float32") is None and ops.cpu_runner("float32") is None
            assert ops.gpu_entry() is None
            mg = paddle.zeros([4, 3])
            ops.fused_linear_param_grad_add(x, dy, mg, None, True, False)
            assert ops.accumulate_checked(x, dy, mg, None, True, False, "float32")[0] is mg
        assert ops.gpu_entry() is not None
    assert reference_calls == [[6, 4], [6, 4]]
    np.testing.assert_allclose(mg.numpy(), 2 * x.numpy().T @ dy.numpy(), rtol=1e-5, atol=1e-5)
    assert ops.cpu_entry("float32") is not None and ops.cpu_runner("float32") is not None


def test_a_fused_linear_backward_under_an_override_takes_the_checked_path(reference_calls):
    """The linear's one-call backward asks ``ops.cpu_entry``: None under an override, so the
    backward accumulates through the checked call, on the forced tier; gradients the same."""
    require_cpp_op()
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    import paddle_mgrad

    def grads(data):
        paddle.seed(3)
        layer = paddle.nn.Linear(4, 3)
        MixPrecisionLayer(layer, dtype="bfloat16")  # fp32 main_grad on the fp32 parameters
        x = paddle.to_tensor(data)
        x.stop_gradient = False
        paddle_mgrad.enable(recompute=False, fused_linear=True)
        try:
            (layer(x) ** 2).sum().backward()
        finally:
            paddle_mgrad.disable()
        return [layer.weight.main_grad.numpy(), layer.bias.main_grad.numpy(), x.grad.numpy()]

    data = np.random.RandomState(3).standard_normal([5, 4]).astype("float32")
    fast = grads(data)
    assert reference_calls == []
    with ops.override(tier="python"):
        checked = grads(data)
    assert len(reference_calls) == 1
    for a, b in zip(fast, checked):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_faked_place_reaches_the_checks_and_the_tier_choice():
    x, dy = paddle.randn([6, 4]), paddle.randn([6, 3])
    assert devices.place(x) == str(x.place) and devices.is_cpu(x) and not devices.is_gpu(x)
    with ops.override(place="Place(gpu:0)"):
        assert devices.place(x) == "Place(gpu:0)" and devices.is_gpu(x) and not devices.is_cpu(x)
        with loader.settled(gpu="python"):
            assert dispatch.tier_for(x, None, None, True, True, dout=dy) == "python"
    with ops.override(place="Place(xpu:0)"):
        assert not devices.is_gpu(x) and not devices.is_cpu(x)
        assert dispatch.tier_for(x, None, None, True, True, dout=dy) == "python"
    with ops.override(place=lambda t: "Place(gpu:1)" if t is dy else str(t.place)):
        with pytest.raises(FusedLinearError, match=r"\(Place\(cpu\) vs Place\(gpu:1\)\)"):
            ops.fused_linear_param_grad_add(x, dy, None, None, True, True)
    assert devices.overridden is None


def test_overrides_nest_and_are_restored():
    x = paddle.randn([2, 2])
    with ops.override(tier="python") as outer:
        assert devices.forced_tier() == "python" and devices.overridden is outer
        with ops.override(place="Place(gpu:0)"):
            assert devices.forced_tier() == "python" and devices.is_gpu(x)  # kept from outside
            with ops.override(tier="cpp"):
                assert devices.forced_tier() == "cpp" and devices.is_gpu(x)
        assert devices.overridden is outer and not devices.is_gpu(x)
    with pytest.raises(RuntimeError):
        with ops.override(tier="cpp"):
            raise RuntimeError("left by an exception")
    assert devices.overridden is None and devices.forced_tier() is None


def test_override_refuses_what_it_cannot_fake():
    with pytest.raises(ValueError, match="tier must be one of cpp, paddle-fused, python"):
        with ops.override(tier="cuda"):
            pass
    with pytest.raises(TypeError, match="place must be"):
        with ops.override(place=0):
            pass
    assert devices.overridden is None


def test_settled_changes_facts_for_the_block_only():
    ops.load()
    before = (ops.backend(), ops.backends(), ops.fast_route, ops.cpu_entry("float32"))
    with loader.settled(gpu="paddle-fused", fast=None):
        assert ops.backends()["gpu"] == "paddle-fused"
        assert ops.backend().endswith(";gpu=paddle-fused")
        assert ops.fast_route is None and ops.cpu_entry("float32") is None
    assert (ops.backend(), ops.backends(), ops.fast_route, ops.cpu_entry("float32")) == before
    with pytest.raises(TypeError, match="unknown facts"):
        with loader.settled(backend="x"):
            pass


def test_unloaded_loads_again_and_restores(monkeypatch):
    module = ops.load()
    before = (ops.backend(), ops.fast_route)
    calls = []
    monkeypatch.setattr(_build, "load_op_module", lambda: calls.append(1) or (module, None))
    if module is None:
        monkeypatch.setenv("PADDLE_MGRAD_OPS", "python")
    with loader.unloaded():
        assert ops.fast_route is None
        assert ops.load() is module and ops.backend() == before[0]
    assert calls == ([1] if module is not None else [])
    assert (ops.backend(), ops.fast_route) == before


def _reads_of_the_override(tree):
    """Each ``<name>.overridden`` / bare ``overridden`` read in a module's AST."""
    return [
        n
        for n in ast.walk(tree)
        if (isinstance(n, ast.Attribute) and n.attr == "overridden")
        or (isinstance(n, ast.Name) and n.id == "overridden")
    ]


def test_only_the_step_aside_check_reads_the_override_outside_its_module():
    """The device choice is explicit state in ``ops/devices.py``: every other module asks it
    through devices' functions (place, is_gpu, is_cpu, forced_tier), and the one read of the
    state itself is the fast paths' step-aside check (one question on the hot path)."""
    reads = {}
    for name in sorted(os.listdir(OPS_DIR)):
        if not name.endswith(".py") or name == "devices.py":
            continue
        tree = ast.parse(open(os.path.join(OPS_DIR, name), encoding="utf-8").read())
        found = _reads_of_the_override(tree)
        if found:
            funcs = [
                f.name
                for f in ast.walk(tree)
                if isinstance(f, ast.FunctionDef) and any(n in list(ast.walk(f)) for n in found)
            ]
            reads[name] = (len(found), funcs)
    assert reads == {"entries.py": (1, ["_fast_path_ok"])}
