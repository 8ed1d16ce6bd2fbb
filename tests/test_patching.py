"""enable()/disable(): reach code that imported Paddle's names earlier; restore exactly."""

import importlib

import paddle
from paddle.distributed.fleet.utils import recompute as early_alias  # bound before enable()

import paddle_mgrad
from paddle_mgrad import stats

core_mod = importlib.import_module("paddle.distributed.fleet.recompute.recompute")


def _run(rc):
    x = paddle.randn([4])
    x.stop_gradient = False
    rc(paddle.tanh, x, use_reentrant=False, preserve_rng_state=False).sum().backward()
    return x.grad


def test_enable_reaches_early_aliases_and_disable_restores():
    code = core_mod.recompute.__code__
    defaults = core_mod.recompute.__defaults__
    assert not paddle_mgrad.enabled()["recompute"]

    before = stats.recompute["non_reentrant"]
    _run(early_alias)
    assert stats.recompute["non_reentrant"] == before  # Paddle's own

    paddle_mgrad.enable()
    paddle_mgrad.enable()  # idempotent
    assert paddle_mgrad.enabled()["recompute"]
    for rc in (early_alias, core_mod.recompute, paddle.distributed.fleet.utils.recompute):
        n = stats.recompute["non_reentrant"]
        _run(rc)
        assert stats.recompute["non_reentrant"] == n + 1

    paddle_mgrad.disable()
    assert core_mod.recompute.__code__ is code
    assert core_mod.recompute.__defaults__ is defaults
    n = stats.recompute["non_reentrant"]
    _run(early_alias)
    assert stats.recompute["non_reentrant"] == n
    paddle_mgrad.disable()  # idempotent too


def test_disable_removes_everything_recompute_installed():
    from paddle.autograd.py_layer import PyLayerContext

    orig = (
        paddle.Tensor.backward,
        paddle.autograd.backward,
        PyLayerContext.save_for_backward,
        PyLayerContext.saved_tensor,
    )
    _run(paddle_mgrad.recompute)  # installs the error-translating wrappers (+ 2.6 shim)
    assert paddle.Tensor.backward is not orig[0]
    paddle_mgrad.disable()
    assert (
        paddle.Tensor.backward,
        paddle.autograd.backward,
        PyLayerContext.save_for_backward,
        PyLayerContext.saved_tensor,
    ) == orig


def test_enable_false_switches_feature_off():
    paddle_mgrad.enable(recompute=True)
    paddle_mgrad.enable(recompute=False)
    assert not paddle_mgrad.enabled()["recompute"]


def test_version_and_error_classes():
    """The documented error classes: ``except ValueError`` catches the op's, the flags' and the
    environment variables' errors, ``except RuntimeError`` the recomputation's."""
    assert paddle_mgrad.__version__.count(".") == 2
    assert issubclass(paddle_mgrad.RecomputeError, RuntimeError)
    assert issubclass(paddle_mgrad.FusedLinearError, ValueError)
    assert issubclass(paddle_mgrad.FlagError, ValueError)
    assert issubclass(paddle_mgrad.EnvError, paddle_mgrad.FlagError)
