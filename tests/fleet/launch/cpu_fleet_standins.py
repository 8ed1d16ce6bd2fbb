"""CPU (gloo) stand-ins for the transport pieces of fleet hybrid parallelism that Paddle has no
CPU support for.

TEST-ONLY: installed into 2-rank runs by ``tests/fleet/launch/train_hybrid.py`` (its own driver)
and, through ``tests/nlp/evidence/sitecustomize.py`` (``PMG_TEST_FLEET_CPU_STANDINS=1``), into
the unmodified PaddleNLP-style ``tests/nlp/llm/run_pretrain.py``.  Nothing here is part of
paddle_mgrad, and none of it changes what paddle_mgrad patches.

Only the transport is stood in for, never Paddle's autograd: Paddle's own PyLayers
(``c_identity_eager``, ``c_split_eager``, ``mp_allreduce_eager``, the sequence-parallel
``ScatterOp``/``GatherOp``/``AllGatherOp``/``ReduceScatterOp``, ``SPInnerOverlapLinear``)
run unchanged, with their semantics -- ``mp_allreduce_eager`` all-reduces its input IN PLACE
and returns it, as it does on a GPU (an earlier out-of-place stand-in hid a regression:
"Leaf Var () that doesn't stop gradient can't use inplace strategy").  What is replaced:

* methods of ``ProcessGroupGloo`` (the class: only gloo groups see them) that gloo rejects,
  done with the collectives gloo has, with the same in-place effect on the same tensors;
* C ops with no CPU kernel (``c_identity``, ``c_concat``, ``c_split``,
  ``c_softmax_with_cross_entropy``: ``paddle._C_ops`` on 3.x, ``paddle._legacy_C_ops`` on
  2.6), for CPU tensors only, by the same math with the gradient Paddle registers for them;
* ``broadcast_input_data`` (its CPU assert; the broadcast itself is Paddle's helper),
  ``ParallelEnv._device_id``, and the order of a pipeline stage's p2p ops (gloo's send blocks).

Every stand-in names the Paddle limitation it works around, and counts its calls in
:data:`CALLS` (the tests' evidence that a path really ran).
"""

from __future__ import annotations

import collections
import sys

import paddle
import paddle.distributed as dist
from paddle.autograd import PyLayer

#: calls per stand-in, for the tests' evidence
CALLS = collections.Counter()
_done = []
_paddle = {}  # Paddle's own C ops, for tensors that are not on the CPU


def _core():
    from paddle.base import core

    return core


def _sum():
    return _core().ReduceOp.SUM


def _replace_everywhere(orig, new):
    """setattr ``new`` wherever a paddle/paddlenlp module holds ``orig`` (bound by name)."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(("paddle", "paddlenlp")):
            continue
        for attr, value in list(vars(mod).items()):
            if value is orig:
                setattr(mod, attr, new)
                n += 1
    return n


class _DoneTask:
    """The task of a collective that already completed (gloo runs these synchronously)."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True

    def synchronize(self):
        return True


# -- ProcessGroupGloo: the calc-stream collectives and reduce-scatter -----------------------
# Paddle (2.6.2 and 3.3.1): "ProcessGroupGLOO does not support all_reduce with sync_op and
# use_calc_stream flag" (the same for all_gather, send, recv), and "ProcessGroupGLOO does not
# support reduce_scatter with sync_op flag".  A CPU has one stream: the same collective,
# synchronous, on the same tensors (in place where Paddle's is).
def _all_reduce_on_calc_stream(self, tensor, op=None):
    CALLS["all_reduce_on_calc_stream"] += 1
    self.all_reduce(tensor, _sum() if op is None else op, True).wait()
    return _DoneTask()


def _all_gather_into_tensor_on_calc_stream(self, out, in_tensor):
    CALLS["all_gather_into_tensor_on_calc_stream"] += 1
    self.all_gather(in_tensor, out).wait()  # gloo's all_gather into a tensor (dim 0)
    return _DoneTask()


