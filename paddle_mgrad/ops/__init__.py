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
"""
from __future__ import annotations

import threading
import warnings

from .._compat import HAS_PADDLE_FUSED_WGRAD, paddle, run_custom_op, tracer as _tracer
from ..env import get as env_get
from . import _inputs, _reference
from ._inputs import SUPPORTED as _SUPPORTED, acc_dtypes, mp_dtype  # noqa: F401 (linear.py)

__all__ = ["fused_linear_param_grad_add", "backend", "backends", "describe", "cpu_info", "load"]

_lock = threading.Lock()
_state = {"module": None, "backend": None, "why": None, "cpu": None, "gpu": None,
          "cuda_why": None, "fast": None}
#: the op library's ``route`` (``csrc/wgrad_pyentry.cc``: routing.route's answer from the
#: tensors' meta in one call) once the library is loaded with its fast entry, else None
fast_route = None
_GEMM_NAMES = {"cpp-onednn": "C++ op, oneDNN GEMM", "cpp-portable": "C++ op, OpenMP GEMM",
               "python": "pure-Paddle fallback", "cuda": "paddle_mgrad CUDA op (cuBLASLt)",
               "paddle-fused": "Paddle's _C_ops.fused_linear_param_grad_add"}


_dtype_name = _inputs.dtype_name


def _paddle_has_gpu_fused_op() -> bool:
    """This Paddle has ``_C_ops.fused_linear_param_grad_add`` with a GPU kernel (CUDA wheels;
    CPU wheels have the Python binding but no kernel)."""
    if not HAS_PADDLE_FUSED_WGRAD:
        return False
    try:
        kernels = paddle.framework.core._get_all_register_op_kernels("phi")
    except Exception:  # registry API moved: trust the binding on a CUDA build
        return paddle.is_compiled_with_cuda()
    return any("gpu" in str(k).lower() for k in kernels.get("fused_linear_param_grad_add", ()))


def _compose(cpu, gpu):
    """The backend string: the CPU tier, ``+cuda`` for our CUDA op, else ``;gpu=<tier>``."""
    if gpu is None:
        return cpu
    if gpu == "cuda":
        return f"{cpu}+cuda"
    return f"{cpu};gpu={gpu}"


def load():
    """Load (or build) the C++ op once; returns its module or None (fallback)."""
    if _state["backend"] is not None:
        return _state["module"]
    with _lock:
        if _state["backend"] is not None:
            return _state["module"]
        cuda_paddle = paddle.is_compiled_with_cuda()
        if env_get("PADDLE_MGRAD_OPS") == "python":
            gpu = "python" if cuda_paddle else None
            _state.update(cpu="python", gpu=gpu, backend=_compose("python", gpu),
                          why="PADDLE_MGRAD_OPS=python")
            return None
        module = None
        try:
            from . import _build

            module, cuda_why = _build.load_op_module()
            info = module.pmg_backend_info(paddle.zeros([1])).numpy()
            cpu = "cpp-onednn" if info[0] == 1 else "cpp-portable"
            has_cuda = bool(info[1])
        except Exception as e:  # no compiler, failed build, missing headers...
            module, cpu, has_cuda, cuda_why = None, "python", False, None
            _state["why"] = f"{type(e).__name__}: {e}".strip()[:2000]
            warnings.warn(
                "paddle_mgrad: the C++ fused weight-gradient op could not be built, using the "
                f"pure-Paddle fallback (same results, slower). Reason: {_state['why']}",
                RuntimeWarning, stacklevel=3)
        gpu = None
        if has_cuda:
            gpu = "cuda"
        elif cuda_paddle:
            gpu = "paddle-fused" if _paddle_has_gpu_fused_op() else "python"
            if cuda_why and module is not None:  # one warning: what is missing, how to install
                warnings.warn(
                    f"paddle_mgrad: CUDA part of the fused weight-gradient op not built ({cuda_why}); "
                    f"CPU tensors use the C++ op ({cpu}), GPU tensors use "
                    f"{_GEMM_NAMES[gpu]}", RuntimeWarning, stacklevel=3)
        _set_fast(getattr(module, "__pmg_fast__", None))
        _state.update(module=module, cpu=cpu, gpu=gpu, cuda_why=cuda_why,
                      backend=_compose(cpu, gpu))
        return _state["module"]


def _set_fast(fast):
    """Install the op library's fast entry (or None): :data:`fast_route`, :func:`cpu_entry`,
    :func:`gpu_entry`."""
    global fast_route
    _state["fast"] = fast
    fast_route = None if fast is None else fast.route


def backend() -> str:
    """Which implementation runs where, e.g. ``'cpp-onednn+cuda'``.

    The CPU tier first: ``'cpp-onednn'``, ``'cpp-portable'`` or ``'python'``; then, on a CUDA
    Paddle, ``'+cuda'`` when our CUDA op is built, else ``';gpu=paddle-fused'`` or
    ``';gpu=python'``.  (``"+cuda" in backend()`` and ``backend().startswith("cpp-")`` keep
    their meaning.)
    """
    load()
    return _state["backend"]


_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16",
              "amx_tile")


def cpu_info() -> dict:
    """What the CPU path does with bf16 inputs, decided at run time by the C++ op.

    ``{"isa": "avx2 fma f16c", "native_bf16": False, "bf16_path": "widen-sgemm",
    "bf16_exact_fallbacks": 0}``: ``isa`` lists the relevant flags of ``/proc/cpuinfo``;
    ``native_bf16`` is the op's check that the CPU has avx512_bf16 or AMX-BF16 (cpuid, usable
    by the OS) AND that oneDNN uses them (``ONEDNN_MAX_CPU_ISA=AVX2`` says no: then oneDNN's
    bf16 GEMM is its slow reference kernel); ``bf16_path`` is how a bf16 call runs now:
    ``"onednn-bf16"`` (oneDNN's bf16 GEMM), ``"widen-sgemm"`` (widen in row chunks + fp32
    GEMM), or ``"python"`` (fallback).  ``PADDLE_MGRAD_CPU_BF16=native|widen`` forces a path
    (read on every call).  ``bf16_exact_fallbacks`` counts the bf16 calls (this process) that
    the oneDNN path sent to the widen path because native bf16 hardware would have flushed a
    subnormal (a subnormal input, or inputs small enough that a product could underflow):
    both paths give IEEE fp32 results with gradual underflow.
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
        return {"isa": isa, "native_bf16": None, "bf16_path": "python", "bf16_exact_fallbacks": 0}
    info = module.pmg_backend_info(paddle.zeros([1])).numpy()
    path = {1: "onednn-bf16", 0: "widen-sgemm"}.get(int(info[3]), "invalid PADDLE_MGRAD_CPU_BF16")
    return {"isa": isa, "native_bf16": bool(info[2]), "bf16_path": path,
            "bf16_exact_fallbacks": int(info[4])}


