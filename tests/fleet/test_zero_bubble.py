"""Zero-bubble pipelines' deferred weight gradient (Paddle 3.x ``zero_bubble_utils``) with
paddle_mgrad's fused linear on: ``grad_weight_fn`` accumulates into fp32 main_grad through our
op, still when ``WeightGradStore.pop()`` runs it, and Paddle's own function is back, untouched,
when paddle_mgrad is off.  One process; float64 references."""

import importlib

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils import recompute
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from helpers import PADDLE2
from paddle_mgrad import registry, stats

MODULE = "paddle.distributed.fleet.meta_parallel.zero_bubble_utils"
KEY = "zero_bubble_grad_weight_fn"
ROW = next((r for r in registry.REPLACEMENTS if r.key == KEY), None)

if PADDLE2:
    # Paddle 2.6 has no zero-bubble utilities: asserted here (absent module, nothing for the
    # registry row to replace), then the Paddle 3.x tests below are skipped
    with pytest.raises(ImportError):
        importlib.import_module(MODULE)
    assert ROW is not None and registry.resolve_target(ROW) is None and ROW.optional
    pytest.skip(
        f"Paddle {paddle.__version__} has no {MODULE} (a Paddle 3.x module; asserted "
        "absent, and the registry row optional)",
        allow_module_level=True,
    )

zb = importlib.import_module(MODULE)

K, H, N, B, S = 5, 7, 4, 2, 3  # in features, hidden, out features, batch, sequence
MICRO = 3


@pytest.fixture(autouse=True)
def _store():
    zb.WeightGradStore.clear()
    zb.WeightGradStore.enabled = False
    yield
    zb.WeightGradStore.clear()
    zb.WeightGradStore.enabled = False


def test_registry_row_targets_paddles_function():
    assert ROW is not None, f"no registry row {KEY!r}"
    owner, name, fn = registry.resolve_target(ROW)
    assert owner is zb and name == "grad_weight_fn" and fn is zb.grad_weight_fn
    assert ROW.kind == "code" and ROW.feature == "fused_linear"


def test_registry_swaps_the_code_and_restores_it():
    fn = zb.grad_weight_fn
    code = fn.__code__
    paddle_mgrad.enable(recompute=True, fused_linear=False)
    assert not registry.is_installed(KEY)  # a fused_linear row
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    assert registry.is_installed(KEY)
    assert zb.grad_weight_fn is fn and fn.__code__ is not code  # every alias runs ours
    paddle_mgrad.disable()
    assert zb.grad_weight_fn is fn and fn.__code__ is code


class Block(paddle.nn.Layer):
    """x -> SplitBWLinear(K, H) -> tanh -> SplitBWLinear(H, N): two deferred weight gradients."""

    def __init__(self, bias2):
        super().__init__()
        self.fc1 = zb.SplitBWLinear(K, H)
        self.fc2 = zb.SplitBWLinear(H, N, bias_attr=None if bias2 else False)

    def forward(self, x):
        return self.fc2(paddle.tanh(self.fc1(x)))


def _data(seed):
    rs = np.random.RandomState(seed)
    return [(rs.standard_normal((B, S, K)), rs.standard_normal((B, S, N))) for _ in range(MICRO)]


def _float64_grads(block, data):
    """Plain Paddle in float64 on copies of the parameters: gradients summed over micro-steps,
    and each micro-step's dx."""
    params = {
        n: paddle.to_tensor(p.numpy().astype("f8"), stop_gradient=False)
        for n, p in block.named_parameters()
    }
    dxs = []
    for x_np, c_np in data:
        x = paddle.to_tensor(x_np, stop_gradient=False)
        h = paddle.tanh(paddle.matmul(x, params["fc1.weight"]) + params["fc1.bias"])
        y = paddle.matmul(h, params["fc2.weight"])
        if "fc2.bias" in params:
            y = y + params["fc2.bias"]
        (y * paddle.to_tensor(c_np)).sum().backward()
        dxs.append(x.grad.numpy())
    return {n: p.grad.numpy() for n, p in params.items()}, dxs