def _reduce_scatter_rows(self, out, in_tensor, op):
    """Sum over the group, this rank's rows of dim 0, written in place into ``out``."""
    full = in_tensor.clone()
    self.all_reduce(full, _sum() if op is None else op, True).wait()
    n = in_tensor.shape[0] // self.size()
    r = self.rank()
    with paddle.no_grad():
        paddle.assign(full[r * n : (r + 1) * n], output=out)


def _reduce_scatter_tensor(self, out, in_tensor, op=None, sync_op=True):
    CALLS["reduce_scatter_tensor"] += 1
    _reduce_scatter_rows(self, out, in_tensor, op)
    return _DoneTask()


def _reduce_scatter_tensor_on_calc_stream(self, out, in_tensor, op=None):
    CALLS["reduce_scatter_tensor_on_calc_stream"] += 1
    _reduce_scatter_rows(self, out, in_tensor, op)
    return _DoneTask()


def _send_on_calc_stream(self, tensor, dst):
    CALLS["send_on_calc_stream"] += 1
    self.send(tensor, dst, True).wait()
    return _DoneTask()


def _recv_on_calc_stream(self, tensor, src):
    CALLS["recv_on_calc_stream"] += 1
    self.recv(tensor, src, True).wait()
    return _DoneTask()


GLOO_METHODS = {
    "all_reduce_on_calc_stream": _all_reduce_on_calc_stream,
    "all_gather_into_tensor_on_calc_stream": _all_gather_into_tensor_on_calc_stream,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "reduce_scatter_tensor_on_calc_stream": _reduce_scatter_tensor_on_calc_stream,
    "send_on_calc_stream": _send_on_calc_stream,
    "recv_on_calc_stream": _recv_on_calc_stream,
}


# -- C ops without a CPU kernel ---------------------------------------------------------------
# Paddle: "Do not support c_identity / c_concat / c_split / c_softmax_with_cross_entropy for
# cpu kernel now" (phi/kernels/cpu/c_*_kernel.cc; 2.6's c_softmax_with_cross_entropy says
# c_embedding).  Same math on the model-parallel group of ``ring_id``, with the gradient
# Paddle registers for each op (c_identity -> all-reduce sum; c_concat -> this rank's part;
# c_softmax_with_cross_entropy -> softmax minus one-hot, times the loss gradient).
def _group(ring_id):
    return dist.collective._get_group_map()[ring_id]


def _all_reduce(t, group, op=None):
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return t


def _gather_last(t, group):
    parts = []
    dist.all_gather(parts, t, group=group)
    return paddle.concat(parts, axis=-1)


def _own_last(t, rank, nranks):
    n = t.shape[-1] // nranks
    return paddle.slice(t, axes=[len(t.shape) - 1], starts=[n * rank], ends=[n * (rank + 1)])


class _CIdentity(PyLayer):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy.clone(), ctx.group)


class _CConcat(PyLayer):
    @staticmethod
    def forward(ctx, x, group, rank, nranks):
        ctx.rank, ctx.nranks = rank, nranks
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _own_last(dy, ctx.rank, ctx.nranks).clone()


class _CSplit(PyLayer):
    @staticmethod
    def forward(ctx, x, group, rank, nranks):
        ctx.group = group
        return _own_last(x, rank, nranks).clone()

    @staticmethod
    def backward(ctx, dy):
        return _gather_last(dy, ctx.group)


