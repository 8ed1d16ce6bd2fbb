"""The fused weight-gradient op: ``dW += xᵀ·dy`` (beta = 1) into fp32 ``main_grad``.

:func:`fused_linear_param_grad_add` has the semantics of Paddle's GPU-only
``_C_ops.fused_linear_param_grad_add`` and runs our C++ op (CPU: oneDNN GEMM
with beta = 1, or a portable OpenMP kernel; CUDA: cuBLASLt when Paddle is
built with CUDA).  If the op cannot be built, a pure-Paddle fallback with the
same results is used and one warning says why.  :func:`backend` tells which.

Inputs: float32, bfloat16, float16, float64 (float64 accumulates in float64:
Paddle's MPTypeTrait<double> is double); any of M, K, N may be 0.

Environment: ``PADDLE_MGRAD_OPS=python`` forces the fallback;
``PADDLE_MGRAD_CACHE`` moves the JIT build cache; ``PADDLE_MGRAD_CPU_BF16=native|widen``
forces how bf16 inputs run on the CPU (default ``auto``: oneDNN's bf16 GEMM on CPUs
with native bf16, else widen to fp32 in row chunks + fp32 GEMM; see :func:`cpu_info`).
"""
from __future__ import annotations

import os
import threading
import warnings

from .._compat import paddle
from ..errors import FusedLinearError
from . import _reference

__all__ = ["fused_linear_param_grad_add", "backend", "cpu_info", "load"]

_SUPPORTED = ("float32", "bfloat16", "float16", "float64")
_lock = threading.Lock()
_state = {"module": None, "backend": None, "why": None}


def _dtype_name(dt) -> str:
    return str(dt).replace("paddle.", "")


def load():
    """Load (or build) the C++ op once; returns its module or None (fallback)."""
    if _state["backend"] is not None:
        return _state["module"]
    with _lock:
        if _state["backend"] is not None:
            return _state["module"]
        if os.environ.get("PADDLE_MGRAD_OPS", "").lower() == "python":
            _state.update(backend="python", why="PADDLE_MGRAD_OPS=python")
            return None
        try:
            from . import _build

            module = _build.load_op_module()
            info = getattr(module, "pmg_backend_info")(paddle.zeros([1])).numpy()
            gemm = "onednn" if info[0] == 1 else "portable"
            _state.update(module=module, backend=f"cpp-{gemm}" + ("+cuda" if info[1] else ""))
        except Exception as e:  # no compiler, failed build, missing headers...
            _state.update(backend="python", why=f"{type(e).__name__}: {e}".strip()[:2000])
            warnings.warn(
                "paddle_mgrad: the C++ fused weight-gradient op could not be built, using the "
                f"pure-Paddle fallback (same results, slower). Reason: {_state['why']}",
                RuntimeWarning, stacklevel=3)
        return _state["module"]


def backend() -> str:
    """``'cpp-onednn'``, ``'cpp-portable'`` (``+cuda`` when built with CUDA) or ``'python'``."""
    load()
    return _state["backend"]


_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16",
              "amx_tile")


def cpu_info() -> dict:
    """What the CPU path does with bf16 inputs, decided at run time by the C++ op.

    ``{"isa": "avx2 fma f16c", "native_bf16": False, "bf16_path": "widen-sgemm"}``:
    ``isa`` lists the relevant flags of ``/proc/cpuinfo``; ``native_bf16`` is the op's
    cpuid check (avx512_bf16 or AMX-BF16 usable); ``bf16_path`` is how a bf16 call runs
    now: ``"onednn-bf16"`` (oneDNN's bf16 GEMM), ``"widen-sgemm"`` (widen in row chunks
    + fp32 GEMM), or ``"python"`` (fallback).  ``PADDLE_MGRAD_CPU_BF16=native|widen``
    forces a path (read on every call).
    """
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = " ".join(f for f in _ISA_FLAGS if f in flags) or "unknown"
    module = load()
    if module is None:
        return {"isa": isa, "native_bf16": None, "bf16_path": "python"}
    info = module.pmg_backend_info(paddle.zeros([1])).numpy()
    path = {1: "onednn-bf16", 0: "widen-sgemm"}.get(int(info[3]), "invalid PADDLE_MGRAD_CPU_BF16")
    return {"isa": isa, "native_bf16": bool(info[2]), "bf16_path": path}


def fallback_reason():
    load()
    return _state["why"]


def mp_dtype(dtype) -> str:
    """Paddle's MPTypeTrait: the multi-precision accumulator of an input dtype
    (float64 for float64, float32 for everything else we support)."""
    return "float64" if _dtype_name(dtype) == "float64" else "float32"