def backends() -> dict:
    """``{"cpu": tier, "gpu": tier or None}``; GPU is None on a CPU-only Paddle."""
    load()
    return {"cpu": _state["cpu"], "gpu": _state["gpu"]}


def fallback_reason():
    """Why the CPU op is the pure-Paddle fallback (None when the C++ op loaded)."""
    load()
    return _state["why"]


def cuda_fallback_reason():
    """Why our CUDA part is missing on a CUDA Paddle (None when built, or on CPU Paddle)."""
    load()
    return _state["cuda_why"]


def describe() -> str:
    """One log line: what runs where (for trainer/env activation logs)."""
    load()
    line = (f"paddle_mgrad fused weight-gradient op [{_state['backend']}]: "
            f"CPU: {_GEMM_NAMES[_state['cpu']]}")
    if _state["why"]:
        line += f" ({_state['why'][:200]})"
    if _state["gpu"] is not None:
        line += f"; GPU: {_GEMM_NAMES[_state['gpu']]}"
        if _state["cuda_why"] and _state["gpu"] != "cuda":
            line += f" (our CUDA op not built: {_state['cuda_why'][:300]})"
    return line


def _is_gpu(t) -> bool:
    try:
        return bool(t.place.is_gpu_place())
    except AttributeError:
        return False