class _CSoftmaxWithCrossEntropy(PyLayer):
    """Vocab-parallel softmax cross entropy: ``logits`` [..., V/n] (this rank's columns),
    ``label`` [..., 1] (global ids); returns (this rank's softmax, loss [..., 1])."""

    @staticmethod
    def forward(ctx, logits, label, group, rank, nranks, ignore_index):
        x = logits
        m = x.max(axis=-1, keepdim=True)
        _all_reduce(m, group, dist.ReduceOp.MAX)
        e = paddle.exp(x - m)
        s = e.sum(axis=-1, keepdim=True)
        _all_reduce(s, group)
        softmax = e / s
        width = x.shape[-1]
        local = label - rank * width
        mine = paddle.logical_and(local >= 0, local < width)
        idx = paddle.clip(local, 0, width - 1)
        picked = paddle.take_along_axis(x - m, idx, axis=-1) * mine.astype(x.dtype)
        _all_reduce(picked, group)
        keep = (label != ignore_index).astype(x.dtype)
        loss = (paddle.log(s) - picked) * keep
        ctx.save_for_backward(softmax, idx, mine, keep)
        return softmax, loss

    @staticmethod
    def backward(ctx, dsoftmax, dloss):
        softmax, idx, mine, keep = ctx.saved_tensor()
        onehot = paddle.nn.functional.one_hot(idx.squeeze(-1), softmax.shape[-1])
        onehot = onehot.astype(softmax.dtype) * mine.astype(softmax.dtype)
        return (softmax - onehot) * (dloss * keep), None


def _legacy_attrs(args):
    return dict(zip(args[0::2], args[1::2]))


def _on_cpu(t):
    return t.place.is_cpu_place()


def c_identity(x, *args):
    """3.x: (x, ring_id, use_calc_stream, use_model_parallel); 2.6: legacy attribute pairs."""
    if not _on_cpu(x):
        return _paddle["c_identity"](x, *args)
    CALLS["c_identity"] += 1
    ring_id = args[0] if _paddle["api"] == "_C_ops" else _legacy_attrs(args)["ring_id"]
    return _CIdentity.apply(x, _group(ring_id))


def c_concat(x, *args):
    """3.x: (x, rank, nranks, ring_id, use_calc_stream, use_model_parallel); 2.6: legacy."""
    if not _on_cpu(x):
        return _paddle["c_concat"](x, *args)
    CALLS["c_concat"] += 1
    if _paddle["api"] == "_C_ops":
        rank, nranks, ring_id = args[0], args[1], args[2]
    else:
        a = _legacy_attrs(args)
        rank, nranks, ring_id = a["rank"], a["nranks"], a["ring_id"]
    return _CConcat.apply(x, _group(ring_id), rank, nranks)


def c_split(x, *args):
    """3.x: (x, rank, nranks, ring_id, use_model_parallel); 2.6: legacy attribute pairs."""
    if not _on_cpu(x):
        return _paddle["c_split"](x, *args)
    CALLS["c_split"] += 1
    if _paddle["api"] == "_C_ops":
        rank, nranks, ring_id = args[0], args[1], args[2]
    else:
        a = _legacy_attrs(args)
        rank, nranks, ring_id = a["rank"], a["nranks"], a["ring_id"]
    return _CSplit.apply(x, _group(ring_id), rank, nranks)


def c_softmax_with_cross_entropy(logits, label, *args):
    """3.x: (logits, label, ignore_index, ring_id, rank, nranks); 2.6: legacy attribute
    pairs.  Returns (softmax, loss) as Paddle's."""
    if not _on_cpu(logits):
        return _paddle["c_softmax_with_cross_entropy"](logits, label, *args)
    CALLS["c_softmax_with_cross_entropy"] += 1
    if _paddle["api"] == "_C_ops":
        ignore_index, ring_id, rank, nranks = args[:4]
    else:
        a = _legacy_attrs(args)
        ignore_index, ring_id, rank, nranks = (
            a.get("ignore_index", -100),
            a["ring_id"],
            a["rank"],
            a["nranks"],
        )
    return _CSoftmaxWithCrossEntropy.apply(
        logits, label, _group(ring_id), rank, nranks, ignore_index
    )


C_OPS = {
    "c_identity": c_identity,
    "c_concat": c_concat,
    "c_split": c_split,
    "c_softmax_with_cross_entropy": c_softmax_with_cross_entropy,
}


