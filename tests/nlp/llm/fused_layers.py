"""PaddleNLP-style ``llm/fused_layers.py`` (written for this test, in the form PaddleNLP 2.8's
file and the seed report use): ``mock_layers()`` rebinds ``paddle.nn.functional.linear`` to a
PyLayer that saves ``(x, weight, bias)`` with ``ctx.save_for_backward`` -- bias may be None --
and accumulates the weight/bias gradients with ``paddle._C_ops.fused_linear_param_grad_add``
into ``main_grad`` (setting it on the first micro-step), returning None for them.

Knows nothing about paddle_mgrad.  On CPU, plain Paddle has no kernel for that op; Paddle's
non-reentrant recompute hands ``weight`` back as a ``<name>cpy`` copy without ``main_grad``
(2.6) and rejects the None bias (2.6).
"""

import paddle
from paddle import _C_ops

origin_linear = paddle.nn.functional.linear


class FusedLinearWithGradAdd(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, x, weight, bias=None, name=None):
        y = origin_linear(x, weight, bias)
        ctx.save_for_backward(x, weight, bias)
        return y

    @staticmethod
    def backward(ctx, y_grad):
        x, weight, bias = ctx.saved_tensor()
        x_grad = paddle.matmul(y_grad, weight, transpose_y=True)

        # _C_ops.fused_linear_param_grad_add(x, dout, dweight, dbias, multi_precision, has_bias)
        if bias is None:
            if hasattr(weight, "main_grad"):
                weight.main_grad, _ = _C_ops.fused_linear_param_grad_add(
                    x, y_grad, weight.main_grad, None, True, False
                )
                return x_grad, None
            if weight.grad is not None:
                _C_ops.fused_linear_param_grad_add(x, y_grad, weight.grad, None, False, False)
                return x_grad, None
            weight_grad, _ = _C_ops.fused_linear_param_grad_add(x, y_grad, None, None, False, False)
            return x_grad, weight_grad

        if hasattr(weight, "main_grad") and hasattr(bias, "main_grad"):
            weight.main_grad, bias.main_grad = _C_ops.fused_linear_param_grad_add(
                x, y_grad, weight.main_grad, bias.main_grad, True, True
            )
            return x_grad, None, None
        if weight.grad is not None:
            assert bias.grad is not None
            _C_ops.fused_linear_param_grad_add(x, y_grad, weight.grad, bias.grad, False, True)
            return x_grad, None, None
        weight_grad, bias_grad = _C_ops.fused_linear_param_grad_add(
            x, y_grad, None, None, False, True
        )
        return x_grad, weight_grad, bias_grad


def mock_layers():
    paddle.nn.functional.linear = FusedLinearWithGradAdd.apply
    if paddle.is_compiled_with_cuda():
        paddle.incubate.nn.functional.fused_linear = FusedLinearWithGradAdd.apply
