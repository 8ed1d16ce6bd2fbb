"""The fused weight-gradient op: ``dW += xᵀ·dy`` (beta = 1) into fp32 ``main_grad``.

:func:`fused_linear_param_grad_add` has the semantics of Paddle's GPU-only
``_C_ops.fused_linear_param_grad_add`` and runs our C++ op (CPU: oneDNN GEMM
with beta = 1, or a portable OpenMP kernel; CUDA: cuBLASLt when Paddle is
built with CUDA).  If the op cannot be built, a pure-Paddle fallback with the
same results is used and one warning says why.  :func:`backend` tells which.

Inputs: float32, bfloat16, float16, float64 (float64 accumulates in float64:
Paddle's MPTypeTrait<double> is double); any of M, K, N may be 0.

Tiers, per place:

* CPU tensors: our C++ op (``cpp-onednn`` / ``cpp-portable``), else the pure-Paddle fallback.
* GPU tensors: our CUDA op (cuBLASLt) when it was built (``+cuda``); else Paddle's own
  ``_C_ops.fused_linear_param_grad_add`` when the wheel has its GPU kernel (``paddle-fused``;
  zero-size calls, which its kernel divides by, go to the fallback); else the pure-Paddle
  fallback.  A missing CUDA toolkit part costs only the CUDA part: the CPU op still loads, and
  one warning names what is missing and how to install it.
* Any other place (XPU, custom devices, CUDA-pinned memory): the pure-Paddle fallback.

Every input is checked before anything is written (:mod:`._inputs`: types, the
``multi_precision``/``has_bias`` flags, shapes, dtypes, and that every tensor is on ``x``'s
place).  A non-contiguous ``dweight``/``dbias`` (a strided view into a flat gradient buffer) is
written through: the op runs on a contiguous copy that is then copied back into the view.

:func:`backend` returns e.g. ``cpp-onednn+cuda``, ``cpp-onednn;gpu=paddle-fused`` (CUDA Paddle
without our CUDA build) or ``cpp-onednn`` (CPU Paddle); :func:`backends` the same as a dict and
:func:`describe` one log line.

Environment (declared and validated in :mod:`paddle_mgrad.env`): ``PADDLE_MGRAD_OPS=python``
forces the fallback; ``PADDLE_MGRAD_NO_CUDA=1`` skips our CUDA part; ``PADDLE_MGRAD_CACHE`` moves
the JIT build cache; ``CUDA_HOME`` picks the toolkit; ``PADDLE_MGRAD_CPU_BF16=native|widen``
forces how bf16 inputs run on the CPU (default ``auto``: oneDNN's bf16 GEMM on CPUs with native
bf16, else widen to fp32 in row chunks + fp32 GEMM; see :func:`cpu_info`).  The C++ op reads the
``PADDLE_MGRAD_CPU_*`` knobs on every call; a value changed after import to one they do not
accept fails the call with :class:`~paddle_mgrad.env.EnvError` (the C++ op checks again).

The modules, one concern each: :mod:`.loader` (the load and what it settled: tiers, reasons,
the fast entry), :mod:`.dispatch` (the checked call and the tier choice), :mod:`.entries` (the
fast paths), :mod:`.devices` (where a tensor is, and :func:`override`, which tests use to fake
devices and force tiers), :mod:`._inputs` (the input checks), :mod:`._reference` (the
pure-Paddle fallback), :mod:`.strided` (strided accumulators); :mod:`._build` and its helpers
build and cache the op library.
"""

from __future__ import annotations

from . import _inputs, devices, dispatch, entries, loader

__all__ = ["fused_linear_param_grad_add", "backend", "backends", "describe", "cpu_info", "load"]

fused_linear_param_grad_add = dispatch.fused_linear_param_grad_add
backend = loader.backend
backends = loader.backends
describe = loader.describe
cpu_info = loader.cpu_info
load = loader.load
fallback_reason = loader.fallback_reason
cuda_fallback_reason = loader.cuda_fallback_reason
override = devices.override

# for the package's own modules (the fused linears' backward, the fleet's ops), as ``ops.<name>``
accumulate_checked = dispatch.accumulate_checked
cpu_entry = entries.cpu_entry
gpu_entry = entries.gpu_entry
cpu_runner = entries.cpu_runner
mp_dtype = _inputs.mp_dtype
acc_dtypes = _inputs.acc_dtypes
_dtype_name = _inputs.dtype_name
_SUPPORTED = _inputs.SUPPORTED

#: the op library's ``route`` (``csrc/wgrad_pyentry.cc``: routing.route's answer from the
#: tensors' meta in one call) once the library is loaded with its fast entry, else None; set by
#: the loader (``loader._set_fast``), read by the fused linear on every forward
fast_route = None
