"""Small tensor helpers shared by both recompute implementations."""

from __future__ import annotations

import math

import numpy as np

from .._compat import core, is_tensor, paddle
from ..autograd import backward_errors as _errors
from ..errors import RecomputeError


def describe(t) -> str:
    if t is None:
        return "None"
    return f"Tensor(name={t.name!r}, shape={list(t.shape)}, dtype={t.dtype})"


def spec(t):
    """What the determinism check compares: ``(shape, dtype)``, or None for None."""
    return None if t is None else (tuple(t.shape), t.dtype)


def function_name(function) -> str:
    if isinstance(function, paddle.nn.Layer):
        return type(function).__name__
    return getattr(function, "__qualname__", None) or repr(function)


def iter_tensors(obj):
    """Every tensor in ``obj``, descending into tuples, lists and dict values."""
    if is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_tensors(o)


def distinct_bytes(tensors) -> int:
    """The bytes of the buffers ``tensors`` hold, each buffer once: autograd saves one tensor
    for several ops (a linear's output for the op after it, softmax's output for itself and
    for the matmul after it) and a reshape's output shares its input's buffer, so a sum over
    saved tensors counts such a buffer twice or more.  Buffers are told apart by their data
    pointer (alive at once, no two share one unless they share the buffer); a view that
    starts inside another's buffer counts on its own."""
    sizes: dict = {}
    for t in tensors:
        nbytes = math.prod(t.shape) * t.element_size()
        ptr = t.data_ptr() if nbytes else id(t)
        if nbytes > sizes.get(ptr, -1):
            sizes[ptr] = nbytes
    return sum(sizes.values())


def first_changed(tensors, versions):
    """The first ``(index, tensor, version)`` of ``tensors`` whose in-place version is no longer
    the one in ``versions`` (read at the block's call), or None: the one question both
    recompute modes ask about a block's tensor arguments."""
    for k, (t, v) in enumerate(zip(tensors, versions)):
        if t._inplace_version() != v:
            return k, t, v
    return None


def check_arguments_unchanged(function, tensors, versions):
    """Raise :class:`RecomputeError` if one of ``tensors`` (a block's tensor arguments, as
    kept for its replay) was changed in place since ``versions`` were read at the call:
    the replay would start from the changed value and every gradient it feeds would be
    wrong, silently (plain Paddle without recompute refuses the backward where the block
    saved that argument; Paddle's own recompute, in both modes, computes with the changed
    value).  The error is recorded so that it keeps its type through Paddle's engine."""
    changed = first_changed(tensors, versions)
    if changed is not None:
        k, t, v = changed
        err = RecomputeError(
            f"recompute({function_name(function)}): its tensor argument #{k} "
            f"{describe(t)} has been modified by an inplace operation after the block "
            f"was called (inplace version {t._inplace_version()}, {v} at the call); "
            "recomputation would start from the changed value and the gradients would "
            "be wrong. Change a copy of it, or change it after backward."
        )
        _errors.record(err)  # Paddle's engine re-raises it as OSError
        raise err


def any_needs_grad(obj) -> bool:
    """Whether any tensor in ``obj`` (see :func:`iter_tensors`) needs a gradient."""
    return any(not t.stop_gradient for t in iter_tensors(obj))


_LOD_TENSOR = core.VarDesc.VarType.LOD_TENSOR


def detached_view(t):
    """A tensor sharing ``t``'s buffer, with its ``stop_gradient`` and Python attributes."""
    view = t.detach()
    view.stop_gradient = t.stop_gradient
    attrs = getattr(t, "__dict__", None)
    if attrs:
        view.__dict__.update(attrs)
    return view


def buffer_sharing_tensor(t, t_spec=None):
    """A new tensor object with its own DenseTensor that shares ``t``'s allocation.

    Paddle 2.6's ``TensorWrapper::recover`` *moves* the memory holder out of
    whatever the unpack hook returns; handing it the parameter itself would
    leave the parameter without storage (wrong values, then a segfault).
    ``t_spec``: ``spec(t)`` when the caller has it (two questions to Paddle fewer).
    """
    shape, dtype = (t.shape, t.dtype) if t_spec is None else (list(t_spec[0]), t_spec[1])
    out = core.eager.Tensor(dtype, shape, t.name + "@mgrad", _LOD_TENSOR, t.persistable)
    t._share_buffer_to(out)
    out.stop_gradient = t.stop_gradient
    return out


