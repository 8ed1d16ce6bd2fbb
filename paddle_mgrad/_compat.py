"""What differs between the Paddle versions we support (2.6 and 3.x), in one place.

Every version or capability fact the package decides on is a name here, with one line of
why; modules import the fact, never compare versions or probe Paddle themselves
(``tests/test_compat.py`` keeps it so).

Paddle 2.6's ``libpaddle`` exports zlib's ``deflate*`` symbols; if ``zlib`` is
imported *after* paddle the interpreter can segfault (also when ``setup.py``
zips an egg).  Importing ``zlib`` first is harmless on 3.x, so we always do it.
"""

from __future__ import annotations

import types
import zlib  # noqa: F401  (must precede ``import paddle`` on Paddle 2.6)

import paddle
from paddle import _C_ops
from paddle.base.framework import EagerParamBase, global_var  # 2.6 and 3.x
from paddle.framework import core

_v = paddle.__version__.split(".")
try:
    PADDLE_VERSION = (int(_v[0]), int(_v[1]))
except ValueError:  # develop builds report "0.0.0"
    PADDLE_VERSION = (99, 0)
IS_PADDLE_2 = PADDLE_VERSION < (3, 0)

#: the build's commit, part of the op library's cache key (a rebuilt wheel of one version)
PADDLE_COMMIT = getattr(getattr(paddle, "version", None), "commit", "") or ""

#: Paddle 2.6 never releases what a saved-tensor pack hook returns (3.x holds it in a
#: ``shared_ptr``): the hook pair cannot stay registered between recomputations there
PACKED_VALUES_LEAK = IS_PADDLE_2

#: Paddle 2.6's ``TensorWrapper::recover`` moves the memory holder out of what an unpack hook
#: returns: it must get a tensor of its own (``recomputation.tensors.buffer_sharing_tensor``)
UNPACK_MOVES_HOLDER = IS_PADDLE_2

#: ``Tensor._new_shared_tensor`` (3.x): a shallow copy sharing buffer and inplace version, which
#: pipeline schedulers cannot free under us; 2.6 has none (the caller's tensor is kept)
HAS_SHARED_TENSOR_COPY = hasattr(core.eager.Tensor, "_new_shared_tensor")

#: ``paddle.nn.functional.linear`` is ``_C_ops.linear`` behind Python checks that cannot fail for
#: the inputs we route (2.6, and 3.x without CUDA, whose flag ``FLAGS_use_legacy_linear`` matters
#: only on CUDA): calling the op skips ~30 us of flag reading per call
LINEAR_IS_C_OP = IS_PADDLE_2 or not paddle.is_compiled_with_cuda()

#: ``main_grad`` is a plain instance attribute (``MixPrecisionLayer`` and PaddleNLP set it): read
#: from ``__dict__``, unless a Paddle ever defines it on the tensor classes
MAIN_GRAD_IN_DICT = not (
    hasattr(paddle.Tensor, "main_grad") or hasattr(EagerParamBase, "main_grad")
)

#: what ``getattr(t, "__dict__", NO_ATTRS)`` reads for a tensor without Python attributes: Paddle
#: 2.6's plain (non-parameter) tensors have no ``__dict__`` at all (so no ``main_grad`` either)
NO_ATTRS = types.MappingProxyType({})

#: ``_C_ops.fused_linear_param_grad_add`` has a Python binding (both versions; CPU wheels bind
#: it without a kernel: :func:`paddle_mgrad.ops` asks the kernel registry as well)
HAS_PADDLE_FUSED_WGRAD = hasattr(_C_ops, "fused_linear_param_grad_add")


def _memory_stats(where):
    now = getattr(core, f"{where}_memory_stat_current_value", None)
    peak = getattr(core, f"{where}_memory_stat_peak_value", None)
    return None if now is None or peak is None else (now, peak)


#: the allocator's statistics of the host and of a GPU: ``(now, peak)``, each called as
#: ``(stat name, device id)`` (2.6 and 3.x; a build without them: None) -- a ``budget:`` plan
#: reads what a step holds (``recomputation.memory``)
HOST_MEMORY_STATS = _memory_stats("host")
DEVICE_MEMORY_STATS = _memory_stats("device")

#: ``core.host_memory_stat_reset_peak_value(stat name, device id)`` (3.x): a step's own host peak
#: can be measured; 2.6 has none and keeps the process's peak (None)
HOST_MEMORY_RESET_PEAK = getattr(core, "host_memory_stat_reset_peak_value", None)


def run_custom_op():
    """Paddle's entry point for a custom op in dynamic mode, which the wrapper Paddle
    generates for our op calls: ``_C_ops._run_custom_op`` on 3.x, ``core.eager._run_custom_op``
    on 2.6 (None if neither: the generated wrapper is called instead)."""
    run = getattr(_C_ops, "_run_custom_op", None)
    if run is None:
        run = getattr(getattr(core, "eager", None), "_run_custom_op", None)
    return run


def tracer():
    return global_var._dygraph_tracer_  # paddle.framework._dygraph_tracer(), one call fewer


def is_tensor(x) -> bool:
    return isinstance(x, core.eager.Tensor)


def is_parameter(x) -> bool:
    return isinstance(x, EagerParamBase)
