"""What Paddle's overlap linears do on a GPU so that dx's collective really overlaps dW.

fleet's ``InnerOverlapLinear`` (``mp_layers.py``) and ``SPInnerOverlapLinear``
(``sequence_parallel_utils.py``) start the asynchronous collective of ``dx`` and then, before
the weight-gradient GEMM, check ``CUDA_DEVICE_MAX_CONNECTIONS``.  Unless it is 1 they

* warn once: with several hardware work queues the GPU may schedule the dW GEMM's blocks
  ahead of the collective's kernel and fill every SM with them, so the two run one after the
  other instead of side by side (one queue keeps the launch order);
* launch a tiny op, ``paddle.ones([512])`` ("using small operation to preempt GPU SMs for
  all_reduce to achieve overlap"), between the two launches.

Our replacements (:mod:`.overlap_linear`, :mod:`.sp_overlap_linear`) call
:func:`let_collective_start` at the same points.  Only for GPU tensors: on the CPU (gloo)
there are no SMs to share, and the warning would be noise.
"""

from __future__ import annotations

import os
import warnings

from .._compat import paddle

__all__ = ["let_collective_start"]

_state = {"warned": False}


def _on_gpu(t) -> bool:
    try:
        return bool(t.place.is_gpu_place())
    except AttributeError:
        return False


def _one_connection() -> bool:
    try:
        return int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "0")) == 1
    except ValueError:  # not a number: Paddle's int() would raise; treat it as "not 1"
        return False


def let_collective_start(tensor) -> bool:
    """After an asynchronous collective was started, before the dW GEMM: warn once and launch
    the small op when ``CUDA_DEVICE_MAX_CONNECTIONS`` is not 1 and ``tensor`` is on a GPU.
    Returns whether it launched."""
    if not _on_gpu(tensor) or _one_connection():
        return False
    if not _state["warned"]:
        _state["warned"] = True
        warnings.warn(
            "paddle_mgrad: an overlapped linear backward (mp_async_allreduce, "
            "sp_async_reduce_scatter or recompute_allgather) runs with CUDA_DEVICE_MAX_CONNECTIONS "
            f"={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', '(unset)')}; export "
            "CUDA_DEVICE_MAX_CONNECTIONS=1 so that the collective can overlap the weight-gradient "
            "GEMM (as Paddle's own overlap linears advise)",
            RuntimeWarning,
            stacklevel=3,
        )
    paddle.ones([512])  # the small launch between the collective and the GEMM
    return True
