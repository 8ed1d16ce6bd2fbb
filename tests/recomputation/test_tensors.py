"""Tensor helpers of the recompute engines (:mod:`paddle_mgrad.recomputation.tensors`)."""

import functools

import numpy as np
import paddle
import pytest

from paddle_mgrad.errors import RecomputeError
from paddle_mgrad.recomputation.tensors import (
    check_arguments_unchanged,
    describe,
    distinct_bytes,
    fingerprint,
    fingerprint_mismatch,
    function_name,
)


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


def test_distinct_bytes_keeps_a_buffers_largest_tensor_in_any_order():
    """A view that starts where its base starts (one pointer) is the base's buffer: the base's
    bytes count, listed before or after the view."""
    x = paddle.ones([4, 4])  # 64 bytes
    head = x[:1]  # 16 bytes (a view on 3.x; Paddle 2.6's slice is a copy)
    want = 64 if head.data_ptr() == x.data_ptr() else 64 + 16
    assert distinct_bytes([x, head]) == distinct_bytes([head, x]) == want


def test_function_name_of_a_callable_without_a_qualname_is_its_repr():
    def block(t):
        return t

    partial = functools.partial(block)
    assert function_name(block).endswith("block")
    assert function_name(partial) == repr(partial)
    assert function_name(paddle.nn.Linear(2, 2)) == "Linear"


def test_a_changed_argument_is_named_with_its_block():
    def block(t):
        return t

    t = paddle.ones([2])
    versions = [t._inplace_version()]
    check_arguments_unchanged(block, [t], versions)  # unchanged: nothing raised
    t.scale_(2.0)
    with pytest.raises(RecomputeError, match=r"recompute\(.*block\): its tensor argument #0"):
        check_arguments_unchanged(block, [t], versions)
    assert describe(None) == "None"


def test_fingerprint_sees_a_single_element_and_skips_what_it_cannot_read():
    """A one-element tensor's fingerprint follows its value; None and complex tensors have
    none (nothing to compare)."""
    one, other = fingerprint(paddle.to_tensor([1.0])), fingerprint(paddle.to_tensor([2.0]))
    assert fingerprint_mismatch(one.numpy(), other.numpy()) is not None
    assert fingerprint_mismatch(one.numpy(), one.numpy()) is None
    assert fingerprint(None) is None
    assert fingerprint(paddle.to_tensor(np.array([1 + 2j], "complex64"))) is None
