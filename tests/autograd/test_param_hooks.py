"""The count of user gradient hooks (:mod:`paddle_mgrad.autograd.param_hooks`)."""

import gc
import threading

import paddle

import paddle_mgrad
from paddle_mgrad.autograd import param_hooks


def _within_seconds(fn, seconds=5):
    """Run ``fn`` in a thread; whether it returned in time.  A thread stuck on the module's
    lock is set free (a ``Lock`` may be released by any thread) so that the worker goes on."""
    done = threading.Event()

    def run():
        fn()
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if not done.is_set():
        try:
            param_hooks._lock.release()
        except RuntimeError:  # (not held, or an RLock held by the stuck thread)
            pass
        thread.join(seconds)
    return done.is_set()


def test_a_hooked_tensor_collected_while_a_hook_is_counted_does_not_hang():
    """Counting a hook allocates under the module's lock, and an allocation may run the
    garbage collector -- which may free another tensor with a hook (a hook's handle holds its
    tensor in a reference cycle: only the collector frees it), whose weakref callback takes the
    same lock in the same thread.  That must neither deadlock the step nor keep the entry."""
    paddle_mgrad.enable(recompute=False, fused_linear=True)  # counts register_hook from here
    try:
        t = paddle.ones([2])
        t.stop_gradient = False
        t.register_hook(lambda g: g)
        assert param_hooks.has_user_hooks(t)
        key = id(t)
        del t  # garbage now: the next collection frees it

        def collect_under_the_lock():  # what an allocation inside the counting can do
            with param_hooks._lock:
                gc.collect()

        assert _within_seconds(collect_under_the_lock), "collecting a hooked tensor hung"
        assert key not in param_hooks._counts
    finally:
        paddle_mgrad.disable()