def _run(block, data, mode, store, as_argument=False):
    """Train MICRO micro-steps; ``store``: "off" (WeightGradStore disabled: the weight gradient
    is computed in backward), "each" (DualPipeV's B then W: enabled around each backward,
    flushed, popped before the next micro-step) or "batched" (every B first, then every W)."""
    fc1, fc2 = block.fc1, block.fc2
    weights = (fc1.weight, fc2.weight)
    dxs, snaps = [], []

    def fn(x):
        if as_argument:  # parameters passed to the recomputed function as arguments
            return recompute(
                lambda t, w, b: zb.SplitBWMatmul.apply(
                    paddle.tanh(zb.SplitBWMatmul.apply(t, w, b)), fc2.weight, fc2.bias
                ),
                x,
                fc1.weight,
                fc1.bias,
                use_reentrant=True,
            )
        if mode == "none":
            return block(x)
        return recompute(block, x, use_reentrant=(mode == "reentrant"))

    for x_np, c_np in data:
        x = paddle.to_tensor(x_np.astype("float32"), stop_gradient=False)
        before = [None if w.main_grad is None else w.main_grad.numpy().copy() for w in weights]
        zb.WeightGradStore.enabled = store != "off"
        (fn(x) * paddle.to_tensor(c_np.astype("float32"))).sum().backward()
        zb.WeightGradStore.enabled = False
        dxs.append(x.grad.numpy())
        if store == "off":
            continue
        zb.WeightGradStore.flush()
        # deferred: backward left the weights' main_grad as they were
        for w, b in zip(weights, before):
            if b is None:
                assert w.main_grad is None, w.name
            else:
                np.testing.assert_array_equal(w.main_grad.numpy(), b)
        snaps.append(stats.snapshot()["linear"]["zero_bubble"])
        if store == "each":
            zb.WeightGradStore.pop()
    if store == "batched":
        for _ in data:
            zb.WeightGradStore.pop()
    assert zb.WeightGradStore.funcs_queue.empty() and zb.WeightGradStore.cache == []
    return dxs, snaps