# -- hybrid_parallel_util.broadcast_input_data -------------------------------------------------
# Paddle: asserts "Only support xpu, gpu and custom_device now" on a CPU place.  The same
# function with the CPU place, through Paddle's own helpers (tensors broadcast in place from
# the model-parallel group's source rank, other objects as objects).
def broadcast_input_data(hcg, *inputs, **kwargs):
    from paddle.distributed.fleet.utils import hybrid_parallel_util as hpu

    CALLS["broadcast_input_data"] += 1
    if hasattr(hpu, "_broadcast_nested_data"):  # Paddle 3.x
        place = paddle.CPUPlace()
        if len(inputs) > 0:
            inputs = hpu._broadcast_nested_data(hcg, "cpu", place, inputs)
        if len(kwargs) > 0:
            kwargs = hpu._broadcast_nested_data(hcg, "cpu", place, kwargs)
        return inputs, kwargs
    core = _core()
    for v in inputs:  # Paddle 2.6's loop
        if isinstance(v, core.eager.Tensor):
            with paddle.no_grad():
                hpu._broadcast_data_help(v, paddle.shape(v), v.dtype, hcg)
        else:
            hpu._broadcast_object_list_help(v, hcg)
    for k, v in kwargs.items():
        if isinstance(v, core.eager.Tensor):
            with paddle.no_grad():
                hpu._broadcast_data_help(v, paddle.shape(v), v.dtype, hcg)
            kwargs[k] = v
        else:
            kwargs[k] = hpu._broadcast_object_list_help(v, hcg)
    return inputs, kwargs


# -- pipeline p2p order -------------------------------------------------------------------------
# Paddle: batch_send_recv_on_calc_stream runs a stage's p2p ops in list order, and both
# neighbouring stages list their send first (send_forward_recv_backward /
# send_backward_recv_forward); NCCL batches them, gloo's send blocks until the peer receives:
# deadlock (seen on 2.6.2).  Same ops, ordered so that the lower rank sends first and the
# higher rank receives first.
def batch_send_recv_on_calc_stream(p2p_op_list):
    from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

    me = dist.get_rank()
    CALLS["batch_send_recv_on_calc_stream"] += 1

    def order(op):  # op.peer: the peer's global rank (Paddle maps it into the group)
        sends = op.op is p2p._send_on_calc_stream
        return 0 if sends == (me < op.peer) else 1

    for op in sorted(p2p_op_list, key=order):
        op.op(op.tensor, op.group, op.peer, op.nranks, op.rank_id)


def install(pipeline: bool = True):
    """Install the stand-ins (idempotent; after ``import paddle``, before training).
    ``pipeline``: also ``ParallelEnv._device_id`` and the p2p order."""
    if _done:
        return
    _done.append(True)
    core = _core()
    for name, fn in GLOO_METHODS.items():
        setattr(core.ProcessGroupGloo, name, fn)

    from paddle_mgrad._compat import IS_PADDLE_2  # (the ranks run paddle_mgrad)

    ops = paddle._legacy_C_ops if IS_PADDLE_2 else paddle._C_ops
    _paddle["api"] = "_C_ops" if ops is paddle._C_ops else "_legacy_C_ops"
    for name, fn in C_OPS.items():
        _paddle[name] = getattr(ops, name)
        setattr(ops, name, fn)

    from paddle.distributed.fleet.utils import hybrid_parallel_util

    _replace_everywhere(hybrid_parallel_util.broadcast_input_data, broadcast_input_data)
    from paddle.distributed.fleet.meta_parallel import tensor_parallel

    tensor_parallel.broadcast_input_data = broadcast_input_data
    if pipeline:
        # Paddle: ParallelEnv sets `_device_id` only for GPU/XPU/custom devices, and
        # PipelineLayer.__init__ reads `ParallelEnv().device_id` (AttributeError on CPU).
        if not hasattr(dist.ParallelEnv(), "_device_id"):
            dist.ParallelEnv._device_id = 0
        from paddle.distributed.fleet.meta_parallel.pp_utils import p2p_communication as p2p

        _replace_everywhere(p2p.batch_send_recv_on_calc_stream, batch_send_recv_on_calc_stream)
