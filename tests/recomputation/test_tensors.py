"""Tensor helpers of the recompute engines (:mod:`paddle_mgrad.recomputation.tensors`)."""

import paddle

from paddle_mgrad.recomputation.tensors import distinct_bytes


def test_distinct_bytes_counts_each_buffer_once():
    """A tensor listed twice and a reshape of it (one buffer) count once; another tensor and
    a view starting inside the buffer (its own pointer) count on their own; an empty tensor
    counts nothing."""
    x = paddle.ones([4, 4])  # 64 bytes
    view = x[2:]  # 32 bytes from byte 32 of x's buffer
    assert distinct_bytes([x, x, x.reshape([16]), paddle.ones([2]), paddle.ones([0, 3])]) == 72
    assert distinct_bytes([x.reshape([2, 8]), x]) == 64
    assert distinct_bytes([view, paddle.ones([3], dtype="float64")]) == 32 + 24
    assert distinct_bytes([]) == 0
