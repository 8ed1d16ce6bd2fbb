"""The checked call: the tier for the call's place runs it, checked before anything is written.

:func:`fused_linear_param_grad_add` first offers the call to the fast CPU path
(:func:`.entries.fast_cpu_call`); any other call runs on the tier :func:`tier_for` picks: our
C++ op (CPU, or CUDA when built), Paddle's own ``_C_ops.fused_linear_param_grad_add``
(``paddle-fused``), or the pure-Paddle reference (:mod:`._reference`).  A strided
``dweight``/``dbias`` is computed in a contiguous copy and written back into the view.

Who decides whether the call is valid: our op, where it runs (its checks are the input rules:
``wgrad_op.cc``, ``pmg::check_places``/``check_args``, all made before it writes anything); the
refusal is then worded by :func:`._inputs.check`, which raises the
:class:`~paddle_mgrad.FusedLinearError` naming the shapes and dtypes.  :func:`._inputs.check`
decides only where our op does not run: Paddle's fused op and the reference (a machine without
a compiler has no op at all), operands that are not tensors (the op cannot be handed them), and
calls under :func:`~paddle_mgrad.ops.override` (its faked places exist in Python only).
``tests/ops/test_fast_entry.py`` draws calls and checks that both refuse the same ones.
"""

from __future__ import annotations

from .._compat import paddle
from . import _inputs, _reference, devices
from ._inputs import mp_dtype
from .entries import check_cpu_knobs, fast_cpu_call, hand_back
from .loader import load, state as _loaded
from .strided import contiguous as _contiguous, is_strided as _strided

_dtype_name = _inputs.dtype_name


def _op_takes(x) -> bool:
    """Whether our op runs a call with this ``x``: a CPU tensor, or a GPU tensor when the op's
    CUDA part is built (the op checks every other input itself)."""
    if load() is None:
        return False
    if devices.is_gpu(x):
        return _loaded["gpu"] == "cuda"
    return devices.is_cpu(x)


def tier_for(x, dweight, dbias, multi_precision, has_bias, dout=None) -> str:
    """``'cpp'`` (our module, CPU or CUDA), ``'paddle-fused'`` or ``'python'`` for this call.

    Our C++ op takes CPU tensors, and GPU tensors when its CUDA part is built; other places
    (XPU, custom devices, CUDA-pinned memory) go to the pure-Paddle reference, which runs
    wherever Paddle's own ops do.  :func:`~paddle_mgrad.ops.override` may force a tier."""
    forced = devices.forced_tier()
    if forced is not None:
        return forced
    if _op_takes(x):
        return "cpp"
    if not devices.is_gpu(x):
        return "python"
    gpu = _loaded["gpu"]
    if gpu == "paddle-fused":
        # Paddle's kernel computes M = x.numel() / K: K = 0 divides by zero (SIGFPE), and an
        # MoE expert that got no tokens (M = 0) is a zero-size GEMM; the reference is exact.
        N = (
            dout.shape[-1]
            if dout is not None
            else (dweight.shape[-1] if dweight is not None else 1)
        )
        if 0 in list(x.shape) + [N]:
            return "python"
        # Paddle's op wants MPType accumulators with multi_precision, else the input dtype
        # (ours also accepts fp32 without multi_precision: that case goes to the fallback)
        want = mp_dtype(x.dtype) if multi_precision else _dtype_name(x.dtype)
        accs = [dweight] + ([dbias] if has_bias else [])
        if all(a is None or _dtype_name(a.dtype) == want for a in accs):
            return "paddle-fused"
    return "python"


def _paddle_fused(x, dout, dweight, dbias, multi_precision, has_bias):
    """Paddle's own GPU op, same semantics; inputs flattened to 2-D, results written back into
    the given accumulators if Paddle returned new tensors."""
    from paddle import _C_ops

    x2 = x.reshape([-1, x.shape[-1]]) if len(x.shape) != 2 else x
    d2 = dout.reshape([-1, dout.shape[-1]]) if len(dout.shape) != 2 else dout
    with paddle.no_grad():
        dw, db = _C_ops.fused_linear_param_grad_add(
            x2, d2, dweight, dbias if has_bias else None, bool(multi_precision), bool(has_bias)
        )
    for given, got in ((dweight, dw), (dbias if has_bias else None, db)):
        if given is not None and got is not None and got.data_ptr() != given.data_ptr():
            paddle.assign(got, output=given)
    return hand_back(dweight, dbias, dw, db, has_bias)


