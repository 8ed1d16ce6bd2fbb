"""Tensor helpers of the recompute engines (:mod:`paddle_mgrad.recomputation.tensors`)."""

import functools

import numpy as np
import paddle
import pytest

from paddle_mgrad.autograd import backward_errors
from paddle_mgrad.errors import RecomputeError
from paddle_mgrad.recomputation.tensors import (
    FINGERPRINT_FIELDS,
    buffer_sharing_tensor,
    check_arguments_unchanged,
    describe,
    distinct_bytes,
    fingerprint,
    fingerprint_mismatch,
    function_name,
    spec,
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
    assert distinct_bytes([paddle.ones([1], dtype="uint8")]) == 1  # (a one-byte buffer counts)


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
    """Nothing raised while the argument is unchanged; once changed, the whole message (what
    users read), and the error recorded: raised inside Paddle's backward engine (which turns it
    into ``OSError: (External)``), a wrapped pass re-raises it as itself."""

    def block(t):
        return t

    t = paddle.ones([2])
    versions = [t._inplace_version()]
    check_arguments_unchanged(block, [t], versions)  # unchanged: nothing raised
    t.scale_(2.0)
    with pytest.raises(RecomputeError, match=r"recompute\(.*block\): its tensor argument #0"):
        check_arguments_unchanged(block, [t], versions)
    assert describe(None) == "None"

    def engine():  # as Paddle's C++ engine does with a Python error
        try:
            check_arguments_unchanged(block, [t], versions)
        except RecomputeError as e:
            raise OSError(f"(External) {e}") from None

    with pytest.raises(RecomputeError) as info:
        backward_errors.run(engine, (), {})
    assert str(info.value) == (
        f"recompute({function_name(block)}): its tensor argument #0 {describe(t)} has been "
        "modified by an inplace operation after the block was called (inplace version 1, 0 "
        "at the call); recomputation would start from the changed value and the gradients "
        "would be wrong. Change a copy of it, or change it after backward."
    )


def test_a_buffer_sharing_tensor_is_a_new_tensor_over_the_same_buffer():
    """What Paddle 2.6's unpack hands its engine (which moves the buffer out of it): a new
    tensor object over ``t``'s buffer, with ``t``'s shape, dtype, ``stop_gradient`` and
    persistence, named after it -- from ``t`` itself or from its spec."""
    param = paddle.create_parameter([2, 3], "float64")  # (persistable, needs a gradient)
    plain = paddle.ones([4], dtype="float32")  # (stop_gradient)
    for t in (param, plain):
        for t_spec in (None, spec(t)):
            out = buffer_sharing_tensor(t, t_spec)
            assert out is not t and out.data_ptr() == t.data_ptr()
            assert (out.shape, out.dtype) == (t.shape, t.dtype)
            assert (out.stop_gradient, out.persistable) == (t.stop_gradient, t.persistable)
            assert out.name == t.name + "@mgrad"


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
    fingerprinted as float32, float64 ones in float64: equal to 1e-12), as one float64 tensor:
    a finite tensor (its non-finite pattern 0), and one with NaN, +inf and -inf at sampled
    places (its sums non-finite, the pattern field finite); an empty tensor's is four float64
    zeros (fingerprints are stacked together to be compared)."""
    rtol = 1e-12 if dtype == "float64" else 1e-5
    values = np.random.RandomState(n).uniform(-2, 2, n).astype(dtype)
    marked = values.copy()
    step = max(1, n // 1024)
    marked[[0, step * (min(n, 1024) // 2), step * (min(n, 1024) - 1)]] = [np.nan, np.inf, -np.inf]
    for v in (values, marked):
        got = fingerprint(paddle.to_tensor(v)).numpy()
        assert got.dtype == np.float64
        want = _fingerprint_by_its_definition(v.astype("float32") if dtype == "float16" else v)
        for field, (g, w) in enumerate(zip(got, want)):
            if np.isfinite(w):
                assert abs(g - w) <= rtol * max(1.0, abs(w)), (FINGERPRINT_FIELDS[field], g, w)
            else:
                assert np.isnan(g) if np.isnan(w) else g == w, (FINGERPRINT_FIELDS[field], g, w)
    empty = fingerprint(paddle.zeros([0, 3], dtype=dtype))
    assert empty.dtype == paddle.float64 and empty.numpy().tolist() == [0.0] * 4
