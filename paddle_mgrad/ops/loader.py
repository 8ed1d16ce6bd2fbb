"""Loading the op once, and what the load settled: which tier runs where, and why.

:func:`load` builds (or finds in the cache) and loads the C++ op library on first use and
settles, for the process, the facts in :data:`state`: our module (or None: the pure-Paddle
fallback), the library's fast entry, the CPU tier, the GPU tier (our CUDA op, Paddle's fused
op, the fallback; None on a CPU Paddle) and the reasons for any fallback.  No call asks the
build, the kernel registry or ``is_compiled_with_cuda`` again: those are slow queries.

:func:`backend`, :func:`backends`, :func:`describe`, :func:`fallback_reason`,
:func:`cuda_fallback_reason` and :func:`cpu_info` report it.  Tests change a settled fact for a
block with :func:`settled`, and reload from a stubbed build inside :func:`unloaded`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings

from .._compat import HAS_PADDLE_FUSED_WGRAD, paddle
from ..env import get as env_get

_lock = threading.Lock()
#: what :func:`load` settled, read by the dispatch and the fast entries on every call; written
#: only by :func:`load`, :func:`settled` and :func:`unloaded` (updated in place: readers hold
#: the dict itself)
state = {
    "module": None,
    "backend": None,
    "why": None,
    "cpu": None,
    "gpu": None,
    "cuda_why": None,
    "fast": None,
}
_GEMM_NAMES = {
    "cpp-onednn": "C++ op, oneDNN GEMM",
    "cpp-portable": "C++ op, OpenMP GEMM",
    "python": "pure-Paddle fallback",
    "cuda": "paddle_mgrad CUDA op (cuBLASLt)",
    "paddle-fused": "Paddle's _C_ops.fused_linear_param_grad_add",
}


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
    if state["backend"] is not None:
        return state["module"]
    with _lock:
        if state["backend"] is not None:
            return state["module"]
        cuda_paddle = paddle.is_compiled_with_cuda()
        if env_get("PADDLE_MGRAD_OPS") == "python":
            gpu = "python" if cuda_paddle else None
            state.update(
                cpu="python",
                gpu=gpu,
                backend=_compose("python", gpu),
                why="PADDLE_MGRAD_OPS=python",
            )
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
            state["why"] = f"{type(e).__name__}: {e}".strip()[:2000]
            warnings.warn(
                "paddle_mgrad: the C++ fused weight-gradient op could not be built, using the "
                f"pure-Paddle fallback (same results, slower). Reason: {state['why']}",
                RuntimeWarning,
                stacklevel=3,
            )
        gpu = None
        if has_cuda:
            gpu = "cuda"
        elif cuda_paddle:
            gpu = "paddle-fused" if _paddle_has_gpu_fused_op() else "python"
            if cuda_why and module is not None:  # one warning: what is missing, how to install
                warnings.warn(
                    f"paddle_mgrad: CUDA part of the fused weight-gradient op not built ({cuda_why}); "
                    f"CPU tensors use the C++ op ({cpu}), GPU tensors use "
                    f"{_GEMM_NAMES[gpu]}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _set_fast(getattr(module, "__pmg_fast__", None))
        state.update(module=module, cpu=cpu, gpu=gpu, cuda_why=cuda_why, backend=_compose(cpu, gpu))
        return state["module"]


def _set_fast(fast):
    """Install the op library's fast entry (or None) and publish its ``route`` as the package's
    ``fast_route``: the fused linear reads ``ops.fast_route`` on every forward, where a plain
    module attribute is the cheapest question."""
    state["fast"] = fast
    sys.modules[__package__].fast_route = None if fast is None else fast.route


def backend() -> str:
    """Which implementation runs where, e.g. ``'cpp-onednn+cuda'``.

    The CPU tier first: ``'cpp-onednn'``, ``'cpp-portable'`` or ``'python'``; then, on a CUDA
    Paddle, ``'+cuda'`` when our CUDA op is built, else ``';gpu=paddle-fused'`` or
    ``';gpu=python'``.  (``"+cuda" in backend()`` and ``backend().startswith("cpp-")`` keep
    their meaning.)
    """
    load()
    return state["backend"]


def backends() -> dict:
    """``{"cpu": tier, "gpu": tier or None}``; GPU is None on a CPU-only Paddle."""
    load()
    return {"cpu": state["cpu"], "gpu": state["gpu"]}


def fallback_reason():
    """Why the CPU op is the pure-Paddle fallback (None when the C++ op loaded)."""
    load()
    return state["why"]


def cuda_fallback_reason():
    """Why our CUDA part is missing on a CUDA Paddle (None when built, or on CPU Paddle)."""
    load()
    return state["cuda_why"]


def describe() -> str:
    """One log line: what runs where (for trainer/env activation logs)."""
    load()
    line = (
        f"paddle_mgrad fused weight-gradient op [{state['backend']}]: "
        f"CPU: {_GEMM_NAMES[state['cpu']]}"
    )
    if state["why"]:
        line += f" ({state['why'][:200]})"
    if state["gpu"] is not None:
        line += f"; GPU: {_GEMM_NAMES[state['gpu']]}"
        if state["cuda_why"] and state["gpu"] != "cuda":
            line += f" (our CUDA op not built: {state['cuda_why'][:300]})"
    return line


_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile")


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
    return {
        "isa": isa,
        "native_bf16": bool(info[2]),
        "bf16_path": path,
        "bf16_exact_fallbacks": int(info[4]),
    }


_FACTS = ("module", "fast", "cpu", "gpu", "why", "cuda_why")


@contextlib.contextmanager
def _restored():
    """Restore every settled fact when the block ends, and the published fast route where the
    block changed the fast entry (a route a test put in place itself stays)."""
    saved = dict(state)
    try:
        yield
    finally:
        changed = state["fast"] is not saved["fast"]
        state.clear()
        state.update(saved)
        if changed:
            _set_fast(saved["fast"])


@contextlib.contextmanager
def settled(**facts):
    """For the block, the op as if :func:`load` had settled ``facts`` (the rest as it did).

    Keywords: ``module`` (our op module, or None: the fallback), ``fast`` (its fast entry, or
    None), ``cpu`` / ``gpu`` (the tiers, as :func:`backends` names them), ``why`` /
    ``cuda_why`` (the fallback reasons).  :func:`backend` and :func:`describe` report the
    tiers given.  A test fakes the GPU tier of a CUDA Paddle with
    ``settled(gpu="paddle-fused")``, and runs without the fast entry with
    ``settled(fast=None)``.  Everything is restored on exit.
    """
    unknown = set(facts) - set(_FACTS)
    if unknown:
        raise TypeError(f"settled: unknown facts {sorted(unknown)}; known: {', '.join(_FACTS)}")
    load()
    with _restored():
        fast = facts.pop("fast", state["fast"])
        state.update(facts)
        state["backend"] = _compose(state["cpu"], state["gpu"])
        if fast is not state["fast"]:
            _set_fast(fast)
        yield


@contextlib.contextmanager
def unloaded():
    """For the block, the op as before its first :func:`load`: the next call settles every
    fact again (tests stub ``_build.load_op_module`` to fake a build).  What was settled
    before is restored on exit."""
    with _restored():
        state.update(module=None, backend=None, why=None, cpu=None, gpu=None, cuda_why=None)
        _set_fast(None)
        yield