def _is_cpu(t) -> bool:
    try:
        return bool(t.place.is_cpu_place())
    except AttributeError:
        return False


def _tier_for(x, dweight, dbias, multi_precision, has_bias, dout=None) -> str:
    """``'cpp'`` (our module, CPU or CUDA), ``'paddle-fused'`` or ``'python'`` for this call.

    Our C++ op takes CPU tensors, and GPU tensors when its CUDA part is built; other places
    (XPU, custom devices, CUDA-pinned memory) go to the pure-Paddle reference, which runs
    wherever Paddle's own ops do."""
    module = load()
    if not _is_gpu(x):
        return "cpp" if module is not None and _is_cpu(x) else "python"
    gpu = _state["gpu"]
    if gpu == "cuda":
        return "cpp"
    if gpu == "paddle-fused":
        # Paddle's kernel computes M = x.numel() / K: K = 0 divides by zero (SIGFPE), and an
        # MoE expert that got no tokens (M = 0) is a zero-size GEMM; the reference is exact.
        N = dout.shape[-1] if dout is not None else (
            dweight.shape[-1] if dweight is not None else 1)
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
            x2, d2, dweight, dbias if has_bias else None, bool(multi_precision), bool(has_bias))
    for given, got in ((dweight, dw), (dbias if has_bias else None, db)):
        if given is not None and got is not None and got.data_ptr() != given.data_ptr():
            paddle.assign(got, output=given)
    dw = dweight if dweight is not None else dw
    if not has_bias:
        return dw, None
    return dw, (dbias if dbias is not None else db)


def _strided(t) -> bool:
    return t is not None and hasattr(t, "is_contiguous") and not t.is_contiguous()


def _contiguous(t):
    """``t``, or a contiguous copy of a strided view.  (Not ``t.contiguous()``: in Paddle 2.6 and
    3.x that converts the tensor itself, detaching the caller's view from its base buffer.)"""
    if not _strided(t):
        return t
    with paddle.no_grad():
        return paddle.assign(t)


#: the environment knobs the C++ CPU op reads, per input dtype (checked per call: tests and
#: users may change them after import; the op checks them again itself)
_CPU_KNOBS = {"bfloat16": ("PADDLE_MGRAD_CPU_BF16", "PADDLE_MGRAD_CPU_CHUNK_ROWS"),
              "float16": ("PADDLE_MGRAD_CPU_CHUNK_ROWS",),
              "float64": ("PADDLE_MGRAD_CPU_FP64_KERNEL",)}


def fused_linear_param_grad_add(x, dout, dweight=None, dbias=None, multi_precision=True,
                                has_bias=True):
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
    done = _fast_cpu_call(x, dout, dweight, dbias if has_bias else None, multi_precision,
                          has_bias)
    if done is not None:
        return done
    _inputs.check(x, dout, dweight, dbias, multi_precision, has_bias)
    if not has_bias:
        dbias = None
    if _strided(dweight) or _strided(dbias):
        # Paddle's custom-op runner would hand the C++ op a contiguous temporary and drop
        # what it wrote: compute into our own contiguous copies and write them back.
        w_tmp, b_tmp = _contiguous(dweight), _contiguous(dbias)
        _dispatch(x, dout, w_tmp, b_tmp, multi_precision, has_bias)
        with paddle.no_grad():
            for view, tmp in ((dweight, w_tmp), (dbias, b_tmp)):
                if view is not None and tmp is not view:
                    paddle.assign(tmp, output=view)
        return dweight, dbias
    return _dispatch(x, dout, dweight, dbias, multi_precision, has_bias)