def acc_dtypes(dtype, multi_precision) -> set:
    """THE accumulator rule (the C++ core's ``pmg::acc_dtype_ok`` is the other half):
    with multi_precision the accumulator is ``mp_dtype(dtype)``; without it, that or
    the input dtype itself."""
    mp = mp_dtype(dtype)
    return {mp} if multi_precision else {mp, _dtype_name(dtype)}


def _check(x, dout, dweight, dbias, multi_precision, has_bias):
    def bad(msg):
        raise FusedLinearError(
            f"fused_linear_param_grad_add: {msg} (x {list(x.shape)} {_dtype_name(x.dtype)}, "
            f"dout {list(dout.shape)} {_dtype_name(dout.dtype)}"
            + (f", dweight {list(dweight.shape)} {_dtype_name(dweight.dtype)}" if dweight is not None else "")
            + (f", dbias {list(dbias.shape)} {_dtype_name(dbias.dtype)}" if dbias is not None else "")
            + ")")

    if not isinstance(x, paddle.Tensor) or not isinstance(dout, paddle.Tensor):
        raise FusedLinearError("fused_linear_param_grad_add: x and dout must be paddle Tensors")
    if len(x.shape) < 2:
        bad(f"x must be at least 2-D [..., K], got {len(x.shape)}-D")
    if len(dout.shape) != len(x.shape) or list(x.shape[:-1]) != list(dout.shape[:-1]):
        bad("x [..., K] and dout [..., N] must have the same leading dims")
    if _dtype_name(x.dtype) not in _SUPPORTED:
        bad(f"unsupported dtype {_dtype_name(x.dtype)}; supported: {', '.join(_SUPPORTED)}")
    if x.dtype != dout.dtype:
        bad("x and dout must have the same dtype")
    K, N = x.shape[-1], dout.shape[-1]
    acc_ok = acc_dtypes(x.dtype, multi_precision)
    if dweight is not None:
        if list(dweight.shape) != [K, N]:
            bad(f"dweight must be [K, N] = [{K}, {N}]")
        if _dtype_name(dweight.dtype) not in acc_ok:
            bad(f"dweight must be {' or '.join(sorted(acc_ok))}"
                + (" when multi_precision=True" if multi_precision else ""))
        if str(x.place) != str(dweight.place):
            bad(f"dweight must be on the same device as x ({x.place} vs {dweight.place})")
    if dbias is not None and has_bias:
        if list(dbias.shape) != [N]:
            bad(f"dbias must be [N] = [{N}]")
        if _dtype_name(dbias.dtype) not in acc_ok:
            bad(f"dbias must be {' or '.join(sorted(acc_ok))}"
                + (" when multi_precision=True" if multi_precision else ""))


def _contiguous(t):
    if t is not None and hasattr(t, "is_contiguous") and not t.is_contiguous():
        return t.contiguous()
    return t


def fused_linear_param_grad_add(x, dout, dweight=None, dbias=None, multi_precision=True,
                                has_bias=True):
    """Accumulate a linear layer's weight (and bias) gradient in place.

    ``dweight += x2ᵀ · dout2`` and ``dbias += Σ_rows dout2`` where ``x2``/``dout2``
    are ``x``/``dout`` flattened to 2-D.  A given ``dweight``/``dbias`` is updated in
    place (same ``data_ptr()``) and returned; ``None`` allocates a fresh one (fp32
    when ``multi_precision``).  Returns ``(dweight, dbias)``; ``dbias`` is None when
    ``has_bias`` is false.  Raises :class:`FusedLinearError` on bad shapes/dtypes.
    """
    _check(x, dout, dweight, dbias, multi_precision, has_bias)
    if dweight is not None and hasattr(dweight, "is_contiguous") and not dweight.is_contiguous():
        raise FusedLinearError("fused_linear_param_grad_add: dweight must be contiguous "
                               "(it is updated in place)")
    module = load()
    # K = 0 or N = 0: a zero-size [K, N] result, which Paddle 2.6's custom-op runtime rejects
    # as "not initialized"; the reference handles it without a GEMM.
    if module is None or 0 in (x.shape[-1], dout.shape[-1]):
        return _reference.fused_linear_param_grad_add(x, dout, dweight, dbias if has_bias else None,
                                                      multi_precision, has_bias)
    x, dout = _contiguous(x), _contiguous(dout)
    with paddle.no_grad():
        dw, db = module.pmg_fused_wgrad_add(
            x, dout, dweight, dbias if has_bias else None, bool(multi_precision), bool(has_bias))
    if dweight is not None:
        dw = dweight  # the op wrote into dweight's allocation; hand back the caller's object
    if not has_bias:
        return dw, None
    return dw, (dbias if dbias is not None else db)