@pytest.mark.parametrize("mode", ["none", "non_reentrant", "reentrant"])
@pytest.mark.parametrize("store", ["off", "each", "batched"])
@pytest.mark.parametrize("bias2", [True, False])
def test_deferred_weight_gradient_goes_through_our_op(mode, store, bias2):
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    paddle.seed(7)
    block = Block(bias2)
    MixPrecisionLayer(block, dtype="float16")
    data = _data(3)
    ref, ref_dx = _float64_grads(block, data)
    stats.reset()
    ptrs = {}
    fc1, fc2 = block.fc1, block.fc2

    orig_pop = zb.WeightGradStore.pop.__func__

    def pop(cls):  # record main_grad allocations after each W pass
        orig_pop(cls)
        for w in (fc1.weight, fc2.weight):
            ptrs.setdefault(w.name, set()).add(w.main_grad.data_ptr())

    zb.WeightGradStore.pop = classmethod(pop)
    try:
        dxs, snaps = _run(block, data, mode, store)
    finally:
        zb.WeightGradStore.pop = classmethod(orig_pop)

    s = stats.snapshot()
    assert s["linear"]["zero_bubble"] == 2 * MICRO, s["linear"]  # our op, every micro-step
    assert s["linear"]["into_main_grad"] == 2 * MICRO
    assert s["linear"]["backward"] == 0  # SplitBWMatmul's forward linear ran without grad
    assert {fc1.weight.name, fc2.weight.name} <= s["fused_params"]
    if store == "each":  # nothing before the first W pass, two more per W pass
        assert snaps == [2 * i for i in range(MICRO)], snaps
    if store == "batched":
        assert snaps == [0] * MICRO, snaps
    if store != "off":  # first W pass allocated main_grad; later ones accumulated in place
        assert all(len(p) == 1 for p in ptrs.values()), ptrs
    if mode != "none":
        assert s["recompute"]["non_reentrant" if mode == "non_reentrant" else "reentrant"] == MICRO
    for w in (fc1.weight, fc2.weight):
        assert w.grad is None and w.main_grad.dtype == paddle.float32
        assert w.main_grad.name == "main_grad@" + w.name  # as Paddle names it
    for n, p in block.named_parameters():
        np.testing.assert_allclose(p.main_grad.numpy(), ref[n], rtol=1e-5, atol=1e-5, err_msg=n)
        assert p.grad is None, n
    for dx, r in zip(dxs, ref_dx):
        np.testing.assert_allclose(dx, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("store", ["off", "each"])
def test_parameters_as_arguments_of_reentrant_recompute(store):
    """paddle_mgrad's reentrant recompute routes parameter arguments around its PyLayer, so the
    stored function gets the real parameter and our op runs."""
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    paddle.seed(7)
    block = Block(True)
    MixPrecisionLayer(block, dtype="float16")
    data = _data(4)
    ref, ref_dx = _float64_grads(block, data)
    stats.reset()
    dxs, _ = _run(block, data, "reentrant", store, as_argument=True)
    assert stats.linear["zero_bubble"] == 2 * MICRO, stats.linear
    for n, p in block.named_parameters():
        np.testing.assert_allclose(p.main_grad.numpy(), ref[n], rtol=1e-5, atol=1e-5, err_msg=n)
    for dx, r in zip(dxs, ref_dx):
        np.testing.assert_allclose(dx, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["none", "reentrant"])
@pytest.mark.parametrize("store", ["off", "each", "batched"])
def test_equal_to_paddle_alone(mode, store):
    """The same training with paddle_mgrad off (Paddle's grad_weight_fn and recompute) and on.
    (Paddle's non-reentrant recompute loses dx here: next test.)"""
    out = {}
    for on in (False, True):
        paddle_mgrad.disable()
        if on:
            paddle_mgrad.enable(recompute=True, fused_linear=True)
        paddle.seed(7)
        block = Block(True)
        MixPrecisionLayer(block, dtype="float16")
        stats.reset()
        dxs, _ = _run(block, _data(5), mode, store)
        out[on] = (
            {n: p.main_grad.numpy() for n, p in block.named_parameters()},
            dxs,
            stats.linear["zero_bubble"],
        )
    assert out[False][2] == 0 and out[True][2] == 2 * MICRO
    for n in out[False][0]:
        np.testing.assert_allclose(out[True][0][n], out[False][0][n], rtol=1e-6, atol=1e-6)
    for a, b in zip(out[True][1], out[False][1]):
        np.testing.assert_array_equal(a, b)  # dx is Paddle's own computation either way


def test_paddles_non_reentrant_recompute_loses_dx_ours_keeps_it():
    """Paddle 3.3.1 alone: under its non-reentrant recompute SplitBWMatmul's saved input comes
    back as a stop_gradient copy, so its backward returns no dx -- the input (and every layer
    before it) silently gets no gradient.  paddle_mgrad's recompute hands back the tensor as
    it was saved: dx and every main_grad right."""
    paddle.seed(7)
    lin = zb.SplitBWLinear(K, N)
    x = paddle.to_tensor(
        np.random.RandomState(8).standard_normal((B, K)).astype("float32"), stop_gradient=False
    )
    recompute(lin, x, use_reentrant=False).sum().backward()
    assert x.grad is None  # Paddle's loss (a fact of Paddle 3.3.1; this line tells when it changes)

    paddle_mgrad.enable(recompute=True, fused_linear=True)
    paddle.seed(7)
    block = Block(True)
    MixPrecisionLayer(block, dtype="float16")
    data = _data(5)
    ref, ref_dx = _float64_grads(block, data)
    dxs, _ = _run(block, data, "non_reentrant", "each")
    for dx, r in zip(dxs, ref_dx):
        np.testing.assert_allclose(dx, r, rtol=1e-5, atol=1e-5)
    for n, p in block.named_parameters():
        np.testing.assert_allclose(p.main_grad.numpy(), ref[n], rtol=1e-5, atol=1e-5, err_msg=n)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("rank", [2, 3])
def test_grad_weight_fn_accumulates_in_place(dtype, rank):
    """Called directly, as WeightGradStore.pop() calls it: first micro-step allocates fp32
    main_grad, later ones accumulate into the same allocation; float64 reference of the
    (rounded) inputs.  (Paddle's own needs a CPU kernel for low-precision matmul, which CPUs
    lack: ours accumulates bf16/fp16 products in fp32.)"""
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    w = paddle.create_parameter([K, N], "float32")
    w.main_grad = None
    rs = np.random.RandomState(0)
    shape = [B, S] if rank == 3 else [B * S]
    acc, ptr = np.zeros((K, N)), None
    stats.reset()
    for step in range(MICRO):
        x = paddle.to_tensor(rs.standard_normal(shape + [K]).astype("float32")).astype(dtype)
        dy = paddle.to_tensor(rs.standard_normal(shape + [N]).astype("float32")).astype(dtype)
        zb.grad_weight_fn(x, w, dy)
        x64 = x.astype("float32").numpy().astype("f8").reshape(-1, K)
        dy64 = dy.astype("float32").numpy().astype("f8").reshape(-1, N)
        acc += x64.T @ dy64
        assert w.main_grad.dtype == paddle.float32 and w.grad is None
        if step == 0:
            ptr = w.main_grad.data_ptr()
        assert w.main_grad.data_ptr() == ptr
        np.testing.assert_allclose(w.main_grad.numpy(), acc, rtol=1e-5, atol=1e-5)
    assert stats.linear["zero_bubble"] == MICRO


def _outcome(fn):
    try:
        fn()
        return "ok", None
    except Exception as e:  # the same exception type and message, with or without us
        return type(e).__name__, str(e)


def _case(name, rs):
    """(inputs, weight) of a call that Paddle's own grad_weight_fn must handle."""
    x = paddle.to_tensor(rs.standard_normal((B, S, K)).astype("float32"))
    dy = paddle.to_tensor(rs.standard_normal((B, S, N)).astype("float32"))
    w = paddle.create_parameter([K, N], "float32")
    if name != "no_main_grad":  # a weight without main_grad: Paddle accumulates into .grad
        w.main_grad = None
    if name == "no_main_grad_twice":
        w.grad = paddle.ones([K, N])
    elif name == "stop_gradient":
        w.stop_gradient = True
    elif name == "float64":
        x, dy = x.astype("float64"), dy.astype("float64")
    elif name == "rank4":  # Paddle folds only rank 3: a batched product lands in main_grad
        x, dy = x.reshape([1, B, S, K]), dy.reshape([1, B, S, N])
    elif name == "bf16_main_grad":
        w.main_grad = paddle.ones([K, N], "bfloat16")
    elif name == "wrong_shape_main_grad":
        w.main_grad = paddle.ones([K + 1, N])
    elif name == "mismatched_rows":
        dy = dy[:, :2]
    elif name == "mixed_dtypes":
        dy = dy.astype("float64")
    return x, w, dy


FALLBACKS = [
    "no_main_grad",
    "stop_gradient",
    "float64",
    "rank4",
    "bf16_main_grad",
    "wrong_shape_main_grad",
    "mismatched_rows",
    "mixed_dtypes",
]
#: the fallbacks plain Paddle itself refuses (with a ValueError): pinned, so that a comparison
#: of two runs that both raise is the expected case and not a plain Paddle that broke
PADDLE_REFUSES = {"wrong_shape_main_grad", "mismatched_rows", "mixed_dtypes"}


@pytest.mark.parametrize("name", FALLBACKS)
def test_everything_else_is_paddles_own(name):
    """Calls our op would not compute exactly as Paddle: Paddle's function runs, with Paddle's
    result or Paddle's error, and our counter does not move."""
    out = {}
    for on in (False, True):
        paddle_mgrad.disable()
        if on:
            paddle_mgrad.enable(recompute=False, fused_linear=True)
        stats.reset()
        x, w, dy = _case(name, np.random.RandomState(1))
        got = _outcome(lambda x=x, w=w, dy=dy: zb.grad_weight_fn(x, w, dy))
        mg = getattr(w, "main_grad", None)
        out[on] = (
            got,
            None if mg is None else (mg.dtype, mg.numpy().astype("f8")),
            None if w.grad is None else w.grad.numpy(),
        )
        assert stats.linear["zero_bubble"] == 0
    (got0, mg0, g0), (got1, mg1, g1) = out[False], out[True]
    assert got0 == got1
    assert got0[0] == ("ValueError" if name in PADDLE_REFUSES else "ok"), got0
    if name not in PADDLE_REFUSES:  # plain Paddle wrote a gradient somewhere
        assert mg0 is not None or g0 is not None or name == "stop_gradient"
    assert (mg0 is None) == (mg1 is None) and (g0 is None) == (g1 is None)
    if mg0 is not None:
        assert mg0[0] == mg1[0]
        np.testing.assert_array_equal(mg0[1], mg1[1])
    if g0 is not None:
        np.testing.assert_array_equal(g0, g1)
    if name == "no_main_grad":
        assert g0 is not None and got0 == ("ok", None)


def test_queued_functions_run_what_is_installed_when_popped():
    """The registry swaps grad_weight_fn's code: a partial already on the store runs ours if
    fused_linear is on when pop() runs it, Paddle's after disable()."""
    rs = np.random.RandomState(2)
    x = paddle.to_tensor(rs.standard_normal((B * S, K)).astype("float32"))
    dy = paddle.to_tensor(rs.standard_normal((B * S, N)).astype("float32"))
    w = paddle.create_parameter([K, N], "float32")
    w.main_grad = None
    from functools import partial

    zb.WeightGradStore.put(partial(zb.grad_weight_fn, x, w, dy))  # queued while off
    zb.WeightGradStore.flush()
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    stats.reset()
    zb.WeightGradStore.pop()
    assert stats.linear["zero_bubble"] == 1
    zb.WeightGradStore.put(partial(zb.grad_weight_fn, x, w, dy))  # queued while on
    zb.WeightGradStore.flush()
    paddle_mgrad.disable()
    zb.WeightGradStore.pop()
    assert stats.linear["zero_bubble"] == 1
    ref = 2 * x.numpy().astype("f8").T @ dy.numpy().astype("f8")
    np.testing.assert_allclose(w.main_grad.numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused_linear", [False, True])
@pytest.mark.parametrize("store", ["off", "each"])
def test_paddles_reentrant_recompute_with_parameter_arguments(store, fused_linear):
    """Paddle's own reentrant recompute (paddle_mgrad's recompute off) hands SplitBWMatmul a
    detached tensor for a parameter *argument*, without main_grad: Paddle's .grad path runs on
    it, which reaches the parameter only while recompute's backward is running.  Deferred
    (store on), that gradient is lost -- with and without our fused linear; with
    ``recompute=True`` it is not (test_parameters_as_arguments_of_reentrant_recompute)."""
    if fused_linear:
        paddle_mgrad.enable(recompute=False, fused_linear=True)
    paddle.seed(7)
    block = Block(True)
    MixPrecisionLayer(block, dtype="float16")
    data = _data(6)
    ref, _ = _float64_grads(block, data)
    stats.reset()
    _run(block, data, "reentrant", store, as_argument=True)
    # fc2's weight is read from the layer (the real parameter): ours when fused_linear is on
    assert stats.linear["zero_bubble"] == (MICRO if fused_linear else 0)
    for n, p in block.named_parameters():
        if n == "fc1.weight" and store != "off":
            assert p.main_grad is None  # Paddle's loss, ours or not
            continue
        np.testing.assert_allclose(p.main_grad.numpy(), ref[n], rtol=1e-5, atol=1e-5, err_msg=n)