# -- value fingerprints (determinism_check="values") ---------------------------
FINGERPRINT_FIELDS = (
    "sum",
    "sum of squares",
    "position-weighted sample sum",
    "non-finite pattern of the sample",
)
_SAMPLE = 1024  # elements in the strided sample
_weights: dict = {}  # (place, n) -> n fixed pseudo-random float32 weights (tiny, shared)
# stand-ins for the non-finite values of the sample (field 3): distinct, finite, and
# far from each other so that a NaN appearing or an inf changing sign moves the sum
_NAN, _POSINF, _NEGINF = 3.0, 5.0, -7.0


def _sample_weights(n, place):
    key = (str(place), n)
    w = _weights.get(key)
    if w is None:
        # fixed pseudo-random weights in [1, 2): with the weights 1..n, two different 0/1
        # tensors with equal counts and equal position sums (a dropout mask {1, 4} and
        # {2, 3}) would have equal fingerprints -- common on small masks (the recompute
        # fuzzer found it)
        rs = np.random.RandomState(0x5EED + n)
        w = _weights[key] = paddle.to_tensor(rs.uniform(1.0, 2.0, n).astype("float32"), place=place)
    return w


def fingerprint(t):
    """A cheap fingerprint of ``t``'s values: a float64 tensor of 4 numbers (see
    :data:`FINGERPRINT_FIELDS`), computed on ``t``'s device without a host sync.

    One reduction (sum), one BLAS dot product (sum of squares: no temporary), a
    position-weighted sum of a strided sample of at most 1024 elements (catches
    permutations the sums miss), and the same weighted sum of the sample with
    NaN, +inf and -inf replaced by distinct finite stand-ins (the sums of a tensor
    that legitimately holds them are NaN or +-inf in the forward and in
    recomputation alike; this field still sees which sampled element is which).
    Non-float32/64 tensors are cast to float32 first (a copy).  Returns None for
    tensors it cannot fingerprint (complex)."""
    if t is None or "complex" in str(t.dtype):
        return None
    # no grad (nothing is saved: the pack hooks are not re-entered), no AMP (the sums stay
    # in the tensor's precision and no low-precision kernel is needed on CPU)
    with paddle.no_grad(), paddle.amp.auto_cast(enable=False):
        x = t if t.dtype in (paddle.float32, paddle.float64) else t.astype("float32")
        flat = x.reshape([-1])
        n = flat.shape[0]
        if n == 0:
            return paddle.zeros([len(FINGERPRINT_FIELDS)], dtype="float64")
        step = max(1, n // _SAMPLE)
        sample = flat[::step][:_SAMPLE]
        w = _sample_weights(sample.shape[0], flat.place).astype(flat.dtype)
        finite = paddle.nan_to_num(sample, nan=_NAN, posinf=_POSINF, neginf=_NEGINF)
        finite = paddle.where(paddle.isfinite(sample), paddle.zeros_like(sample), finite)
        parts = [
            flat.sum(),
            paddle.matmul(flat, flat),
            paddle.matmul(sample, w),
            paddle.matmul(finite, w),
        ]
        return paddle.stack([p.reshape([]) for p in parts]).astype("float64")


def fingerprint_mismatch(forward, recomputed, rtol=1e-5):
    """First field where two fingerprints (numpy float64) differ, or None.

    Finite fields are equal up to ``rtol`` relative to the larger magnitude (GPU
    reductions may differ in the last bits between runs).  A non-finite field
    (a tensor holding +-inf or NaN, or a sum of squares that overflowed: values
    near 1e20 in fp32) equals only the same value: inf equals inf of the same sign,
    NaN equals NaN -- never "inf - inf" -- and never a finite number."""
    for i, (a, b) in enumerate(zip(forward, recomputed)):
        if np.isfinite(a) and np.isfinite(b):
            if not abs(a - b) <= rtol * max(abs(a), abs(b)):
                return i
        elif not (a == b or (np.isnan(a) and np.isnan(b))):
            return i
    return None
