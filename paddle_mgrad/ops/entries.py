"""The fast paths into our op: the common call without the Python-side checks.

The common call -- CPU tensors (or GPU tensors on our CUDA tier), our op loaded, contiguous
accumulators, K, N > 0 -- skips the checks in Python: the op makes them itself before it writes
anything (``wgrad_op.cc``, ``pmg::check_places``/``check_args``).  What this module hands out:

* :func:`cpu_entry` / :func:`gpu_entry`: the op library's fast entry (``csrc/wgrad_pyentry.cc``:
  the op's kernels without Paddle's custom-op dispatch), for the fused linear's backward;
* :func:`cpu_runner`: Paddle's raw custom-op runner for our op;
* :func:`fast_cpu_call`: a whole CPU call of the op through them.

Each steps aside (None) while :func:`~paddle_mgrad.ops.override` fakes devices or tiers (the
faked answers are used on the checked path only), and while an environment knob the CPU op
reads for the call's dtype is invalid (:func:`check_cpu_knobs`: the checked path raises its
EnvError after the input checks).
"""

from __future__ import annotations

from .._compat import paddle, run_custom_op, tracer as _tracer
from ..env import get as env_get
from . import _inputs, devices
from .loader import state as _loaded
from .strided import contiguous as _contiguous, is_strided as _strided

_dtype_name = _inputs.dtype_name

#: the environment knobs the C++ CPU op reads, per input dtype (checked per call: tests and
#: users may change them after import; the op checks them again itself)
_CPU_KNOBS = {
    "bfloat16": ("PADDLE_MGRAD_CPU_BF16", "PADDLE_MGRAD_CPU_CHUNK_ROWS"),
    "float16": ("PADDLE_MGRAD_CPU_CHUNK_ROWS",),
    "float64": ("PADDLE_MGRAD_CPU_FP64_KERNEL",),
}

_RAW = {"run": None, "for": None}  # the raw runner, for which loaded module


def check_cpu_knobs(x_name) -> None:
    """Raise :class:`~paddle_mgrad.env.EnvError` (naming the variable and the accepted values)
    if an environment knob the CPU op reads for ``x_name`` inputs is invalid."""
    for name in _CPU_KNOBS.get(x_name, ()):
        env_get(name)


def _fast_path_ok(x_name) -> bool:
    """Whether a fast path may run: no :func:`~paddle_mgrad.ops.override` in effect, and every
    environment knob the CPU op reads for ``x_name`` inputs valid (None: no CPU knob to check)."""
    if devices.overridden is not None:
        return False
    if x_name in _CPU_KNOBS:
        try:
            check_cpu_knobs(x_name)
        except Exception:  # noqa: BLE001 -- the slow path raises it after the input checks
            return False
    return True


def cpu_runner(x_name):
    """The raw runner of our C++ op (``run("pmg_fused_wgrad_add", x, dout, dweight, dbias,
    multi_precision, has_bias)``) for a CPU call whose inputs are ``x_name`` tensors, or None
    when the fast path must not run: our module not loaded, an override in effect, or an
    environment knob of that dtype invalid.

    The caller vouches for the rest of the common case (:func:`fast_cpu_call`): plain dense
    CPU tensors in dynamic mode, contiguous accumulators, K, N > 0; the op checks the rest
    itself before it writes anything, and a caller whose call it refuses takes the checked
    path, which raises the usual error."""
    module = _loaded["module"]
    if module is None or not _fast_path_ok(x_name):
        return None
    if _RAW["for"] is not module:
        _RAW.update(run=run_custom_op(), **{"for": module})
    return _RAW["run"]


def cpu_entry(x_name):
    """The op library's fast entry (``csrc/wgrad_pyentry.cc``: ``linear_bwd``, ``wgrad_add``,
    the op's kernels without Paddle's custom-op dispatch) for a CPU call whose inputs are
    ``x_name`` tensors, or None when :func:`cpu_runner` would be None or the library has no
    fast entry.  The caller vouches for the same common case as :func:`cpu_runner`'s; the
    entry itself returns None for a tensor that is not dense and contiguous, and when the
    kernel refuses the call (before writing anything)."""
    fast = _loaded["fast"]
    if fast is None or not _fast_path_ok(x_name):
        return None
    return fast


