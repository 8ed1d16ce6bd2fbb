"""Tensor helpers of the recompute engines (:mod:`paddle_mgrad.recomputation.tensors`)."""

import functools

import numpy as np
import paddle
import pytest

from paddle_mgrad.errors import RecomputeError
from paddle_mgrad.recomputation.tensors import (
    FINGERPRINT_FIELDS,
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


def _fingerprint_by_its_definition(values):
    """The four fields of :data:`FINGERPRINT_FIELDS` computed in numpy from what they are
    documented to be: the sum, the sum of squares, and the sum of a strided sample of at most
    1024 elements (every ``n // 1024``-th, at least every one) weighted by fixed pseudo-random
    weights in [1, 2) -- ``RandomState(0x5EED + len(sample))`` -- once as it is and once with
    its finite elements as 0 and NaN, +inf and -inf as 3, 5 and -7."""
    flat = values.reshape(-1)
    sample = flat[:: max(1, flat.size // 1024)][:1024]
    w = np.random.RandomState(0x5EED + sample.size).uniform(1.0, 2.0, sample.size)
    w = w.astype("float32").astype(flat.dtype)
    stand_in = np.where(np.isnan(sample), 3.0, np.where(sample > 0, 5.0, -7.0))
    marks = np.where(np.isfinite(sample), 0.0, stand_in).astype(flat.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.array([flat.sum(), flat @ flat, sample @ w, marks @ w], dtype="float64")


@pytest.mark.parametrize("n", [5, 1024, 3001])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_the_fingerprint_is_what_its_fields_say(n, dtype):
    """Each field against its definition (numpy, float32 weights; half-precision tensors are
    fingerprinted as float32): a finite tensor (its non-finite pattern 0), and one with NaN,
    +inf and -inf at sampled places (its sums non-finite, the pattern field finite)."""
    values = np.random.RandomState(n).uniform(-2, 2, n).astype(dtype)
    marked = values.copy()
    step = max(1, n // 1024)
    marked[[0, step * (min(n, 1024) // 2), step * (min(n, 1024) - 1)]] = [np.nan, np.inf, -np.inf]
    for v in (values, marked):
        got = fingerprint(paddle.to_tensor(v)).numpy()
        want = _fingerprint_by_its_definition(v.astype("float32") if dtype == "float16" else v)
        for field, (g, w) in enumerate(zip(got, want)):
            if np.isfinite(w):
                assert abs(g - w) <= 1e-5 * max(1.0, abs(w)), (FINGERPRINT_FIELDS[field], g, w)
            else:
                assert np.isnan(g) if np.isnan(w) else g == w, (FINGERPRINT_FIELDS[field], g, w)
    assert fingerprint(paddle.zeros([0, 3], dtype=dtype)).numpy().tolist() == [0.0] * 4
