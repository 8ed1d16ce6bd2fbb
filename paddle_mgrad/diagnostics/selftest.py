"""The seed case as a self-test: does this Paddle lose ``main_grad``, and does paddle_mgrad keep it?

The report this project started from (PaddleNLP, ``--amp_master_grad --recompute
--recompute_granularity full --enable_linear_fused_grad_add``): a PyLayer linear saves its weight
with ``ctx.save_for_backward``; under Paddle's non-reentrant recompute its backward gets back
``<weight name>cpy``, a copy without ``main_grad``, so the in-place ``main_grad`` accumulation of
a fused weight-gradient linear is lost (Paddle 2.6; 3.x hands back the parameter).

:func:`run` trains a two-linear block through such a PyLayer (:class:`SeedLinear`, saving
``(x, weight)``) under ``MixPrecisionLayer``-style fp32 ``main_grad``, two micro-steps (the first
with ``main_grad`` None), inside non-reentrant recompute, and checks what the backward saw (the
parameter itself? with ``main_grad``?) and the final ``main_grad`` against a float64 numpy
reference:

* ``mode="paddle"``: Paddle's own ``recompute`` (``preserve_rng_state=False``: Paddle 2.6's CPU
  RNG refusal would hide the bug asked about); the backward adds ``xᵀ·dy`` into ``main_grad``
  with plain Paddle ops (Paddle's fused op has no CPU kernel).
* ``mode="paddle_mgrad"``: ``paddle_mgrad.enable(recompute=True, fused_linear=True)``, then the
  same code through Paddle's names: Paddle's ``recompute`` (now ours) and
  ``paddle._C_ops.fused_linear_param_grad_add`` (our op for CPU tensors), as PaddleNLP's layers
  call it.

Used by ``python -m paddle_mgrad doctor`` (in a subprocess).  Takes well under a second once
Paddle is imported and the op is loaded.
"""

from __future__ import annotations

import time

import numpy as np

from .._compat import paddle

__all__ = ["SeedLinear", "run", "reference_main_grads"]

D_IN, D_HIDDEN, TOKENS, MICRO_STEPS = 8, 16, 6, 2
#: fp32 result vs float64 reference: a few fp32 roundings of sums of <= 12 products
RTOL = 1e-5

_seen = []  # per backward call: (saved weight is the parameter, has main_grad, saved name)
_mode = {"fused_op": False}


def _accumulate(x, dy, weight):
    """``weight.main_grad += xᵀ·dy`` (first micro-step: ``main_grad`` is None)."""
    if _mode["fused_op"]:  # PaddleNLP's fused_layers form: Paddle's op name, ours on CPU
        from paddle import _C_ops

        weight.main_grad, _ = _C_ops.fused_linear_param_grad_add(
            x, dy, weight.main_grad, None, True, False
        )
        return
    dw = paddle.matmul(
        x.reshape([-1, x.shape[-1]]), dy.reshape([-1, dy.shape[-1]]), transpose_x=True
    ).astype("float32")
    weight.main_grad = dw if weight.main_grad is None else weight.main_grad + dw