def gpu_entry():
    """The op library's fast entry for a GPU call (its ``wgrad_add``: our CUDA kernel, on
    Paddle's stream, no custom-op dispatch), or None: the library has no entry or no CUDA part
    (the GPU tier is Paddle's fused op or the reference, decided once by
    :func:`~paddle_mgrad.ops.load`), or an override is in effect.  The kernel checks places,
    dtypes, shapes and its environment settings before it writes anything; the entry returns
    None when it refuses."""
    fast = _loaded["fast"]
    if fast is None or _loaded["gpu"] != "cuda" or not _fast_path_ok(None):
        return None
    return fast


def fast_cpu_call(x, dout, dweight, dbias, multi_precision, has_bias, x_name=None):
    """The common CPU call of the op, checked by the op itself (see the module's docstring):
    ranks, leading dims, dtypes (supported, x == dout, the accumulator rule with and without
    multi_precision), shapes of dweight/dbias, every tensor on x's device.  When the op refuses
    the call, :func:`._inputs.check` runs and raises the :class:`FusedLinearError` it always
    raises (the same text); should it find nothing, the op's own error is re-raised.

    Returns ``(dweight, dbias)`` as :func:`~paddle_mgrad.ops.fused_linear_param_grad_add` does,
    or None when the call is not this common case (the caller then checks in Python and
    dispatches by tier).  ``dbias`` is None already when ``has_bias`` is false."""
    if not (isinstance(x, paddle.Tensor) and isinstance(dout, paddle.Tensor)):
        return None
    if dweight is not None and (not isinstance(dweight, paddle.Tensor) or _strided(dweight)):
        return None
    if dbias is not None and (not isinstance(dbias, paddle.Tensor) or _strided(dbias)):
        return None
    xs, ys = x.shape, dout.shape
    if len(xs) < 2 or not xs[-1] or not ys or not ys[-1] or not paddle.in_dynamic_mode():
        return None  # K = 0 / N = 0: the reference (see dispatch); bad ranks: checked there
    # the tier choice's answer for these tensors ("cpp" for a CPU x with our module loaded)
    # from one place object (each ``.place`` read builds a new one); GPU tensors and other
    # places take the checked path (their tier, see dispatch.tier_for)
    run = cpu_runner(x_name or _dtype_name(x.dtype))
    if run is None or not x.place.is_cpu_place():
        return None
    if not x.is_contiguous():
        x = _contiguous(x)
    if not dout.is_contiguous():
        dout = _contiguous(dout)
    # the op library's fast entry (no custom-op dispatch, no autograd node); None when it has
    # none or refused the call before writing: then the op's own call, which raises
    fast = _loaded["fast"]
    done = (
        None if fast is None else fast.wgrad_add(x, dout, dweight, dbias, multi_precision, has_bias)
    )
    if done is not None:
        _, dw, db = done  # (None for an accumulator passed in: handed back below)
    else:
        try:
            if _tracer()._has_grad:
                with paddle.no_grad():
                    dw, db = run(
                        "pmg_fused_wgrad_add", x, dout, dweight, dbias, multi_precision, has_bias
                    )
            else:  # a backward pass (or no_grad already): nothing to switch
                dw, db = run(
                    "pmg_fused_wgrad_add", x, dout, dweight, dbias, multi_precision, has_bias
                )
        except Exception:
            _inputs.check(x, dout, dweight, dbias, multi_precision, has_bias)  # our error text
            raise
    return hand_back(dweight, dbias, dw, db, has_bias)


def hand_back(dweight, dbias, dw, db, has_bias):
    """An op call's ``(dweight, dbias)`` result from what it returned (``dw``, ``db``): the
    caller's own accumulator objects where it passed them (the op wrote into their
    allocations), else the new tensors; ``dbias`` None without a bias."""
    dw = dweight if dweight is not None else dw
    if not has_bias:
        return dw, None
    return dw, (dbias if dbias is not None else db)
