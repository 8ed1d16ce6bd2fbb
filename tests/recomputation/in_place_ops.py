"""In-place ops as real models apply them inside a recompute block (shared by
test_in_place_ops.py and the differential fuzzer, recompute_fuzz.py).

Each entry of :data:`IN_PLACE` takes a tensor that needs a gradient, changes it in place and
returns the tensor the model goes on with (the same object for every op but fleet's all-reduce,
which returns it too, as Paddle's does).  What they stand for:

* ``add_``, ``scale_``, ``multiply_``: a residual or a scaling written in place (PaddleFormers'
  qwen/glm/gemma/ernie families do such ops after their linears);
* ``relu_``, ``tanh_``: in-place activations (``F.relu_``, ``paddle.tanh_``);
* ``assign_out``: ``paddle.assign(value, output=y)``;
* ``mp_allreduce``: fleet's ``RowParallelLinear`` after its linear -- Paddle's own
  ``mp_allreduce_eager`` PyLayer, whose forward all-reduces its input in place and returns it,
  with a one-process group whose ``all_reduce_on_calc_stream`` does what a sum over two ranks
  holding equal values does (doubles the tensor in place: gloo rejects the calc-stream
  collectives, NOTES.md) and ``skip_c_identity_dynamic`` (the backward returns ``dy``:
  ``c_identity`` has no CPU kernel).  Test-only stand-in for the transport, Paddle's PyLayer.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle.distributed.fleet.layers.mpu.mp_ops import mp_allreduce_eager


class _OneProcessGroup:
    """A model-parallel group of one process standing for two ranks with equal values."""

    id = 0

    class process_group:  # (the attribute name Paddle reads)
        @staticmethod
        def all_reduce_on_calc_stream(tensor, op):
            tensor.scale_(2.0)


def _mp_allreduce(y):
    return mp_allreduce_eager.apply(
        y, _OneProcessGroup, True, True, paddle.distributed.ReduceOp.SUM, True
    )


def _assign_out(y):
    paddle.assign(y * 0.5 + 1.0, output=y)
    return y


IN_PLACE = {
    "add_": lambda y: y.add_(paddle.full_like(y, 0.25)),
    "scale_": lambda y: y.scale_(0.5, 0.125),
    "multiply_": lambda y: y.multiply_(paddle.full_like(y, 0.75)),
    "relu_": F.relu_,
    "tanh_": paddle.tanh_,
    "assign_out": _assign_out,
    "mp_allreduce": _mp_allreduce,
}
