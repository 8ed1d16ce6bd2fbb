"""CPU (gloo) stand-ins for the pieces of fleet hybrid parallelism Paddle has no CPU support for.

TEST-ONLY: used by ``tests/fleet/launch/train_hybrid.py`` so that tensor, sequence, sharding and
pipeline parallelism can run with 2 gloo ranks on a CPU machine.  Nothing here is part of
paddle_mgrad, and none of it changes what paddle_mgrad patches: each stand-in replaces a
Paddle communication primitive by the same math built on ``paddle.distributed``'s gloo
collectives (``all_reduce``, ``all_gather``, ``broadcast``, ``send``/``recv``).

Every stand-in names the Paddle limitation it works around.  :func:`install` replaces the
function object in *every* loaded module that holds it (modules bind these helpers by name).
"""
from __future__ import annotations

import sys

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

_done = []


def _replace_everywhere(orig, new):
    """setattr ``new`` wherever a paddle/paddlenlp module holds ``orig``."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(("paddle", "paddlenlp")):
            continue
        for attr, value in list(vars(mod).items()):
            if value is orig:
                setattr(mod, attr, new)
                n += 1
    return n


def _rank(group):
    return group.rank if group.rank >= 0 else 0


def _gather_last(t, group):
    parts = []
    dist.all_gather(parts, t.contiguous() if hasattr(t, "contiguous") else t, group=group)
    return paddle.concat(parts, axis=-1)


def _own_last(t, group):
    n = t.shape[-1] // group.nranks
    r = _rank(group)
    return paddle.slice(t, axes=[len(t.shape) - 1], starts=[n * r], ends=[n * (r + 1)])


def _all_reduce(t, group):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


# -- mp_ops: c_identity / c_concat / c_split / mp_allreduce -------------------------------
# Paddle: `c_identity` has no CPU kernel; the eager paths call
# `process_group.all_reduce_on_calc_stream` / `all_gather_into_tensor_on_calc_stream`,
# which gloo rejects.
class _Identity(PyLayer):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.group)


class _Concat(PyLayer):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _own_last(dy, ctx.group)


class _Split(PyLayer):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_last(x, group).clone()

    @staticmethod
    def backward(ctx, dy):
        return _gather_last(dy, ctx.group)


class _AllReduce(PyLayer):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy


def _mp_group(group):
    if group is not None:
        return group
    from paddle.distributed import fleet

    return fleet.get_hybrid_communicate_group().get_model_parallel_group()


def c_identity(tensor, group=None, skip_c_identity_dynamic=False):
    group = _mp_group(group)
    if group.nranks == 1 or skip_c_identity_dynamic:
        return tensor
    return _Identity.apply(tensor, group)


def c_concat(tensor, group=None):
    group = _mp_group(group)
    return tensor if group.nranks == 1 else _Concat.apply(tensor, group)


def c_split(tensor, group=None):
    group = _mp_group(group)
    return tensor if group.nranks == 1 else _Split.apply(tensor, group)


def mp_allreduce(tensor, op=None, group=None, use_calc_stream=True, use_model_parallel=True,
                 skip_c_identity_dynamic=False):
    group = _mp_group(group)
    return tensor if group.nranks == 1 else _AllReduce.apply(tensor, group)


# -- sequence parallel ---------------------------------------------------------------------
# Paddle: sequence_parallel_utils.all_gather uses `process_group.all_gather` into a
# preallocated tensor and reduce_scatter uses `dist.stream.reduce_scatter`; gloo has no
# reduce_scatter.  Same math on dim 0 with all_gather / all_reduce + slice.
def sp_all_gather(input):
    group = _mp_group(None)
    parts = []
    dist.all_gather(parts, input, group=group)
    return paddle.concat(parts, axis=0)


def sp_reduce_scatter(input):
    return sp_reduce_scatter_in(input, _mp_group(None))


# Paddle 3.x: SPInnerOverlapLinear (``mp_configs.sp_async_reduce_scatter``) reduce-scatters dx
# with ``dist.stream.reduce_scatter(out, in, sync_op=False)``; gloo has no reduce_scatter.  Same
# math (sum over the group, this rank's rows of dim 0) written in place into ``out``; the
# returned task is already complete.  Other callers (a tensor list, another op) get Paddle's.
class _DoneTask:
    def wait(self):
        return True

    def is_completed(self):
        return True


_paddle_stream_reduce_scatter = []


def stream_reduce_scatter(tensor, tensor_or_tensor_list, op=dist.ReduceOp.SUM, group=None,
                          sync_op=True, use_calc_stream=False):
    if not isinstance(tensor_or_tensor_list, paddle.Tensor) or op != dist.ReduceOp.SUM:
        return _paddle_stream_reduce_scatter[0](tensor, tensor_or_tensor_list, op, group,
                                                sync_op, use_calc_stream)
    group = _mp_group(group)
    part = sp_reduce_scatter_in(tensor_or_tensor_list, group)
    paddle.assign(part, output=tensor)
    return _DoneTask()


def sp_reduce_scatter_in(input, group):
    full = _all_reduce(input, group)
    n = input.shape[0] // group.nranks
    r = _rank(group)
    return paddle.slice(full, axes=[0], starts=[n * r], ends=[n * (r + 1)]).clone()


# -- hybrid_parallel_util.broadcast_input_data ----------------------------------------------
# Paddle: asserts "Only support xpu, gpu and custom_device now" on CPU.  Same job with
# dist.broadcast from the group's source rank (the driver feeds identical data anyway).
def broadcast_input_data(hcg, *inputs, **kwargs):
    group = hcg.get_model_parallel_group()
    src = hcg.get_model_parallel_group_src_rank()
    for t in list(inputs) + list(kwargs.values()):
        if isinstance(t, paddle.Tensor) and group.nranks > 1:
            dist.broadcast(t, src=src, group=group)
    return inputs, kwargs


# -- pipeline p2p ---------------------------------------------------------------------------
# Paddle: p2p_communication sends/receives with `process_group.send_on_calc_stream` /
# `recv_on_calc_stream` ("ProcessGroupGLOO does not support send with sync_op and
# use_calc_stream flag").  Same transfer with dist.send / dist.recv (peer is group-local).
def send_on_calc_stream(tensor, group, dst, nranks=1, rank_id=0):
    return dist.send(tensor, dst=group.ranks[dst], group=group)


def recv_on_calc_stream(tensor, group, src, nranks=1, rank_id=0):
    return dist.recv(tensor, src=group.ranks[src], group=group)


# Paddle 2.6: batch_send_recv_on_calc_stream runs each stage's ops in list order, and both
# neighbouring stages list their send first (send_forward_recv_backward /
# send_backward_recv_forward); gloo's send blocks until the peer receives: deadlock.
# Same ops, ordered so that the lower rank sends first and the higher rank receives first.
def batch_send_recv_on_calc_stream(p2p_op_list):
    me = dist.get_rank()

    def order(op):
        sends = op.op is send_on_calc_stream
        return 0 if sends == (me < op.group.ranks[op.peer]) else 1

    for op in sorted(p2p_op_list, key=order):
        op.op(op.tensor, op.group, op.peer, op.nranks, op.rank_id)


def install(pipeline: bool = False):
    """Install the stand-ins (idempotent).  Call after importing paddlenlp's models."""
    if _done:
        return
    _done.append(True)
    from paddle.distributed.fleet.layers.mpu import mp_ops
    from paddle.distributed.fleet.utils import hybrid_parallel_util, sequence_parallel_utils

    _replace_everywhere(mp_ops._c_identity, c_identity)
    _replace_everywhere(mp_ops._c_concat, c_concat)
    _replace_everywhere(mp_ops._c_split, c_split)
    _replace_everywhere(mp_ops._mp_allreduce, mp_allreduce)
    sequence_parallel_utils.all_gather = sp_all_gather
    sequence_parallel_utils.reduce_scatter = sp_reduce_scatter
    _replace_everywhere(hybrid_parallel_util.broadcast_input_data, broadcast_input_data)
    stream = getattr(dist, "stream", None)  # SPInnerOverlapLinear calls dist.stream.reduce_scatter
    if stream is not None and hasattr(stream, "reduce_scatter"):
        _paddle_stream_reduce_scatter.append(stream.reduce_scatter)
        stream.reduce_scatter = stream_reduce_scatter
    if pipeline:
        # Paddle: ParallelEnv sets `_device_id` only for GPU/XPU/custom devices, and
        # PipelineLayer.__init__ reads `ParallelEnv().device_id` (AttributeError on CPU).
        if not hasattr(dist.ParallelEnv(), "_device_id"):
            dist.ParallelEnv._device_id = 0
        from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

        if hasattr(p2p, "_send_on_calc_stream"):
            _replace_everywhere(p2p._send_on_calc_stream, send_on_calc_stream)
            _replace_everywhere(p2p._recv_on_calc_stream, recv_on_calc_stream)
            _replace_everywhere(p2p.batch_send_recv_on_calc_stream, batch_send_recv_on_calc_stream)
