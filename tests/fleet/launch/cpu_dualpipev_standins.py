"""CPU (gloo) stand-ins for the three pieces of Paddle 3.x's DualPipeV schedule that exist only
for GPUs, so that the zero-bubble pipeline can run with 2 gloo ranks on a CPU machine.

TEST-ONLY: used by ``tests/fleet/launch/train_dualpipev.py``.  Nothing here is part of paddle_mgrad or
changes what paddle_mgrad patches; the schedule itself (``DualPipeVParallel``, its
``WeightGradStore`` deferrals) is Paddle's, untouched.  Paddle 3.3.1 without them, on a CPU
wheel (measured, 2 gloo ranks, ``meta_parallel/dualpipev.py``):

1. ``deep_ep``: ``from paddle.distributed.communication import deep_ep`` fails on a CPU wheel
   (dualpipev.py:28-31 sets ``deep_ep = None``), and ``_commit_and_wait_comm`` calls
   ``deep_ep.get_event_from_custom_stream(...)`` unconditionally when a pass has no pending
   communication (dualpipev.py:390) and after every batch of p2p ops (dualpipev.py:448):
   ``AttributeError: 'NoneType' object has no attribute 'get_event_from_custom_stream'`` on the
   first forward pass.  The event it returns is used only by models with
   ``overlapped_forward_backward`` (GPU streams); stand-in: an event of None.
2. ``paddle.device.current_stream()`` (the argument of those calls, dualpipev.py:391/449):
   ``TypeError: device should be gpu, xpu, ...`` on CPU; and
   ``ProcessGroupGloo.get_stream`` (dualpipev.py:398) does not exist (``AttributeError``).
   Stand-ins: a stream object whose ``stream_base`` is None, on CPU only; ``get_stream``
   returning None (used only for GPU stream guards, which these runs never enter).
3. ``batch_isend_irecv`` (dualpipev.py:405/432): gloo's send blocks until the peer receives,
   and both neighbours post their sends first: a 2-rank ``isend``/``irecv`` exchange times out
   (``gloo/transport/tcp/pair.cc:584 TIMEOUT``).  Stand-in: the same per-pair FIFO message
   semantics as NCCL's grouped p2p, carried by the job's TCP store (a send stores the tensor
   under ``<src>-><dst>/<n>`` and returns; a receive waits for its key): sends never block, so
   the schedule's own ordering is all that matters, as with NCCL.
"""

from __future__ import annotations

import pickle
import types

import paddle
import paddle.distributed as dist
from paddle.framework import core

_done = []
_seq = {}  # (src, dst) -> messages so far, per direction (NCCL's per-pair FIFO order)


class _DoneTask:
    def wait(self):
        return True

    def is_completed(self):
        return True


def batch_isend_irecv(p2p_op_list):
    store = core.create_or_get_global_tcp_store()
    me = dist.get_rank()
    tasks = []
    for op in p2p_op_list:
        send = op.op is dist.isend
        if not send and op.op is not dist.irecv:
            raise RuntimeError(f"stand-in batch_isend_irecv: unexpected op {op.op!r}")
        pair = (me, op.peer) if send else (op.peer, me)
        n = _seq.get(pair, 0)
        _seq[pair] = n + 1
        key = f"pmg_dualpipev/{pair[0]}->{pair[1]}/{n}"
        if send:
            t = op.tensor
            store.set(key, pickle.dumps((t.numpy(), str(t.dtype).replace("paddle.", ""))))
        else:
            store.wait(key)
            array, dtype = pickle.loads(bytes(store.get(key)))
            assert list(array.shape) == list(op.tensor.shape), (key, array.shape, op.tensor.shape)
            paddle.assign(paddle.to_tensor(array).astype(dtype), output=op.tensor)
        tasks.append(_DoneTask())
    return tasks


class _CpuStream:
    stream_base = None


def install():
    """Install the stand-ins (idempotent)."""
    if _done:
        return
    _done.append(True)
    from paddle.distributed.fleet.meta_parallel import dualpipev

    if dualpipev.deep_ep is None:
        dualpipev.deep_ep = types.SimpleNamespace(get_event_from_custom_stream=lambda stream: None)
    dualpipev.batch_isend_irecv = batch_isend_irecv
    paddle_current_stream = paddle.device.current_stream

    def current_stream(device=None):
        if device is None and paddle.get_device() == "cpu":
            return _CpuStream()
        return paddle_current_stream(device)

    paddle.device.current_stream = current_stream
    if not hasattr(core.ProcessGroupGloo, "get_stream"):
        core.ProcessGroupGloo.get_stream = lambda self, place: None
    # PipelineLayer.__init__ reads ParallelEnv().device_id, set only for GPU/XPU/custom devices
    if not hasattr(dist.ParallelEnv(), "_device_id"):
        dist.ParallelEnv._device_id = 0