_RAW = {"run": None, "for": None}  # the raw runner, for which loaded module


def accumulate_checked(x, dout, dweight, dbias, multi_precision, has_bias, x_name=None):
    """:func:`fused_linear_param_grad_add` for callers that pass real bools (our linears'
    backward) and may know ``x``'s dtype name already (one pybind call fewer); the same checks,
    results and errors."""
    done = _fast_cpu_call(x, dout, dweight, dbias if has_bias else None, multi_precision,
                          has_bias, x_name)
    if done is not None:
        return done
    return fused_linear_param_grad_add(x, dout, dweight, dbias, multi_precision, has_bias)


def cpu_runner(x_name):
    """The raw runner of our C++ op (``run("pmg_fused_wgrad_add", x, dout, dweight, dbias,
    multi_precision, has_bias)``) for a CPU call whose inputs are ``x_name`` tensors, or None
    when the fast path must not run: our module not loaded, a test's place, tier or GPU seam
    in place (the faked devices live there), or an environment knob of that dtype invalid (the
    checked path raises its EnvError after the input checks).

    The caller vouches for the rest of the common case (:func:`_fast_cpu_call`): plain dense
    CPU tensors in dynamic mode, contiguous accumulators, K, N > 0; the op checks the rest
    itself before it writes anything, and a caller whose call it refuses takes the checked
    path, which raises the usual error."""
    module = _state["module"]
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
    fast = _state["fast"]
    if fast is None or not _fast_path_ok(x_name):
        return None
    return fast


def gpu_entry():
    """The op library's fast entry for a GPU call (its ``wgrad_add``: our CUDA kernel, on
    Paddle's stream, no custom-op dispatch), or None: the library has no entry or no CUDA part
    (the GPU tier is Paddle's fused op or the reference, decided once by :func:`load`), or a
    test replaced a seam.  The kernel checks places, dtypes, shapes and its environment
    settings before it writes anything; the entry returns None when it refuses."""
    fast = _state["fast"]
    if fast is None or _state["gpu"] != "cuda" or not _fast_path_ok(None):
        return None
    return fast


def _fast_path_ok(x_name) -> bool:
    """Whether a fast path may run: no test seam replaced (the faked devices live there), and
    every environment knob the CPU op reads for ``x_name`` inputs valid (the checked path
    raises its EnvError after the input checks; None: no CPU knob to check)."""
    if _inputs.place is not _PLACE_SEAM or _tier_for is not _TIER_SEAM or _is_gpu is not _GPU_SEAM:
        return False
    knobs = _CPU_KNOBS.get(x_name)
    if knobs:
        try:
            for name in knobs:
                env_get(name)
        except Exception:  # noqa: BLE001 -- the slow path raises it after the input checks
            return False
    return True


