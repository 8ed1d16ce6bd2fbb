"""PyLayers written the way users write them, used by several tests.

They follow the PaddleNLP bug report this project started from (``--amp_master_grad``
+ ``--recompute --recompute_granularity full`` + ``--enable_linear_fused_grad_add``: a
weight saved with ``ctx.save_for_backward`` came back in backward as ``<name>cpy`` without
``main_grad``; ``save_for_backward(x, weight, None)`` raised ValueError on Paddle 2.6).

``SaveWeightAlone`` is the first form from the PaddleNLP report:
``ctx.save_for_backward(weight)`` with ``x``/``bias`` on ``ctx``.
``SaveAll`` is the second: ``ctx.save_for_backward(x, weight, bias)`` with
``bias`` possibly ``None``.  Both accumulate the weight gradient into
``weight.main_grad`` when the attribute exists (assignment form, so that the
first micro-step with ``main_grad is None`` works) and record what backward saw.
"""

import paddle
from paddle.autograd import PyLayer

SEEN = []  # (weight object id, has main_grad, name, python attr) per backward


def _wgrad(x, dy):
    x2 = x.reshape([-1, x.shape[-1]])
    dy2 = dy.reshape([-1, dy.shape[-1]])
    return paddle.matmul(x2, dy2, transpose_x=True)


def _backward(weight, x, bias, dy):
    SEEN.append(
        (
            id(weight),
            hasattr(weight, "main_grad"),
            weight.name,
            getattr(weight, "sequence_parallel", None),
        )
    )
    dx = paddle.matmul(dy, weight, transpose_y=True)
    dw = _wgrad(x, dy)
    if hasattr(weight, "main_grad"):
        weight.main_grad = dw if weight.main_grad is None else weight.main_grad + dw
        dw = None
    db = None
    if bias is not None:
        db = dy.reshape([-1, dy.shape[-1]]).sum(axis=0)
        if hasattr(bias, "main_grad"):
            bias.main_grad = db if bias.main_grad is None else bias.main_grad + db
            db = None
        return dx, dw, db
    return dx, dw


class SaveWeightAlone(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias=None, name=None):
        y = paddle.nn.functional.linear(x, weight, bias)
        ctx.save_for_backward(weight)
        ctx.x = x
        ctx.bias = bias
        return y

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensor()
        return _backward(weight, ctx.x, ctx.bias, dy)


class SaveAll(PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias=None, name=None):
        y = paddle.nn.functional.linear(x, weight, bias)
        ctx.save_for_backward(x, weight, bias)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensor()
        return _backward(weight, x, bias, dy)


class Block(paddle.nn.Layer):
    """linear -> tanh -> linear, each linear through ``layer_cls`` (or plain F.linear)."""

    def __init__(self, d_in=8, d_hidden=16, bias=True, layer_cls=None, dropout=0.0):
        super().__init__()
        self.fc1 = paddle.nn.Linear(d_in, d_hidden, bias_attr=None if bias else False)
        self.fc2 = paddle.nn.Linear(d_hidden, d_in, bias_attr=None if bias else False)
        self.layer_cls = layer_cls
        self.dropout = dropout

    def _lin(self, fc, x):
        if self.layer_cls is None:
            return paddle.nn.functional.linear(x, fc.weight, fc.bias)
        return self.layer_cls.apply(x, fc.weight, fc.bias)

    def forward(self, x):
        h = paddle.tanh(self._lin(self.fc1, x))
        if self.dropout:
            h = paddle.nn.functional.dropout(h, self.dropout)
        return self._lin(self.fc2, h)