class SeedLinear(paddle.autograd.PyLayer):
    """``y = x @ weight``; saves ``(x, weight)`` with ``ctx.save_for_backward``; backward puts the
    weight gradient into ``weight.main_grad`` when the saved weight has one (returning None for
    it), else returns it as the weight's gradient -- the seed report's layer."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.param_id = id(weight)
        return paddle.matmul(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensor()
        _seen.append((id(weight) == ctx.param_id, hasattr(weight, "main_grad"), weight.name))
        dx = paddle.matmul(dy, weight, transpose_y=True)
        if hasattr(weight, "main_grad"):
            _accumulate(x, dy, weight)
            return dx, None
        dw = paddle.matmul(
            x.reshape([-1, x.shape[-1]]), dy.reshape([-1, dy.shape[-1]]), transpose_x=True
        )
        return dx, dw


class _Block(paddle.nn.Layer):
    def __init__(self, w1, w2):
        super().__init__()
        self.w1 = self.create_parameter([D_IN, D_HIDDEN], dtype="float32")
        self.w2 = self.create_parameter([D_HIDDEN, D_IN], dtype="float32")
        self.w1.set_value(w1)
        self.w2.set_value(w2)

    def forward(self, x):
        return SeedLinear.apply(paddle.tanh(SeedLinear.apply(x, self.w1)), self.w2)


def _data():
    rs = np.random.RandomState(2024)
    w1 = (rs.standard_normal([D_IN, D_HIDDEN]) / np.sqrt(D_IN)).astype("float32")
    w2 = (rs.standard_normal([D_HIDDEN, D_IN]) / np.sqrt(D_HIDDEN)).astype("float32")
    xs = [rs.standard_normal([TOKENS, D_IN]).astype("float32") for _ in range(MICRO_STEPS)]
    return w1, w2, xs


def reference_main_grads(w1, w2, xs):
    """float64 numpy: the sum over micro-steps of d(sum(block(x)))/dW."""
    w1, w2 = w1.astype("f8"), w2.astype("f8")
    g1, g2 = np.zeros_like(w1), np.zeros_like(w2)
    for x in xs:
        x = x.astype("f8")
        h = np.tanh(x @ w1)
        dy = np.ones([x.shape[0], w2.shape[1]])
        g2 += h.T @ dy
        g1 += x.T @ ((dy @ w2.T) * (1 - h * h))
    return g1, g2


def run(mode: str) -> dict:
    """Train the seed block two micro-steps; return what happened (never raises).

    Keys: ``mode``; ``error`` (the exception text, or None); ``backward_got_parameter`` (every
    backward got the parameter object itself); ``backward_had_main_grad``; ``saved_names``;
    ``main_grad_ok`` (both fp32 ``main_grad`` within ``RTOL`` of the float64 reference, ``.grad``
    None); ``max_rel_err``; ``seconds``.
    """
    if mode not in ("paddle", "paddle_mgrad"):
        raise ValueError(f"mode must be 'paddle' or 'paddle_mgrad', got {mode!r}")
    from paddle.distributed.fleet.utils import recompute
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    out = {
        "mode": mode,
        "error": None,
        "backward_got_parameter": None,
        "backward_had_main_grad": None,
        "saved_names": [],
        "main_grad_ok": False,
        "max_rel_err": None,
        "seconds": None,
    }
    t0 = time.perf_counter()
    _seen.clear()
    _mode["fused_op"] = mode == "paddle_mgrad"
    switched_on = False
    try:
        if mode == "paddle_mgrad":
            import paddle_mgrad

            from .. import stats

            before = stats.snapshot()
            paddle_mgrad.enable(recompute=True, fused_linear=True)
            switched_on = True
            kwargs = {}
        else:
            kwargs = {"preserve_rng_state": False}
        w1, w2, xs = _data()
        block = _Block(w1, w2)
        model = MixPrecisionLayer(block, dtype="bfloat16")  # fp32 main_grad through its hooks
        for x in xs:
            xt = paddle.to_tensor(x)
            xt.stop_gradient = False
            y = recompute(model, xt, use_reentrant=False, **kwargs)
            y.sum().backward()
        out["backward_got_parameter"] = bool(_seen) and all(s[0] for s in _seen)
        out["backward_had_main_grad"] = bool(_seen) and all(s[1] for s in _seen)
        out["saved_names"] = sorted({s[2] for s in _seen})
        if mode == "paddle_mgrad":
            after = stats.snapshot()
            out["ours"] = {
                "recompute": after["recompute"]["non_reentrant"]
                - before["recompute"]["non_reentrant"],
                "op_calls": after["paddle_c_ops"]["ours"] - before["paddle_c_ops"]["ours"],
            }
            out["through_paddle_mgrad"] = out["ours"] == {
                "recompute": MICRO_STEPS,
                "op_calls": 2 * MICRO_STEPS,
            }
        ref = reference_main_grads(w1, w2, xs)
        errs, ok = [], True
        for p, r in zip((block.w1, block.w2), ref):
            mg = getattr(p, "main_grad", None)
            if (
                mg is None
                or str(mg.dtype).replace("paddle.", "") != "float32"
                or p.grad is not None
            ):
                ok = False
                continue
            got = mg.numpy().astype("f8")
            errs.append(float(np.max(np.abs(got - r)) / max(float(np.max(np.abs(r))), 1e-30)))
        out["max_rel_err"] = max(errs) if errs else None
        out["main_grad_ok"] = ok and len(errs) == 2 and out["max_rel_err"] <= RTOL
    except Exception as e:  # noqa: BLE001  (reported, not raised: this is a diagnosis)
        out["error"] = f"{type(e).__name__}: {e}".strip()[:500]
    finally:
        if switched_on:
            import paddle_mgrad

            paddle_mgrad.disable()
        _mode["fused_op"] = False
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out