def _fast_cpu_call(x, dout, dweight, dbias, multi_precision, has_bias, x_name=None):
    """The common call -- CPU tensors, our C++ op loaded, contiguous accumulators, K, N > 0 --
    without the Python-side checks, which the op makes itself before it writes anything:
    ranks, leading dims, dtypes (supported, x == dout, the accumulator rule with and without
    multi_precision), shapes of dweight/dbias, every tensor on x's device (``wgrad_op.cc``,
    ``pmg::check_places``/``check_args``).  When the op refuses the call,
    :func:`._inputs.check` runs and raises the :class:`FusedLinearError` it always raised (the
    same text); should it find nothing, the op's own error is re-raised.

    Returns ``(dweight, dbias)`` as :func:`fused_linear_param_grad_add` does, or None when the
    call is not this common case (the caller then checks in Python and dispatches as before).
    ``dbias`` is None already when ``has_bias`` is false.  Also None while a test replaces
    the place seam (``_inputs.place``), the tier choice or ``_is_gpu``: the faked devices
    live there (:func:`cpu_runner`)."""
    if not (isinstance(x, paddle.Tensor) and isinstance(dout, paddle.Tensor)):
        return None
    if dweight is not None and (not isinstance(dweight, paddle.Tensor) or _strided(dweight)):
        return None
    if dbias is not None and (not isinstance(dbias, paddle.Tensor) or _strided(dbias)):
        return None
    xs, ys = x.shape, dout.shape
    if len(xs) < 2 or not xs[-1] or not ys or not ys[-1] or not paddle.in_dynamic_mode():
        return None  # K = 0 / N = 0: the reference (see _dispatch); bad ranks: checked below
    # _tier_for's answer for these tensors ("cpp" for a CPU x with our module loaded) from one
    # place object (each ``.place`` read builds a new one); GPU tensors and other places take
    # the checked path (their tier, see _tier_for).  cpu_runner steps aside while a test
    # fakes the places (the _is_gpu seam).
    run = cpu_runner(x_name or _dtype_name(x.dtype))
    if run is None or not x.place.is_cpu_place():
        return None
    if not x.is_contiguous():
        x = _contiguous(x)
    if not dout.is_contiguous():
        dout = _contiguous(dout)
    # the op library's fast entry (no custom-op dispatch, no autograd node); None when it has
    # none or refused the call before writing: then the op's own call, which raises
    fast = _state["fast"]
    done = None if fast is None else fast.wgrad_add(x, dout, dweight, dbias, multi_precision,
                                                    has_bias)
    if done is not None:
        _, dw, db = done  # (None for an accumulator passed in: handed back below)
    else:
        try:
            if _tracer()._has_grad:
                with paddle.no_grad():
                    dw, db = run("pmg_fused_wgrad_add", x, dout, dweight, dbias,
                                 multi_precision, has_bias)
            else:  # a backward pass (or no_grad already): nothing to switch
                dw, db = run("pmg_fused_wgrad_add", x, dout, dweight, dbias, multi_precision,
                             has_bias)
        except Exception:
            _inputs.check(x, dout, dweight, dbias, multi_precision, has_bias)  # our error text
            raise
    if dweight is not None:
        dw = dweight  # the op wrote into dweight's allocation; hand back the caller's object
    if not has_bias:
        return dw, None
    return dw, (dbias if dbias is not None else db)


def _dispatch(x, dout, dweight, dbias, multi_precision, has_bias):
    """The checked call (contiguous accumulators) on the tier for its place."""
    tier = _tier_for(x, dweight, dbias, multi_precision, has_bias, dout=dout)
    if tier == "paddle-fused":
        return _paddle_fused(x, dout, dweight, dbias, multi_precision, has_bias)
    module = _state["module"] if tier == "cpp" else None
    # K = 0 or N = 0: a zero-size [K, N] result, which Paddle 2.6's custom-op runtime rejects
    # as "not initialized"; the reference handles it without a GEMM.
    if module is None or 0 in (x.shape[-1], dout.shape[-1]):
        return _reference.fused_linear_param_grad_add(x, dout, dweight, dbias,
                                                      multi_precision, has_bias)
    if _is_cpu(x):
        for name in _CPU_KNOBS.get(_dtype_name(x.dtype), ()):
            env_get(name)  # EnvError naming the variable and the accepted values
    x, dout = _contiguous(x), _contiguous(dout)
    with paddle.no_grad():
        dw, db = module.pmg_fused_wgrad_add(x, dout, dweight, dbias, multi_precision, has_bias)
    if dweight is not None:
        dw = dweight  # the op wrote into dweight's allocation; hand back the caller's object
    if not has_bias:
        return dw, None
    return dw, (dbias if dbias is not None else db)


# the seams as shipped: the fast path steps aside while a test replaces one of them
_PLACE_SEAM = _inputs.place
_TIER_SEAM = _tier_for
_GPU_SEAM = _is_gpu