def _on_tier(x, dout, dweight, dbias, multi_precision, has_bias, tier):
    """The call (contiguous accumulators) on ``tier``; on the ``cpp`` tier our op decides
    whether it is valid (the module's docstring)."""
    if tier == "paddle-fused":
        return _paddle_fused(x, dout, dweight, dbias, multi_precision, has_bias)
    module = _loaded["module"] if tier == "cpp" else None
    # K = 0 or N = 0: a zero-size [K, N] result, which Paddle 2.6's custom-op runtime rejects
    # as "not initialized"; the reference handles it without a GEMM.
    if module is None or 0 in (x.shape[-1], dout.shape[-1]):
        return _reference.fused_linear_param_grad_add(
            x, dout, dweight, dbias, multi_precision, has_bias
        )
    x, dout = _contiguous(x), _contiguous(dout)
    try:
        if devices.is_cpu(x):  # (the EnvError of env.py's rules, after the input rules')
            check_cpu_knobs(_dtype_name(x.dtype))
        with paddle.no_grad():
            dw, db = module.pmg_fused_wgrad_add(x, dout, dweight, dbias, multi_precision, has_bias)
    except Exception:
        # refused before anything was written: our words for a refusal of the input rules,
        # else the error as raised
        _inputs.check(x, dout, dweight, dbias, multi_precision, has_bias)
        raise
    return hand_back(dweight, dbias, dw, db, has_bias)


def fused_linear_param_grad_add(
    x, dout, dweight=None, dbias=None, multi_precision=True, has_bias=True
):
    """Accumulate a linear layer's weight (and bias) gradient in place.

    ``dweight += x2ᵀ · dout2`` and ``dbias += Σ_rows dout2`` where ``x2``/``dout2``
    are ``x``/``dout`` flattened to 2-D.  A given ``dweight``/``dbias`` is updated in
    place (same ``data_ptr()``) and returned; ``None`` allocates a fresh one (fp32
    when ``multi_precision``).  A non-contiguous accumulator (a strided view into a flat
    gradient buffer) is written through: computed in a contiguous copy, copied back into
    the view.  Returns ``(dweight, dbias)``; ``dbias`` is None when ``has_bias`` is false.
    Raises :class:`FusedLinearError` on bad input -- every input is checked before
    anything is written.
    """
    multi_precision = _inputs.flag("multi_precision", multi_precision)
    has_bias = _inputs.flag("has_bias", has_bias)
    done = fast_cpu_call(x, dout, dweight, dbias if has_bias else None, multi_precision, has_bias)
    if done is not None:
        return done
    return _checked(x, dout, dweight, dbias, multi_precision, has_bias)


def _checked(x, dout, dweight, dbias, multi_precision, has_bias):
    """The call the fast CPU path declined: checked before anything is written (by our op where
    it runs, else in Python: the module's docstring), a strided accumulator written through, on
    the tier for its place."""
    if not has_bias:
        dbias = None
    operands = (x, dout) + tuple(t for t in (dweight, dbias) if t is not None)
    op_decides = (
        not devices.faking()
        and all(isinstance(t, paddle.Tensor) for t in operands)
        and _op_takes(x)
    )
    if op_decides:  # (no override: no forced tier, and our op takes x: tier_for's "cpp")
        tier = "cpp"
    else:
        _inputs.check(x, dout, dweight, dbias, multi_precision, has_bias)
        tier = tier_for(x, dweight, dbias, multi_precision, has_bias, dout=dout)
    if _strided(dweight) or _strided(dbias):
        # Paddle's custom-op runner would hand the C++ op a contiguous temporary and drop
        # what it wrote: compute into our own contiguous copies and write them back.
        w_tmp, b_tmp = _contiguous(dweight), _contiguous(dbias)
        _on_tier(x, dout, w_tmp, b_tmp, multi_precision, has_bias, tier)
        with paddle.no_grad():
            for view, tmp in ((dweight, w_tmp), (dbias, b_tmp)):
                if view is not None and tmp is not view:
                    paddle.assign(tmp, output=view)
        return dweight, dbias
    return _on_tier(x, dout, dweight, dbias, multi_precision, has_bias, tier)


def accumulate_checked(x, dout, dweight, dbias, multi_precision, has_bias, x_name=None):
    """:func:`fused_linear_param_grad_add` for callers that pass real bools (our linears'
    backward) and may know ``x``'s dtype name already (one pybind call fewer); the same checks,
    results and errors."""
    done = fast_cpu_call(
        x, dout, dweight, dbias if has_bias else None, multi_precision, has_bias, x_name
    )
    if done is not None:
        return done
    return _checked(x, dout, dweight, dbias, multi_precision, has_bias)
