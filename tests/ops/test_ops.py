"""The fused weight-gradient op against a float64 reference, in place, with bad input."""

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers import PADDLE2, require_cpp_op
from paddle_mgrad import EnvError, FusedLinearError, env, ops
from paddle_mgrad.ops import _inputs, _reference, dispatch, loader

DTYPES = ["float32", "bfloat16", "float16", "float64"]
# Rows of bf16/fp16 widened per fp32 GEMM, forced through PADDLE_MGRAD_CPU_CHUNK_ROWS (the
# default, a 64 MiB budget in csrc/wgrad_cpu.cc, gives one chunk for every shape tested here).
CHUNK_ROWS = 512

# PADDLE_MGRAD_CPU_BF16=native on a CPU without native bf16 (or with oneDNN capped below it by
# ONEDNN_MAX_CPU_ISA) runs oneDNN's REFERENCE bf16 kernel (exact, ~0.5 GFLOP/s), not the
# hardware dot products: the ids of tests forcing it say which one they ran.
CPU = ops.cpu_info()
NATIVE_ID = "native" if CPU["native_bf16"] else "native-on-onednn-reference-kernel"


def _mp(dtype):
    """Paddle's MPTypeTrait: the multi-precision accumulator of an input dtype."""
    return "float64" if dtype == "float64" else "float32"


@contextlib.contextmanager
def _env(name, value):
    """Set (value None: unset) an environment variable the C++ op reads on every call."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = str(value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _bf16_path(path):
    """Force the CPU bf16 path."""
    return _env("PADDLE_MGRAD_CPU_BF16", path)


def _chunk_rows(rows):
    """Force the rows per widening chunk (None: the op's memory-budget default)."""
    return _env("PADDLE_MGRAD_CPU_CHUNK_ROWS", rows)


def test_backend_is_compiled():
    """CI has a compiler: the C++ op must build (the fallback is tested separately)."""
    assert ops.backend().startswith("cpp-"), ops.fallback_reason()


def _as64(t):
    if t.dtype == paddle.float64:
        return t.numpy()
    return t.astype("float32").numpy().astype("float64")


def _t(arr, dtype):
    """A paddle tensor of dtype from a numpy array (via float32 for 16-bit dtypes)."""
    arr = np.asarray(arr)
    if dtype == "float64":
        return paddle.to_tensor(arr.astype("float64"))
    return paddle.to_tensor(arr.astype("float32")).astype(dtype)


def _name(dt):
    return str(dt).split(".")[-1]


def _tol(dtype_out):
    # fp32 accumulation of K-long dot products; bf16/fp16 outputs round once.
    return {"float32": 2e-5, "bfloat16": 1.6e-2, "float16": 2e-3, "float64": 1e-12}[dtype_out]


def _check_close(got, want, scale, dtype_out):
    err = np.abs(_as64(got) - want)
    bound = _tol(dtype_out) * (scale + 1e-6)
    assert (err <= bound).all(), f"max err {err.max()} > bound {bound.max()}"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    # small leading dims, and single ones around the widening chunk (1, 2 and 3 chunks)
    lead=st.one_of(
        st.lists(st.integers(0, 9), min_size=1, max_size=2),
        st.integers(CHUNK_ROWS - 3, 2 * CHUNK_ROWS + 90).map(lambda m: [m]),
    ),
    K=st.integers(0, 40),
    N=st.integers(0, 40),
    dtype=st.sampled_from(DTYPES),
    give_w=st.booleans(),
    give_b=st.booleans(),
    has_bias=st.booleans(),
    multi_precision=st.booleans(),
    seed=st.integers(0, 2**16),
    bf16_path=st.sampled_from(["auto", "widen", "native"]),
    chunk_rows=st.sampled_from([None, CHUNK_ROWS, 7]),
)
def test_matches_float64_reference(
    lead, K, N, dtype, give_w, give_b, has_bias, multi_precision, seed, bf16_path, chunk_rows
):
    """Random shapes, dtypes, accumulators and bf16 paths against float64 (bf16_path
    "native" is oneDNN's reference bf16 kernel where CPU["native_bf16"] is False)."""
    with _bf16_path(bf16_path), _chunk_rows(chunk_rows):
        _matches_float64_reference(
            lead, K, N, dtype, give_w, give_b, has_bias, multi_precision, seed
        )


def _matches_float64_reference(lead, K, N, dtype, give_w, give_b, has_bias, multi_precision, seed):
    rs = np.random.RandomState(seed)
    x = _t(rs.standard_normal(lead + [K]), dtype)
    dy = _t(rs.standard_normal(lead + [N]), dtype)
    acc = _mp(dtype) if multi_precision else dtype
    w0 = rs.standard_normal([K, N])
    b0 = rs.standard_normal([N])
    dw = _t(w0, acc) if give_w else None
    db = _t(b0, acc) if give_b else None
    w_ptr = dw.data_ptr() if give_w else None
    b_ptr = db.data_ptr() if give_b else None
    w_start = _as64(dw) if give_w else 0.0
    b_start = _as64(db) if give_b else 0.0

    out_w, out_b = ops.fused_linear_param_grad_add(x, dy, dw, db, multi_precision, has_bias)

    M = int(np.prod(lead))
    x2, y2 = _as64(x).reshape(M, K), _as64(dy).reshape(M, N)
    want_w = w_start + x2.T @ y2
    _check_close(out_w, want_w, np.abs(w_start) + np.abs(x2).T @ np.abs(y2), _name(out_w.dtype))
    assert list(out_w.shape) == [K, N]
    if give_w:
        assert out_w is dw and out_w.data_ptr() == w_ptr  # in place
    else:
        assert _name(out_w.dtype) == acc
    if not has_bias:
        assert out_b is None
        if give_b:
            np.testing.assert_array_equal(_as64(db), b_start)  # untouched
        return
    want_b = b_start + y2.sum(0)
    _check_close(out_b, want_b, np.abs(b_start) + np.abs(y2).sum(0), _name(out_b.dtype))
    if give_b:
        assert out_b is db and out_b.data_ptr() == b_ptr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_bias_sums_of_a_large_dout_on_threads(dtype):
    """A dY of several 512-column tiles and at least 2^22 elements sums its columns on OpenMP
    threads (smaller ones on the calling thread: a region waits for MKL's spinning threads);
    both against float64."""
    rs = np.random.RandomState(5)
    M, N = 4100, 1030  # 3 tiles, 4.2M elements: the threaded branch
    x = _t(rs.standard_normal([M, 3]), dtype)
    dy = _t(rs.standard_normal([M, N]), dtype)
    db = _t(rs.standard_normal([N]), _mp(dtype))
    b0 = _as64(db)
    _, out_b = ops.fused_linear_param_grad_add(x, dy, None, db, True, True)
    y2 = _as64(dy)
    _check_close(out_b, b0 + y2.sum(0), np.abs(b0) + np.abs(y2).sum(0), _name(out_b.dtype))
    small = dy[:600, :600]  # one tile: the calling thread
    _, sb = ops.fused_linear_param_grad_add(x[:600], small, None, None, True, True)
    _check_close(sb, _as64(small).sum(0), np.abs(_as64(small)).sum(0), _name(sb.dtype))


def test_accumulates_over_calls_in_place():
    x = paddle.randn([64, 48])
    dy = paddle.randn([64, 32])
    mg = paddle.zeros([48, 32])
    ptr = mg.data_ptr()
    for _ in range(3):
        ops.fused_linear_param_grad_add(x, dy, mg, None, True, False)
    ref = 3 * x.numpy().astype("f8").T @ dy.numpy().astype("f8")
    np.testing.assert_allclose(mg.numpy(), ref, rtol=1e-5, atol=1e-4)
    assert mg.data_ptr() == ptr


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_fallback_gives_same_numbers(dtype, has_bias):
    rs = np.random.RandomState(3)
    x = _t(rs.standard_normal([5, 7, 33]), dtype)
    dy = _t(rs.standard_normal([5, 7, 17]), dtype)
    w1, w2 = paddle.ones([33, 17], _mp(dtype)), paddle.ones([33, 17], _mp(dtype))
    b1, b2 = paddle.ones([17], _mp(dtype)), paddle.ones([17], _mp(dtype))
    a = ops.fused_linear_param_grad_add(x, dy, w1, b1, True, has_bias)
    b = _reference.fused_linear_param_grad_add(x, dy, w2, b2, True, has_bias)
    np.testing.assert_allclose(a[0].numpy(), b[0].numpy(), rtol=1e-5, atol=1e-5)
    assert b[0].data_ptr() == w2.data_ptr()
    if has_bias:
        np.testing.assert_allclose(a[1].numpy(), b[1].numpy(), rtol=1e-5, atol=1e-5)
    # fresh buffers too
    a = ops.fused_linear_param_grad_add(x, dy, None, None, False, has_bias)
    b = _reference.fused_linear_param_grad_add(x, dy, None, None, False, has_bias)
    assert a[0].dtype == b[0].dtype == x.dtype
    np.testing.assert_allclose(
        a[0].astype("float32").numpy(),
        b[0].astype("float32").numpy(),
        rtol=_tol(dtype),
        atol=_tol(dtype) * 10,
    )


BAD = [
    (
        "1-D x",
        lambda: (paddle.randn([8]), paddle.randn([4]), None, None, True, False),
        "at least 2-D",
    ),
    (
        "leading dims",
        lambda: (paddle.randn([3, 8]), paddle.randn([4, 5]), None, None, True, False),
        "[3, 8]",
    ),
    (
        "K vs dweight",
        lambda: (
            paddle.randn([3, 8]),
            paddle.randn([3, 5]),
            paddle.zeros([7, 5]),
            None,
            True,
            False,
        ),
        "[8, 5]",
    ),
    (
        "N vs dweight",
        lambda: (
            paddle.randn([3, 8]),
            paddle.randn([3, 5]),
            paddle.zeros([8, 6]),
            None,
            True,
            False,
        ),
        "[8, 5]",
    ),
    (
        "N vs dbias",
        lambda: (paddle.randn([3, 8]), paddle.randn([3, 5]), None, paddle.zeros([4]), True, True),
        "[5]",
    ),
    (
        "dweight dtype",
        lambda: (
            paddle.randn([3, 8]).astype("bfloat16"),
            paddle.randn([3, 5]).astype("bfloat16"),
            paddle.zeros([8, 5]).astype("float16"),
            None,
            True,
            False,
        ),
        "float16",
    ),
    (
        "unsupported dtype",
        lambda: (
            paddle.ones([3, 8], "int32"),
            paddle.ones([3, 5], "int32"),
            None,
            None,
            True,
            False,
        ),
        "int32",
    ),
    # Paddle's MPTypeTrait<double> is double: fp64 inputs accumulate in fp64 only
    (
        "fp64 into fp32",
        lambda: (
            paddle.randn([3, 8], "float64"),
            paddle.randn([3, 5], "float64"),
            paddle.zeros([8, 5]),
            None,
            True,
            False,
        ),
        "float64",
    ),
    (
        "fp64 into fp32, no mp",
        lambda: (
            paddle.randn([3, 8], "float64"),
            paddle.randn([3, 5], "float64"),
            None,
            paddle.zeros([5]),
            False,
            True,
        ),
        "dbias must be float64",
    ),
    (
        "fp32 into fp64",
        lambda: (
            paddle.randn([3, 8]),
            paddle.randn([3, 5]),
            paddle.zeros([8, 5], "float64"),
            None,
            False,
            False,
        ),
        "dweight must be float32",
    ),
    (
        "mixed dtypes",
        lambda: (
            paddle.randn([3, 8]),
            paddle.randn([3, 5]).astype("bfloat16"),
            None,
            None,
            True,
            False,
        ),
        "same dtype",
    ),
    (
        "numpy x",
        lambda: (np.ones([3, 8], "float32"), paddle.randn([3, 5]), None, None, True, False),
        "x and dout must be paddle Tensors",
    ),
    (
        "numpy dweight",
        lambda: (
            paddle.randn([3, 8]),
            paddle.randn([3, 5]),
            np.zeros([8, 5], "float32"),
            None,
            True,
            False,
        ),
        "dweight must be a paddle Tensor or None, got ndarray",
    ),
    (
        "1-D dweight",
        lambda: (paddle.randn([3, 8]), paddle.randn([3, 5]), paddle.zeros([40]), None, True, False),
        "[8, 5]",
    ),
    (
        "bf16 dbias for fp16",
        lambda: (
            paddle.randn([3, 8]).astype("float16"),
            paddle.randn([3, 5]).astype("float16"),
            None,
            paddle.zeros([5]).astype("bfloat16"),
            False,
            True,
        ),
        "dbias must be float16 or float32",
    ),
    (
        "multi_precision 'no'",
        lambda: (paddle.randn([3, 8]), paddle.randn([3, 5]), None, None, "no", False),
        "multi_precision must be a bool",
    ),
    (
        "has_bias None",
        lambda: (paddle.randn([3, 8]), paddle.randn([3, 5]), None, None, True, None),
        "has_bias must be a bool",
    ),
]


def _what_the_call_got(x, dout, dweight, dbias, multi_precision, has_bias):
    """What the error must name of the call: a non-Tensor x / dout by its type; a bad flag by
    its value and type; otherwise every operand the call uses (dbias only with has_bias), a
    Tensor by its shape and dtype, anything else by its type."""
    if not (isinstance(x, paddle.Tensor) and isinstance(dout, paddle.Tensor)):
        return [f"got {type(x).__name__} and {type(dout).__name__}"]
    for flag in (multi_precision, has_bias):
        if not isinstance(flag, bool):
            return [f"got {flag!r} ({type(flag).__name__})"]

    def named(name, t):
        if not isinstance(t, paddle.Tensor):
            return f"{name} {type(t).__name__}"
        return f"{name} {list(t.shape)} {str(t.dtype).split('.')[-1]}"

    operands = [
        ("x", x),
        ("dout", dout),
        ("dweight", dweight),
        ("dbias", dbias if has_bias else None),
    ]
    return [named(name, t) for name, t in operands if t is not None]


@pytest.mark.parametrize("name,make,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_clear_error(backend, name, make, needle):
    """Bad input on both backends (C++ op, pure-Paddle): FusedLinearError naming the problem
    and what the call was given (shapes and dtypes of its operands, or the bad value)."""
    args = make()
    with pytest.raises(FusedLinearError) as e:
        ops.fused_linear_param_grad_add(*args)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg
    for what in _what_the_call_got(*args):
        assert what in msg, (what, msg)


# One call per refusal of the input check, and its whole text: what is wrong, then every
# operand the call uses, shape, dtype and (for the accumulators) place.
WHOLE = [
    (
        "leading dims",
        lambda: (paddle.randn([3, 8]), paddle.randn([4, 5]), None, None, True, False),
        "x [..., K] and dout [..., N] must have the same leading dims (x [3, 8] float32, "
        "dout [4, 5] float32)",
    ),
    (
        "unsupported dtype",
        lambda: (
            paddle.ones([3, 8], "int32"),
            paddle.ones([3, 5], "int32"),
            None,
            None,
            True,
            False,
        ),
        "unsupported dtype int32; supported: float32, bfloat16, float16, float64 "
        "(x [3, 8] int32, dout [3, 5] int32)",
    ),
    (
        "mixed dtypes",
        lambda: (
            paddle.randn([3, 8]),
            paddle.randn([3, 5]).astype("bfloat16"),
            None,
            None,
            True,
            False,
        ),
        "x and dout must have the same dtype (x [3, 8] float32, dout [3, 5] bfloat16)",
    ),
    (
        "dweight shape",
        lambda: (
            paddle.randn([3, 8]),
            paddle.randn([3, 5]),
            paddle.zeros([7, 5]),
            None,
            True,
            True,
        ),
        "dweight must be [K, N] = [8, 5] (x [3, 8] float32, dout [3, 5] float32, "
        "dweight [7, 5] float32 on Place(cpu))",
    ),
    (
        "dbias shape",
        lambda: (
            paddle.randn([3, 8]),
            paddle.randn([3, 5]),
            paddle.zeros([8, 5]),
            paddle.zeros([4]),
            True,
            True,
        ),
        "dbias must be [N] = [5] (x [3, 8] float32, dout [3, 5] float32, dweight [8, 5] float32 "
        "on Place(cpu), dbias [4] float32 on Place(cpu))",
    ),
    # multi_precision: the accumulator is float32, never the input dtype
    (
        "bf16 dweight with mp",
        lambda: (
            paddle.randn([3, 8]).astype("bfloat16"),
            paddle.randn([3, 5]).astype("bfloat16"),
            paddle.zeros([8, 5]).astype("bfloat16"),
            None,
            True,
            False,
        ),
        "dweight must be float32 when multi_precision=True (x [3, 8] bfloat16, dout [3, 5] "
        "bfloat16, dweight [8, 5] bfloat16 on Place(cpu))",
    ),
    (
        "bf16 dbias for fp16",
        lambda: (
            paddle.randn([3, 8]).astype("float16"),
            paddle.randn([3, 5]).astype("float16"),
            None,
            paddle.zeros([5]).astype("bfloat16"),
            False,
            True,
        ),
        "dbias must be float16 or float32 (x [3, 8] float16, dout [3, 5] float16, "
        "dbias [5] bfloat16 on Place(cpu))",
    ),
]


@pytest.mark.parametrize("name,make,text", WHOLE, ids=[w[0] for w in WHOLE])
def test_each_refusal_in_full(backend, name, make, text):
    with pytest.raises(FusedLinearError) as e:
        ops.fused_linear_param_grad_add(*make())
    assert str(e.value) == "fused_linear_param_grad_add: " + text


def test_dbias_is_no_operand_without_has_bias(backend):
    """has_bias=False: dbias is neither checked nor written, whatever it is."""
    x, dy, junk = paddle.ones([4, 3]), paddle.ones([4, 5]), paddle.zeros([7])
    dw, db = ops.fused_linear_param_grad_add(x, dy, None, junk, True, False)
    assert db is None and not junk.numpy().any()
    np.testing.assert_array_equal(dw.numpy(), np.full([3, 5], 4.0))


class _EnumDtype:
    """A dtype as Paddle 2.6 hands it out: a new object per ``.dtype``, ``int()`` its enum
    value, ``str()`` its name."""

    def __init__(self, value, text):
        self.value, self.text = value, text

    def __int__(self):
        return self.value

    def __str__(self):
        return self.text


class _OtherEnumDtype(_EnumDtype):
    """Another enum type (Paddle 2.6 has two, VarType and DataType), its values overlapping."""


def test_dtype_name_of_each_kind_of_dtype(monkeypatch):
    """``_inputs.dtype_name``: Paddle's dtype objects, strings, objects without an enum value
    (numpy's dtypes) and Paddle 2.6's new objects per call, found by (type, value), not by
    value alone; an id recycled for another object is not taken for that object's."""
    monkeypatch.setattr(_inputs, "_BY_ENUM", {})
    name = _inputs.dtype_name
    assert [
        name(paddle.bfloat16),
        name("float16"),
        name("paddle.float16"),
        name(np.dtype("float64")),
    ] == ["bfloat16", "float16", "float16", "float64"]
    fp32 = [_EnumDtype(5, "paddle.float32") for _ in range(2)]
    assert [
        name(fp32[0]),
        name(fp32[1]),
        name(_OtherEnumDtype(5, "paddle.int8")),
        name(_EnumDtype(6, "paddle.float16")),
    ] == ["float32", "float32", "int8", "float16"]
    fp64 = _EnumDtype(7, "paddle.float64")
    monkeypatch.setitem(_inputs._BY_ID, id(fp64), (object(), "int32"))
    assert name(fp64) == "float64"


class _CountingDtype(_EnumDtype):
    """An :class:`_EnumDtype` that counts the questions asked of it (on a real dtype object
    each is a pybind call of microseconds)."""

    def __init__(self, value, text):
        super().__init__(value, text)
        self.asked = 0

    def __int__(self):
        self.asked += 1
        return self.value

    def __str__(self):
        self.asked += 1
        return self.text


def test_dtype_name_asks_each_dtype_at_most_once(monkeypatch):
    """A dtype object Paddle hands out every time (3.x, and the ``paddle.float32`` objects) is
    named from its entry by ``id()``, without a question to it; of one made anew per ``.dtype``
    (2.6) only the enum value is asked, and the name of an enum value once."""
    monkeypatch.setattr(_inputs, "_BY_ID", dict(_inputs._BY_ID))
    monkeypatch.setattr(_inputs, "_BY_ENUM", {})
    same = _CountingDtype(5, "paddle.float32")
    assert _inputs._remember(same) == "float32"
    same.asked = 0
    assert [_inputs.dtype_name(same) for _ in range(3)] == ["float32"] * 3
    assert same.asked == 0
    fresh = [_CountingDtype(6, "paddle.float16") for _ in range(3)]
    assert [_inputs.dtype_name(d) for d in fresh] == ["float16"] * 3
    assert [d.asked for d in fresh] == [2, 1, 1]  # int() and str(), then int() only


def _run_isolated(code, env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


CHECK = """
    import zlib, numpy as np, paddle
    from paddle_mgrad import ops
    print("BACKEND", ops.backend())
    rs = np.random.RandomState(0)
    for dtype in ("float32", "bfloat16", "float16", "float64"):
        acc = "float64" if dtype == "float64" else "float32"
        x = paddle.to_tensor(rs.standard_normal([700, 37]).astype(acc)).astype(dtype)
        dy = paddle.to_tensor(rs.standard_normal([700, 530]).astype(acc)).astype(dtype)
        mg = paddle.ones([37, 530], acc); mb = paddle.ones([530], acc)
        ops.fused_linear_param_grad_add(x, dy, mg, mb, True, True)
        x2 = x.astype(acc).numpy().astype("f8"); y2 = dy.astype(acc).numpy().astype("f8")
        np.testing.assert_allclose(mg.numpy(), 1 + x2.T @ y2, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(mb.numpy(), 1 + y2.sum(0), rtol=1e-4, atol=1e-3)
        # fresh output, three widening chunks: beta applies to the first chunk only
        fw, _ = ops.fused_linear_param_grad_add(
            paddle.concat([x, x]), paddle.concat([dy, dy]), None, None, True, False)
        np.testing.assert_allclose(fw.numpy(), 2 * x2.T @ y2, rtol=1e-4, atol=1e-3)
    entry = ops.cpu_entry("float32")
    assert (entry is not None) == ops.backend().startswith("cpp-")
    if entry is not None:  # the C++ op's fast entry: the one-call linear backward, dx included
        for shape in ([3, 70, 37], [5, 37]):  # a product above and below the 1-thread bound
            x = paddle.to_tensor(rs.standard_normal(shape).astype("f4"))
            dy = paddle.to_tensor(rs.standard_normal(shape[:-1] + [53]).astype("f4"))
            w = paddle.to_tensor(rs.standard_normal([37, 53]).astype("f4"))
            mg = paddle.ones([37, 53])
            dx, dw, _ = entry.linear_bwd(x, dy, w, mg, None, False)
            x2 = x.numpy().reshape(-1, 37).astype("f8"); y2 = dy.numpy().reshape(-1, 53)
            np.testing.assert_allclose(dx.numpy().reshape(-1, 37), y2 @ w.numpy().T.astype("f8"),
                                       rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(mg.numpy(), 1 + x2.T @ y2, rtol=1e-4, atol=1e-4)
    print("OK")
"""


@pytest.mark.probe
@pytest.mark.heavy
def test_portable_cpu_path_without_onednn(tmp_path):
    """The build for machines without oneDNN (blocked OpenMP GEMM) is correct too."""
    r = _run_isolated(
        CHECK,
        {
            "PADDLE_MGRAD_NO_ONEDNN": "1",
            "PADDLE_MGRAD_CACHE": str(tmp_path),
            "PADDLE_MGRAD_CPU_CHUNK_ROWS": str(CHUNK_ROWS),
        },
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BACKEND cpp-portable" in r.stdout and "OK" in r.stdout


@pytest.mark.probe
def test_forced_python_fallback_warns_nothing_and_works():
    r = _run_isolated(CHECK, {"PADDLE_MGRAD_OPS": "python"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BACKEND python" in r.stdout and "OK" in r.stdout


@pytest.mark.probe
def test_failed_build_falls_back_with_one_warning(tmp_path):
    code = """
        import os, warnings, zlib
        import paddle
        from paddle_mgrad.ops import _build
        _build.CORE_SOURCES = ["does_not_exist.cc"]
        from paddle_mgrad import ops
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            b = ops.backend(); ops.backend()
            paddle.seed(0)
            x = paddle.randn([4, 3]); dy = paddle.randn([4, 2])
            dw, _ = ops.fused_linear_param_grad_add(x, dy, None, None, True, False)
        msgs = [str(m.message) for m in w if "paddle_mgrad" in str(m.message)]
        print("BACKEND", b, "WARNINGS", len(msgs), msgs[0][:200] if msgs else "")
        import numpy as np
        np.testing.assert_allclose(dw.numpy(), x.numpy().T @ dy.numpy(), rtol=1e-5, atol=1e-5)
        print("OK")
    """
    r = _run_isolated(code, {"PADDLE_MGRAD_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    # (on a CUDA Paddle the GPU tier follows: "python;gpu=paddle-fused")
    assert re.search(r"BACKEND python(;gpu=\S+)? WARNINGS 1 ", r.stdout) and "OK" in r.stdout, (
        r.stdout
    )


# ---------------------------------------------------------------- zero-size
ZERO_SHAPES = [(3, 2, 0), (4, 0, 3), (0, 2, 3), (2, 0, 0), (0, 0, 0), (0, 5, 0)]  # (M, K, N)


@pytest.mark.parametrize("M,K,N", ZERO_SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("given", [False, True])
def test_zero_size_like_paddle(M, K, N, dtype, given):
    """K, N or M = 0: a given accumulator is returned unchanged (+0), a missing one is zeros
    [K, N] / [N] of the accumulator dtype; dbias += column sums of dy (K = 0 still has them)."""
    rs = np.random.RandomState(M * 100 + K * 10 + N)
    x, dy = _t(rs.standard_normal([M, K]), dtype), _t(rs.standard_normal([M, N]), dtype)
    acc = _mp(dtype)
    dw = _t(rs.standard_normal([K, N]), acc) if given else None
    db = _t(rs.standard_normal([N]), acc) if given else None
    w0 = _as64(dw) if given else np.zeros([K, N])
    b0 = _as64(db) if given else np.zeros([N])
    out_w, out_b = ops.fused_linear_param_grad_add(x, dy, dw, db, True, True)
    assert list(out_w.shape) == [K, N] and list(out_b.shape) == [N]
    assert _name(out_w.dtype) == _name(out_b.dtype) == acc
    if given:
        assert out_w is dw and out_b is db
    y2 = _as64(dy).reshape(M, N)
    np.testing.assert_allclose(_as64(out_w), w0 + _as64(x).reshape(M, K).T @ y2, atol=1e-5)
    np.testing.assert_allclose(_as64(out_b), b0 + y2.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,K,N", ZERO_SHAPES)
def test_zero_size_raw_op(M, K, N):
    """The C++ op itself takes zero-element (null-pointer) inputs.  Paddle 2.6's custom-op
    runtime rejects zero-size outputs, so there the wrapper computes K = 0 / N = 0 itself."""
    module = ops.load()
    x, dy = paddle.ones([M, K]), paddle.ones([M, N])
    dw, db = paddle.full([K, N], 2.0), paddle.full([N], 3.0)
    if PADDLE2 and K * N == 0:
        with pytest.raises(Exception, match="not initialized"):
            module.pmg_fused_wgrad_add(x, dy, dw, db, True, True)
        return
    out_w, out_b = module.pmg_fused_wgrad_add(x, dy, dw, db, True, True)
    np.testing.assert_array_equal(out_w.numpy(), np.full([K, N], 2.0 + M))
    np.testing.assert_array_equal(out_b.numpy(), np.full([N], 3.0 + M))
    fresh_w, fresh_b = module.pmg_fused_wgrad_add(x, dy, None, None, True, True)
    np.testing.assert_array_equal(fresh_w.numpy(), np.full([K, N], float(M)))
    np.testing.assert_array_equal(fresh_b.numpy(), np.full([N], float(M)))


def test_raw_op_writes_given_accumulators_in_place_and_allocates_absent_ones():
    """Why pmg_fused_wgrad_add does not declare its in-place writes with SetInplaceMap (the
    comment at its registration): given DWeight / DBias are written in place and returned (the
    same storage), absent ones come back freshly allocated -- an optional in-place output would
    be None there."""
    module = require_cpp_op()
    x, dy = paddle.ones([3, 2]), paddle.ones([3, 4])
    dw, db = paddle.full([2, 4], 1.0), paddle.full([4], 2.0)
    ptrs = dw.data_ptr(), db.data_ptr()
    out_w, out_b = module.pmg_fused_wgrad_add(x, dy, dw, db, True, True)
    assert (out_w.data_ptr(), out_b.data_ptr()) == ptrs
    np.testing.assert_array_equal(dw.numpy(), np.full([2, 4], 4.0))  # the input itself
    np.testing.assert_array_equal(db.numpy(), np.full([4], 5.0))
    fresh_w, fresh_b = module.pmg_fused_wgrad_add(x, dy, None, None, True, True)
    assert fresh_w is not None and fresh_b is not None
    assert fresh_w.data_ptr() not in ptrs and fresh_b.data_ptr() not in ptrs
    np.testing.assert_array_equal(fresh_w.numpy(), np.full([2, 4], 3.0))
    np.testing.assert_array_equal(fresh_b.numpy(), np.full([4], 3.0))


def _linear_grads(fn, xn, wn, bn, dtype="float32", main_grad=False):
    # plain leaf tensors: Paddle 2.6's create_parameter refuses zero-size shapes
    x = paddle.to_tensor(xn.astype(dtype), stop_gradient=False)
    w = paddle.to_tensor(wn.astype(dtype), stop_gradient=False)
    b = None if bn is None else paddle.to_tensor(bn.astype(dtype), stop_gradient=False)
    if main_grad:
        w.main_grad = None
    y = fn(x, w, b)
    (y * y).sum().backward() if y.size else y.sum().backward()
    grad_w = w.main_grad if main_grad else w.grad
    return (
        y.numpy(),
        x.grad.numpy(),
        (None if grad_w is None else grad_w.numpy()),
        (None if b is None else b.grad.numpy()),
        (None if grad_w is None else grad_w.dtype),
    )


@pytest.mark.parametrize(
    "xs,ws", [([3, 2], [2, 0]), ([4, 3, 2], [2, 0]), ([0, 4], [4, 3]), ([3, 0], [0, 5])]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_linear_zero_size_matches_paddle(xs, ws, with_bias):
    """Paddle's TestLinearAPI_ZeroSize (weight [2, 0]) and other zero-size linears give
    Paddle's outputs and gradients through paddle_mgrad.fused_linear."""
    import paddle.nn.functional as F

    from paddle_mgrad import fused_linear

    rs = np.random.RandomState(0)
    xn, wn = rs.standard_normal(xs), rs.standard_normal(ws)
    bn = rs.standard_normal([ws[1]]) if with_bias else None
    try:
        want = _linear_grads(F.linear, xn, wn, bn)
    except ValueError as e:  # Paddle 2.6's matmul rejects zero-size operands: so must we
        assert PADDLE2, e
        with pytest.raises(type(e), match="dims size must not be equal 0"):
            _linear_grads(fused_linear, xn, wn, bn)
        return
    ours = _linear_grads(fused_linear, xn, wn, bn)
    for got, ref in zip(ours[:4], want[:4]):
        if ref is None:
            assert got is None
        else:
            assert got.shape == ref.shape
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert ours[4] == want[4]
    # into main_grad (allocated fp32 on the parameter at the first micro-step)
    mg = _linear_grads(fused_linear, xn, wn, bn, main_grad=True)
    assert list(mg[2].shape) == ws and mg[4] == paddle.float32
    np.testing.assert_allclose(mg[2], want[2], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- float64
@pytest.mark.parametrize("M,K,N", [(300, 200, 1030), (257, 97, 9), (1, 7, 1), (5, 1, 2049)])
@pytest.mark.parametrize("given", [False, True])
def test_float64_across_gemm_blocks(M, K, N, given):
    """The fp64 GEMM's blocking (256-deep slices, 96-row blocks, 1024-wide panels, 6x8 tiles,
    ragged edges) against numpy in float64, in place or fresh, with bias."""
    rs = np.random.RandomState(M + K + N)
    xn, yn = rs.standard_normal([M, K]), rs.standard_normal([M, N])
    w0, b0 = rs.standard_normal([K, N]), rs.standard_normal([N])
    dw = paddle.to_tensor(w0) if given else None
    db = paddle.to_tensor(b0) if given else None
    ptr = dw.data_ptr() if given else None
    out_w, out_b = ops.fused_linear_param_grad_add(
        paddle.to_tensor(xn), paddle.to_tensor(yn), dw, db, True, True
    )
    assert out_w.dtype == out_b.dtype == paddle.float64  # MPTypeTrait<double> is double
    if given:
        assert out_w is dw and out_w.data_ptr() == ptr
    start_w, start_b = (w0, b0) if given else (0.0, 0.0)
    scale = np.abs(start_w) + np.abs(xn).T @ np.abs(yn)
    assert (np.abs(out_w.numpy() - (start_w + xn.T @ yn)) <= 1e-13 * (scale + 1)).all()
    np.testing.assert_allclose(out_b.numpy(), start_b + yn.sum(0), rtol=1e-12, atol=1e-12)


# M (reduction, 256-deep slices), K (rows of C: 96-row blocks, 6-row strips), N (columns of C:
# 1024-wide panels, 8-column strips); none a multiple of any block: every last slice, block,
# panel and strip is ragged (M=259: a 3-deep slice; K=97: a 1-row block; N=1030: a 6-wide
# panel, 513/203/1043: 1-deep slice, 11-row block = 6 + 5, 19-wide panel = 8 + 8 + 3).
@pytest.mark.parametrize("M,K,N", [(259, 97, 1030), (513, 203, 1043), (7, 5, 3)])
@pytest.mark.parametrize("given", [False, True], ids=["fresh", "in_place"])
@pytest.mark.parametrize("kernel", [None, "generic"], ids=["cpu_kernel", "generic_kernel"])
def test_float64_packing_edges(M, K, N, given, kernel):
    """fp64 GEMM strip packing at every ragged edge, against float64 numpy: each C entry is
    checked (an edge row or column lost or shifted in packing shows), in place or fresh, with
    the micro-kernel this CPU picks and with the portable one (PADDLE_MGRAD_CPU_FP64_KERNEL)."""
    with _env("PADDLE_MGRAD_CPU_FP64_KERNEL", kernel):
        _float64_packing_edges(M, K, N, given)


def _float64_packing_edges(M, K, N, given):
    rs = np.random.RandomState(M * K + N)
    xn = rs.uniform(0.5, 1.5, [M, K]) * rs.choice([-1.0, 1.0], [M, K])
    yn = rs.uniform(0.5, 1.5, [M, N]) * rs.choice([-1.0, 1.0], [M, N])
    w0 = rs.standard_normal([K, N])
    dw = paddle.to_tensor(w0) if given else None
    ptr = dw.data_ptr() if given else None
    out_w, _ = ops.fused_linear_param_grad_add(
        paddle.to_tensor(xn), paddle.to_tensor(yn), dw, None, False, False
    )
    assert out_w.dtype == paddle.float64 and list(out_w.shape) == [K, N]
    if given:
        assert out_w is dw and out_w.data_ptr() == ptr
    want = (w0 if given else 0.0) + xn.T @ yn
    bound = 1e-13 * (np.abs(xn).T @ np.abs(yn) + (np.abs(w0) if given else 0.0) + 1)
    err = np.abs(out_w.numpy() - want)
    bad = np.argwhere(err > bound)
    assert bad.size == 0, f"{len(bad)} wrong entries of C [{K}, {N}], first at {bad[:5].tolist()}"


@pytest.mark.parametrize("transpose_weight", [False, True])
def test_fused_linear_float64_matches_autograd(transpose_weight):
    """float64 parameters through the fused linear: x, weight and bias gradients equal plain
    autograd's in float64 (the bias gradient is summed in float64 too)."""
    from paddle_mgrad.linear import FusedLinearWithGradAdd

    rs = np.random.RandomState(1)
    xn = rs.standard_normal([3, 5, 7])
    wn = rs.standard_normal([11, 7] if transpose_weight else [7, 11]) * 1e3
    bn = rs.standard_normal([11])
    got = []
    for fused in (True, False):
        x = paddle.to_tensor(xn, stop_gradient=False)
        w = paddle.to_tensor(wn, stop_gradient=False)
        b = paddle.to_tensor(bn, stop_gradient=False)
        y = (
            FusedLinearWithGradAdd.apply(x, w, b, transpose_weight)
            if fused
            else paddle.matmul(x, w, transpose_y=transpose_weight) + b
        )
        (y * y).sum().backward()
        got.append((x.grad, w.grad, b.grad))
    for a, b in zip(*got):
        assert a.dtype == b.dtype == paddle.float64
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-9)


# ---------------------------------------------------------------- bf16/fp16 paths (10.4, 10.5)
def test_bf16_path_is_observable_and_forceable():
    info = ops.cpu_info()
    assert info["bf16_path"] == ("onednn-bf16" if info["native_bf16"] else "widen-sgemm")
    with _bf16_path("widen"):
        assert ops.cpu_info()["bf16_path"] == "widen-sgemm"
    with _bf16_path(" Native "):  # spaces and case as paddle_mgrad.env accepts them
        assert ops.cpu_info()["bf16_path"] == "onednn-bf16"
    with _bf16_path("bogus"):
        assert ops.cpu_info()["bf16_path"] == "invalid PADDLE_MGRAD_CPU_BF16"
        x = paddle.ones([4, 3]).astype("bfloat16")
        msg = (
            "PADDLE_MGRAD_CPU_BF16='bogus' is not valid; accepted: auto (default), native or widen"
        )
        with pytest.raises(EnvError) as e:
            ops.fused_linear_param_grad_add(x, x, None, None, True, False)
        assert str(e.value) == msg
        with pytest.raises(Exception, match=re.escape(msg)):  # the C++ op's own check
            ops.load().pmg_fused_wgrad_add(x, x, None, None, True, False)


@pytest.mark.parametrize(
    "dtype,path",
    [
        ("bfloat16", "widen"),
        pytest.param("bfloat16", "native", id=f"bfloat16-{NATIVE_ID}"),
        ("bfloat16", "auto"),
        ("float16", "auto"),
    ],
)
@pytest.mark.parametrize("M", [CHUNK_ROWS + 1, 2 * CHUNK_ROWS + 300])
@pytest.mark.parametrize("acc", ["float32", "same"])
def test_fresh_output_over_several_chunks(dtype, path, M, acc):
    """A fresh (None) accumulator filled from more than one widening chunk: only the first
    chunk may apply beta = 0, later chunks accumulate (a per-chunk beta loses all but the
    last chunk).  Positive data, so the lost chunks cannot cancel."""
    rs = np.random.RandomState(M)
    x, dy = _t(rs.uniform(0.5, 1.0, [M, 24]), dtype), _t(rs.uniform(0.5, 1.0, [M, 40]), dtype)
    mp = acc == "float32"
    with _bf16_path(path), _chunk_rows(CHUNK_ROWS):
        out_w, out_b = ops.fused_linear_param_grad_add(x, dy, None, None, mp, True)
    x2, y2 = _as64(x), _as64(dy)
    out_dtype = "float32" if mp else dtype
    _check_close(out_w, x2.T @ y2, x2.T @ y2, out_dtype)
    _check_close(out_b, y2.sum(0), y2.sum(0), out_dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_default_chunking_of_a_wide_output(dtype):
    """Without PADDLE_MGRAD_CPU_CHUNK_ROWS the op picks rows by a 64 MiB budget
    (rows * (K + N) * 4 bytes, at least 256): K + N = 65536 gives 256-row chunks, so 600
    rows are 3 equal chunks into a fresh accumulator, then accumulated onto it."""
    rs = np.random.RandomState(3)
    M, K, N = 600, 8, 65528
    x, dy = _t(rs.uniform(0.5, 1.0, [M, K]), dtype), _t(rs.uniform(0.5, 1.0, [M, N]), dtype)
    with _bf16_path("widen"), _chunk_rows(None):
        out_w, _ = ops.fused_linear_param_grad_add(x, dy, None, None, True, False)
        want = _as64(x).T @ _as64(dy)
        _check_close(out_w, want, want, "float32")
        ptr = out_w.data_ptr()
        ops.fused_linear_param_grad_add(x, dy, out_w, None, True, False)
    assert out_w.data_ptr() == ptr
    _check_close(out_w, 2 * want, 2 * want, "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_same_precision_weight_grad_around_the_scratch_budget(dtype):
    """multi_precision=False: dW is accumulated in fp32 and rounded once.  A K x N product
    over 64 MiB goes through a one-shot buffer, a smaller one through the thread's kept
    scratch; interleaved calls of both sizes, in place, each against float64."""
    rs = np.random.RandomState(5)
    shapes = [(3, 4096, 4100), (5, 24, 40), (3, 4096, 4100), (7, 40, 24)]  # 16.8M > 64 MiB/4
    for M, K, N in shapes:
        x, dy = _t(rs.uniform(0.5, 1.0, [M, K]), dtype), _t(rs.uniform(0.5, 1.0, [M, N]), dtype)
        dw = _t(rs.uniform(0.5, 1.0, [K, N]), dtype)
        start, ptr = _as64(dw), dw.data_ptr()
        with _bf16_path("widen"), _chunk_rows(None):
            out_w, _ = ops.fused_linear_param_grad_add(x, dy, dw, None, False, False)
        assert out_w is dw and out_w.data_ptr() == ptr
        prod = _as64(x).T @ _as64(dy)
        _check_close(out_w, start + prod, start + prod, dtype)


def test_kept_scratch_is_what_the_calling_thread_holds():
    """``pmg_cpu_thread_scratch_bytes`` (C ABI; what benchmarks/mem_widen_workspace.py reports
    as our kept buffers) counts the calling thread's kept buffers, page-rounded: nothing before
    a call that needs one or after an fp32 call; the widen workspace of ``rows * (K + N)``
    floats (rows forced: 100 rows as 2 chunks of 50); that plus the fp32 product of a
    same-precision weight gradient; and nothing of another thread's."""
    import ctypes
    import threading

    from paddle_mgrad.ops import _build

    kept = ctypes.CDLL(_build.library_path(ops.load())).pmg_cpu_thread_scratch_bytes
    kept.restype = ctypes.c_uint64
    page = 4096

    def pages(floats):
        return -(-floats * 4 // page) * page

    M, K, N, rows = 100, 24, 40, 50
    x32, dy32 = paddle.rand([M, K]), paddle.rand([M, N])
    x, dy = x32.astype("bfloat16"), dy32.astype("bfloat16")
    seen = {}

    def calls():
        seen["fresh"] = kept()
        ops.fused_linear_param_grad_add(x32, dy32, None, None, True, False)
        seen["fp32"] = kept()
        with _bf16_path("widen"), _chunk_rows(rows):
            ops.fused_linear_param_grad_add(x, dy, None, None, True, False)
            seen["widen"] = kept()
            ops.fused_linear_param_grad_add(x, dy, None, None, False, False)
            seen["same precision"] = kept()

    for _ in range(2):  # the second thread starts from nothing again
        t = threading.Thread(target=calls)
        t.start()
        t.join()
        assert seen == {
            "fresh": 0,
            "fp32": 0,
            "widen": pages(rows * (K + N)),
            "same precision": pages(rows * (K + N)) + pages(K * N),
        }, seen


def _every_half(dtype):
    """All 65536 bf16/fp16 bit patterns (zeros, subnormals, normals, infs, NaNs) as float32."""
    bits = np.arange(65536, dtype=np.uint32)
    if dtype == "float16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float32)
    return (bits << 16).view(np.float32)


def _round_half(f32, dtype):
    """float32 -> bf16/fp16 round-to-nearest-even (numpy's for fp16; by bits for bf16), as
    float32 values.  Overflow rounds to inf; NaN stays NaN."""
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return f32.astype(np.float16).astype(np.float32)
    u = f32.view(np.uint32).astype(np.uint64)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(f32), np.float32(np.nan), r)


def _same_values(got, want):
    nan = np.isnan(want)
    bad = (np.isnan(got) != nan) | (~nan & (got != want))
    return int(bad.sum()), [(float(want[i]), float(got[i])) for i in np.nonzero(bad)[0][:4]]


@pytest.mark.parametrize(
    "dtype,path",
    [
        ("float16", "auto"),
        ("bfloat16", "widen"),
        pytest.param("bfloat16", "native", id=f"bfloat16-{NATIVE_ID}"),
    ],
)
def test_every_half_bit_pattern_widens_and_rounds_exactly(dtype, path):
    """Every bf16/fp16 bit pattern is read exactly (dW through the widening or native GEMM,
    db through the scalar loads: fp16's F16C and portable conversions both run), and a
    same-precision result (multi_precision=False) is the fp32 sum rounded once to nearest
    even: sums of random pairs of all patterns (ties, overflow to inf, subnormals, NaN).
    On the native path the subnormal patterns make the op widen (native bf16 hardware reads
    them as zero): exact either way."""
    v = _every_half(dtype)
    row = paddle.to_tensor(v.reshape(1, -1)).astype(dtype)
    one = paddle.ones([1, 1], dtype=dtype)
    with _bf16_path(path):
        dw, _ = ops.fused_linear_param_grad_add(row, one, None, None, True, False)  # x^T . 1
        _, db = ops.fused_linear_param_grad_add(one, row, None, None, True, True)  # sum_m dy
    for got in (dw, db):
        assert _name(got.dtype) == "float32"
        assert _same_values(got.numpy().reshape(-1), v) == (0, [])

    # Rounding once: db = the fp32 sum of two rows (random pairs of all patterns), dW = exact
    # fp32 products of an outer product whose factors (random patterns plus powers of two and
    # small odd multiples) land on ties, the subnormal range and the overflow edge.
    rs = np.random.RandomState(0)
    a, b = v, v[rs.permutation(v.size)]
    with np.errstate(over="ignore", invalid="ignore"):
        want_db = _round_half(a + b, dtype)
    dy = paddle.to_tensor(np.stack([a, b])).astype(dtype)
    with _bf16_path(path):
        _, db = ops.fused_linear_param_grad_add(
            paddle.ones([2, 1], dtype=dtype), dy, None, None, False, True
        )
    crafted = np.array(
        [s * m * 2.0**e for s in (1, -1) for m in (1, 3, 19, 151, 431) for e in range(-24, 16, 3)],
        np.float32,
    )
    crafted = crafted[np.isfinite(_round_half(crafted, dtype))]
    crafted = crafted[_round_half(crafted, dtype) == crafted]  # exactly representable
    finite = v[np.isfinite(v)]
    f = np.concatenate([crafted, rs.choice(finite, 512 - crafted.size)])
    g = np.concatenate([crafted[::3], rs.choice(finite, 128 - crafted[::3].size)])
    with np.errstate(over="ignore", invalid="ignore"):
        want_dw = _round_half(f[:, None] * g[None, :], dtype).reshape(-1)  # exact in fp32
    with _bf16_path(path):
        dw, _ = ops.fused_linear_param_grad_add(
            paddle.to_tensor(f[None]).astype(dtype),
            paddle.to_tensor(g[None]).astype(dtype),
            None,
            None,
            False,
            False,
        )
    for got, want in ((db, want_db), (dw, want_dw)):
        assert _name(got.dtype) == dtype
        assert _same_values(got.astype("float32").numpy().reshape(-1), want) == (0, [])


CHUNK_ROWS_BAD = [
    "0",
    "-3",
    "12x",
    "abc",
    "+5",
    "1e3",
    "1 2",
    "16777217",
    "99999999999999999999",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551616",
    "4611686018427387904",
]


@pytest.mark.parametrize("value", CHUNK_ROWS_BAD)
def test_bad_chunk_rows_env_is_a_clear_error(value):
    """A bad PADDLE_MGRAD_CPU_CHUNK_ROWS set after import: the wrapper raises paddle_mgrad.env's
    EnvError, the C++ op (called raw) fails with the same message -- no crash, nothing written."""
    msg = (
        f"PADDLE_MGRAD_CPU_CHUNK_ROWS={value!r} is not valid; accepted: an integer from 1 to "
        f"{env.MAX_CHUNK_ROWS}"
    )
    for dtype in ("bfloat16", "float16"):
        x = paddle.ones([4, 3]).astype(dtype)
        mg = paddle.full([3, 3], 7.0)
        with _bf16_path("widen"), _chunk_rows(value):
            with pytest.raises(EnvError) as e:
                ops.fused_linear_param_grad_add(x, x, mg, None, True, False)
            assert str(e.value) == msg
            with pytest.raises(Exception, match=re.escape(msg)):
                ops.load().pmg_fused_wgrad_add(x, x, mg, None, True, False)
        np.testing.assert_array_equal(mg.numpy(), np.full([3, 3], 7.0))


@pytest.mark.parametrize("value", ["", " ", "1", " 12 ", "007", str(env.MAX_CHUNK_ROWS)])
def test_valid_chunk_rows_env(value):
    """Empty is the default (as unset); digits with surrounding spaces; the largest accepted
    value (more rows than the call has: one chunk)."""
    assert env.get("PADDLE_MGRAD_CPU_CHUNK_ROWS", {"PADDLE_MGRAD_CPU_CHUNK_ROWS": value}) == (
        int(value) if value.strip() else None
    )
    for dtype in ("bfloat16", "float16"):
        x = paddle.ones([40, 3]).astype(dtype)
        with _bf16_path("widen"), _chunk_rows(value):
            w, _ = ops.fused_linear_param_grad_add(x, x, None, None, True, False)
            np.testing.assert_array_equal(w.numpy(), np.full([3, 3], 40.0))
            w, _ = ops.load().pmg_fused_wgrad_add(x, x, None, None, True, False)
            np.testing.assert_array_equal(w.numpy(), np.full([3, 3], 40.0))


CHUNK_ROWS_PROBE = """
    import os, sys, zlib
    import paddle
    from paddle_mgrad import ops
    module = ops.load()
    x = paddle.ones([600, 8]).astype("float16")
    os.environ["PADDLE_MGRAD_CPU_CHUNK_ROWS"] = sys.argv[1]  # after import: only the op checks
    for call in (module.pmg_fused_wgrad_add, ops.fused_linear_param_grad_add):
        try:
            call(x, x, None, None, True, False)
            print("NO ERROR")
        except Exception as e:
            print("ERROR", type(e).__name__, " ".join(str(e).split())[:800])
    print("ALIVE")
"""


@pytest.mark.probe
@pytest.mark.parametrize(
    "value", ["99999999999999999999", "9223372036854775807", "4611686018427387904"]
)
def test_chunk_rows_near_2_63_does_not_kill_the_process(value):
    """Crash probe: values near 2^63 would overflow the widen path's chunk count to 0, and the
    division by it would raise SIGFPE.  In a subprocess: no signal, a clear error from both the
    raw op and the wrapper."""
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHUNK_ROWS_PROBE), value],
        capture_output=True,
        text=True,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "PADDLE_MGRAD_CPU_CHUNK_ROWS"},
    )
    assert r.returncode >= 0, f"killed by signal {-r.returncode}: {r.stderr[-2000:]}"
    assert r.returncode == 0 and "ALIVE" in r.stdout, r.stdout + r.stderr[-3000:]
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("ERROR")]
    assert len(errors) == 2 and "NO ERROR" not in r.stdout, r.stdout
    for line in errors:
        assert f"PADDLE_MGRAD_CPU_CHUNK_ROWS='{value}' is not valid" in line, line
    assert errors[1].startswith("ERROR EnvError")


@pytest.mark.parametrize("value", ["bogus", "avx2", "1"])
def test_bad_fp64_kernel_env_is_a_clear_error(value):
    """PADDLE_MGRAD_CPU_FP64_KERNEL=garbage was ignored silently; now EnvError (wrapper) and the
    same message from the C++ op, before anything is written."""
    msg = (
        f"PADDLE_MGRAD_CPU_FP64_KERNEL={value!r} is not valid; accepted: auto (default) or generic"
    )
    x = paddle.ones([4, 3], "float64")
    mg = paddle.full([3, 3], 7.0, "float64")
    with _env("PADDLE_MGRAD_CPU_FP64_KERNEL", value):
        with pytest.raises(EnvError) as e:
            ops.fused_linear_param_grad_add(x, x, mg, None, True, False)
        assert str(e.value) == msg
        with pytest.raises(Exception, match=re.escape(msg)):
            ops.load().pmg_fused_wgrad_add(x, x, mg, None, True, False)
    np.testing.assert_array_equal(mg.numpy(), np.full([3, 3], 7.0))
    with _env("PADDLE_MGRAD_CPU_FP64_KERNEL", " Generic "):
        ops.fused_linear_param_grad_add(x, x, mg, None, True, False)
    np.testing.assert_array_equal(mg.numpy(), np.full([3, 3], 11.0))


# ---------------------------------------------------------------- the C ABI (Paddle-free)
def test_c_api_zero_size_null_pointers_and_float64(capi):
    """pmg_wgrad_cpu_c: zero-element inputs may be null (the core reads only what it needs),
    a null pointer that would be read is a clear error, fp64 (code 3) accumulates in fp64,
    and the accumulator rule is enforced by the core's one check."""
    import ctypes

    core = capi
    err = ctypes.create_string_buffer(512)

    def call(x, dy, in_t, M, K, N, dw, dw_t, db, db_t, beta=1.0):
        ptr = lambda a: None if a is None else a.ctypes.data  # noqa: E731
        return core.lib.pmg_wgrad_cpu_c(
            ptr(x), ptr(dy), in_t, M, K, N, ptr(dw), dw_t, beta, ptr(db), db_t, beta, err, len(err)
        )

    dy = np.ones([4, 3], "float32")
    db = np.full([3], 2.0, "float32")
    assert call(None, dy, 0, 4, 0, 3, None, 0, db, 0) == 0, err.value  # K = 0: x never read
    np.testing.assert_array_equal(db, np.full([3], 6.0))
    guard = np.full([2], 7.0, "float32")  # K = 0 with a non-null dW: nothing written or read
    assert call(None, dy, 0, 4, 0, 3, guard, 0, None, 0) == 0, err.value
    np.testing.assert_array_equal(guard, [7.0, 7.0])
    assert call(None, None, 0, 0, 5, 3, np.ones([5, 3], "float32"), 0, db, 0) == 0, err.value
    assert call(None, dy, 0, 4, 5, 3, np.ones([5, 3], "float32"), 0, None, 0) == 1
    assert b"null input pointer x" in err.value
    rs = np.random.RandomState(0)
    x64, y64, w64 = rs.standard_normal([70, 13]), rs.standard_normal([70, 9]), np.ones([13, 9])
    b64 = np.ones([9])
    assert call(x64, y64, 3, 70, 13, 9, w64, 3, b64, 3) == 0, err.value
    np.testing.assert_allclose(w64, 1 + x64.T @ y64, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(b64, 1 + y64.sum(0), rtol=1e-13, atol=1e-13)
    assert call(x64, y64, 3, 70, 13, 9, np.ones([13, 9], "float32"), 0, None, 0) == 1
    assert b"dweight is float32; it must be float64" in err.value
    assert call(dy, dy, 0, 4, 3, 3, np.ones([3, 3]), 3, None, 0) == 1
    assert b"dweight is float64; it must be float32" in err.value


# ---------------------------------------------------------------- bf16: native hw vs exact (15)
def _fallbacks():
    return ops.cpu_info()["bf16_exact_fallbacks"]


def _bf16_tensor(values):
    """A bf16 tensor holding exactly these float32 values (each must be a bf16 value)."""
    v = np.asarray(values, np.float32)
    assert np.array_equal(
        _round_half(v.reshape(-1), "bfloat16").reshape(v.shape), v, equal_nan=True
    )
    return paddle.to_tensor(v).astype("bfloat16")


@pytest.mark.parametrize("path", ["widen", pytest.param("native", id=NATIVE_ID), "auto"])
def test_bf16_products_near_underflow_are_ieee_exact(path):
    """Native bf16 hardware (avx512_bf16 / AMX) reads subnormal inputs as zero and flushes
    subnormal fp32 results -- single products and partial sums -- to zero.  The op's semantics
    are IEEE fp32 with gradual underflow on every path: products 2^a * 2^b * m (normal bf16
    factors) from 2^-160 (rounds to 0) through the subnormal range to 2^-80, and a two-row
    cancellation landing exactly on 2^(a+b-14) for a + b from -116 to -108 (2^-127 is subnormal:
    the exactness check's boundary, a + b >= -112 is safe), all equal numpy's float32."""
    a = np.arange(-80, -39)
    m = np.array([1.0, 1.0078125, 1.5, 1.9921875], np.float32)  # 8-bit mantissas
    xf = (m[:, None] * np.exp2(a)[None, :].astype(np.float32)).reshape(-1)
    g = np.exp2(np.arange(-80, -39)).astype(np.float32)
    before = _fallbacks()
    with _bf16_path(path):
        dw, _ = ops.fused_linear_param_grad_add(
            _bf16_tensor(xf[None]), _bf16_tensor(g[None]), None, None, True, False
        )
    want = (xf.astype(np.float64)[:, None] * g.astype(np.float64)[None, :]).astype(np.float32)
    assert (want == 0).any() and ((want != 0) & (np.abs(want) < 2.0**-126)).any()
    assert _same_values(dw.numpy().reshape(-1), want.reshape(-1)) == (0, [])

    # x1*y1 + x2*y2 = 2^(a+b) * ((1+2^-7)^2 - (1+2^-6)) = 2^(a+b-14): exact in fp32
    for s in range(-116, -107):
        ea, eb = s // 2, s - s // 2
        x = _bf16_tensor([[2.0**ea * 1.0078125], [2.0**ea]])
        y = _bf16_tensor([[2.0**eb * 1.0078125], [-(2.0**eb) * 1.015625]])
        # and a subnormal product added onto a subnormal main_grad (beta = 1)
        x1, y1 = _bf16_tensor([[2.0**ea]]), _bf16_tensor([[2.0 ** (eb - 14)]])
        with _bf16_path(path):
            dw, _ = ops.fused_linear_param_grad_add(x, y, None, None, True, False)
            mg = paddle.full([1, 1], 2.0**-149)
            ops.fused_linear_param_grad_add(x1, y1, mg, None, True, False)
        assert dw.numpy()[0, 0] == np.float32(2.0 ** (s - 14)), (s, dw.numpy())
        assert mg.numpy()[0, 0] == np.float32(2.0 ** (s - 14) + 2.0**-149), (s, mg.numpy())
    took_onednn = path == "native" or (path == "auto" and CPU["native_bf16"])
    # on the oneDNN path: the first call, the 4 cancellations with a + b < -112 and all 9
    # single subnormal products were widened
    assert _fallbacks() - before == (14 if took_onednn else 0)


def test_native_bf16_path_runs_its_gemm_on_every_safe_pattern():
    """The exactness check widens only what native hardware could flush: every bf16 pattern with
    an exponent field >= 15 (normals, infs, NaNs) and the zeros, times 1.0 (field 127: 15 + 127 =
    142, the smallest sum that is safe), go through oneDNN's bf16 GEMM -- no fallback counted --
    and come back exact.  One value with field 14 (still a normal product, but no longer
    provably safe) sends the call to the widen path, counted, and exact too."""
    bits = np.arange(65536, dtype=np.uint32)
    field = (bits >> 7) & 0xFF
    keep = (field >= 15) | ((bits & 0x7FFF) == 0)
    v = (bits[keep] << 16).view(np.float32)
    one = paddle.ones([1, 1], dtype="bfloat16")
    with _bf16_path("native"):
        before = _fallbacks()
        dw, _ = ops.fused_linear_param_grad_add(
            paddle.to_tensor(v[None]).astype("bfloat16"), one, None, None, True, False
        )
        assert _fallbacks() == before, "the safe patterns did not run the oneDNN bf16 GEMM"
        assert _same_values(dw.numpy().reshape(-1), v) == (0, [])
        v14 = np.append(v, np.float32(2.0 ** (14 - 127)))
        dw, _ = ops.fused_linear_param_grad_add(
            paddle.to_tensor(v14[None]).astype("bfloat16"), one, None, None, True, False
        )
        assert _fallbacks() == before + 1
        assert _same_values(dw.numpy().reshape(-1), v14) == (0, [])


@pytest.mark.parametrize("kernel", [0, 1, 2], ids=["portable", "avx2", "avx512bw"])
def test_exactness_pass_kernels_find_the_smallest_nonzero_magnitude(kernel, capi):
    """The pass behind the check, each of its kernels (an AVX2-only CPU runs the AVX2 one, a CPU
    without AVX2 the portable one) through the test library's C ABI (the same
    wgrad_bf16_scan.cc): the smallest nonzero |bf16| among random values with planted small ones
    at ragged positions (vector tails, thread splits of > 2^18 values), signed zeros ignored,
    NaN/inf patterns ordered as their bits."""
    import ctypes

    f = capi.lib.pmg_bf16_min_nonzero_bits_c
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    f.restype = ctypes.c_int
    have = f(np.zeros(1, np.uint16).ctypes.data, 1, kernel) != -1
    flags = set(CPU["isa"].split())
    assert have == {0: True, 1: "avx2" in flags, 2: "avx512bw" in flags}[kernel], CPU["isa"]
    if not have:  # refused, as it must be on this CPU (the kernels it has are tested)
        return
    rs = np.random.RandomState(kernel)

    def want(a):
        mags = a & 0x7FFF
        nz = mags[mags != 0]
        return int(nz.min()) if nz.size else 0x10000

    for n in (1, 31, 32, 63, 64, 65, 1000, (1 << 18) + 1, (1 << 20) + 37):
        a = (rs.randint(0x3F00, 0x4100, n) | (rs.randint(0, 2, n) << 15)).astype(np.uint16)
        assert f(a.ctypes.data, n, kernel) == want(a), n
        edges = {0, n - 1, n // 2, max(0, n - 33)}
        for nt in range(1, 17):  # the ends of each thread's share (32-value aligned), any team
            per = ((n + nt - 1) // nt + 31) // 32 * 32
            edges |= {p for p in (per - 1, per) if p < n}
        for pos in sorted(edges):
            for v in (
                (0x0001, 0x8001, 0x0080, 0x7F80, 0xFFC0, 0x0000, 0x8000)
                if n < 1 << 18
                else (0x8001, 0x0080)
            ):
                b = a.copy()
                b[pos] = v
                assert f(b.ctypes.data, n, kernel) == want(b), (n, pos, hex(v))
    z = np.array([0x8000, 0x0000] * 300, np.uint16)
    assert f(z.ctypes.data, z.size, kernel) == 0x10000  # all (signed) zeros


# The bf16/fp16 tests of this file, run again with oneDNN capped at AVX2 (what an AVX2-only CPU
# such as a Zen 3 runs): on a native-bf16 CPU the main run covers the hardware path, this one
# the widen path under auto and oneDNN's reference kernel under native.
ISA_CAPPED_TESTS = [
    "test_matches_float64_reference",
    "test_bf16_path_is_observable_and_forceable",
    "test_fresh_output_over_several_chunks",
    "test_default_chunking_of_a_wide_output",
    "test_same_precision_weight_grad_around_the_scratch_budget",
    "test_every_half_bit_pattern_widens_and_rounds_exactly",
    "test_bf16_products_near_underflow_are_ieee_exact",
    "test_native_bf16_path_runs_its_gemm_on_every_safe_pattern",
    "test_exactness_pass_kernels_find_the_smallest_nonzero_magnitude",
    # (not test_portable_cpu_path_without_onednn: a build without oneDNN never reads
    # ONEDNN_MAX_CPU_ISA, so under the cap it was the same build and run again, ~10 s)
]


@pytest.mark.probe
@pytest.mark.heavy
def test_bf16_and_fp16_paths_with_onednn_capped_at_avx2():
    """ONEDNN_MAX_CPU_ISA=AVX2 in a subprocess: the op reports no native bf16 (oneDNN will not
    use it), auto picks the widen path, and the bf16/fp16 tests above pass there as well."""
    env_ = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    here = os.path.abspath(__file__)
    code = (
        "import zlib, paddle, json\nfrom paddle_mgrad import ops\n"
        "print('CPUINFO', json.dumps(ops.cpu_info()))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env_, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.split("CPUINFO", 1)[1])
    assert info["native_bf16"] is False and info["bf16_path"] == "widen-sgemm", info
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-v",
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore",
            *[f"{here}::{t}" for t in ISA_CAPPED_TESTS],
        ],
        capture_output=True,
        text=True,
        env=env_,
        timeout=1200,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(here))),
    )
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert re.search(r"\d+ passed", r.stdout) and " failed" not in r.stdout, tail
    # the tests that forced native there say they ran oneDNN's reference kernel
    assert "[bfloat16-native-on-onednn-reference-kernel] PASSED" in r.stdout, tail


# ---------------------------------------------------------------- accumulators, backends (15)
@pytest.fixture(params=["cpp", "python"])
def backend(request):
    """Both backends of the op: our C++ op, and the pure-Paddle reference (the tier forced)."""
    if request.param == "python":
        with ops.override(tier="python"):
            yield request.param
    else:
        assert ops.load() is not None, ops.fallback_reason()
        yield request.param


@pytest.mark.parametrize(
    "dtype,mp", [("float32", True), ("bfloat16", True), ("bfloat16", False), ("float64", True)]
)
def test_strided_accumulators_are_written_through(backend, dtype, mp):
    """A dbias / dweight that is a strided view into a flat buffer (``store[::2]``, a column
    slice, a transpose) is updated in place through the view: the base buffer holds
    start + the float64 gradient at the view's positions and is untouched elsewhere; the
    objects returned are the caller's views (same data_ptr).  (Paddle's custom-op runner hands
    the C++ op a contiguous temporary: without the write-back the gradient was lost.)"""
    rs = np.random.RandomState(11)
    M, K, N = 9, 5, 3
    x, dy = _t(rs.standard_normal([M, K]), dtype), _t(rs.standard_normal([M, N]), dtype)
    acc = _mp(dtype) if mp else dtype
    b_store = _t(rs.standard_normal([2 * N]), acc)
    w_store = _t(rs.standard_normal([K, 2 * N]), acc)
    wt_store = _t(rs.standard_normal([N, K]), acc)
    x2, y2 = _as64(x), _as64(dy)
    x_store = _t(rs.standard_normal([M, 2 * K]), dtype)
    xs = x_store[:, ::2]  # a strided input is read, and left the caller's view
    x_ptr = xs.data_ptr()
    for dweight_of in (lambda: w_store[:, ::2], lambda: wt_store.transpose([1, 0])):
        b0, w0, wt0 = _as64(b_store), _as64(w_store), _as64(wt_store)
        dbias, dweight = b_store[::2], dweight_of()
        assert not dbias.is_contiguous() and not dweight.is_contiguous()
        pw, pb = dweight.data_ptr(), dbias.data_ptr()
        out_w, out_b = ops.fused_linear_param_grad_add(x, dy, dweight, dbias, mp, True)
        assert out_w is dweight and out_b is dbias
        assert dweight.data_ptr() == pw and dbias.data_ptr() == pb
        want_b = b0.copy()
        want_b[::2] += y2.sum(0)
        _check_close(b_store, want_b, np.abs(want_b) + np.abs(y2).sum(0).repeat(2), acc)
        assert np.array_equal(_as64(b_store)[1::2], b0[1::2])
        scale = np.abs(x2).T @ np.abs(y2)
        if w_store.data_ptr() <= pw < w_store.data_ptr() + 4 * K * 2 * N:
            want = w0.copy()
            want[:, ::2] += x2.T @ y2
            _check_close(w_store, want, np.abs(want) + scale.repeat(2, axis=1), acc)
            assert np.array_equal(_as64(w_store)[:, 1::2], w0[:, 1::2])
        else:
            want = wt0 + (x2.T @ y2).T
            _check_close(wt_store, want, np.abs(want) + scale.T, acc)
    mg = paddle.zeros([K, N], _mp(dtype))
    ops.fused_linear_param_grad_add(xs, dy, mg, None, True, False)
    _check_close(mg, _as64(xs).T @ y2, np.abs(_as64(xs)).T @ np.abs(y2), _mp(dtype))
    assert not xs.is_contiguous() and xs.data_ptr() == x_ptr


def test_fused_nn_linear_with_main_grads_viewing_a_flat_buffer(backend):
    """nn.Linear with paddle_mgrad.enable(fused_linear=True) whose weight.main_grad is a strided
    view and bias.main_grad a strided view of ONE flat fp32 gradient buffer (as a bucketed
    optimizer keeps them): two micro-steps land in the buffer, against float64; the gaps
    between the views stay 0."""
    import paddle_mgrad

    rs = np.random.RandomState(5)
    K, N = 6, 4
    lin = paddle.nn.Linear(K, N)
    flat = paddle.zeros([K * 2 * N + 2 * N])
    lin.weight.main_grad = flat[: K * 2 * N].reshape([K, 2 * N])[:, 1::2]
    lin.bias.main_grad = flat[K * 2 * N :][::2]
    views = (lin.weight.main_grad, lin.bias.main_grad)
    assert not views[0].is_contiguous() and not views[1].is_contiguous()
    xs = [rs.standard_normal([3, 7, K]).astype("float32") for _ in range(2)]
    paddle_mgrad.enable(fused_linear=True)
    try:
        for xn in xs:
            y = lin(paddle.to_tensor(xn))
            (y * y).sum().backward()
    finally:
        paddle_mgrad.disable()
    assert lin.weight.main_grad is views[0] and lin.bias.main_grad is views[1]
    w, b = lin.weight.numpy().astype("f8"), lin.bias.numpy().astype("f8")
    gw, gb = np.zeros([K, N]), np.zeros([N])
    for xn in xs:
        x2 = xn.reshape(-1, K).astype("f8")
        dy = 2 * (x2 @ w + b)
        gw += x2.T @ dy
        gb += dy.sum(0)
    got = flat.numpy()
    gw_flat = got[: K * 2 * N].reshape(K, 2 * N)
    np.testing.assert_allclose(gw_flat[:, 1::2], gw, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[K * 2 * N :][::2], gb, rtol=1e-5, atol=1e-4)
    assert not gw_flat[:, ::2].any() and not got[K * 2 * N :][1::2].any()


def _bad_dbias_cases(N):
    return [
        ("shape", lambda: paddle.zeros([N + 1]), "dbias must be [N]"),
        ("dtype", lambda: paddle.zeros([N], "float64"), "dbias must be float32"),
        ("int dtype", lambda: paddle.zeros([N], "int32"), "dbias must be float32"),
        ("numpy", lambda: np.zeros([N], "float32"), "dbias must be a paddle Tensor or None"),
        ("list", lambda: [0.0] * N, "dbias must be a paddle Tensor or None"),
        ("2-D", lambda: paddle.zeros([1, N]), "dbias must be [N]"),
    ]


@pytest.mark.parametrize("case", range(6), ids=[c[0] for c in _bad_dbias_cases(3)])
def test_bad_dbias_leaves_dweight_bit_identical(backend, case):
    """Every input is checked before anything is written: a bad dbias raises FusedLinearError
    and dweight keeps every bit (both backends, and the reference when called directly)."""
    name, make, needle = _bad_dbias_cases(3)[case]
    rs = np.random.RandomState(2)
    x, dy = paddle.randn([4, 5]), paddle.randn([4, 3])
    dweight = paddle.to_tensor(rs.standard_normal([5, 3]).astype("float32"))
    bits = dweight.numpy().view(np.uint32).copy()
    calls = [ops.fused_linear_param_grad_add]
    if backend == "python":
        calls.append(_reference.fused_linear_param_grad_add)
    for call in calls:
        with pytest.raises(FusedLinearError, match=re.escape(needle)):
            call(x, dy, dweight, make(), True, True)
        assert np.array_equal(dweight.numpy().view(np.uint32), bits), (name, call)


@pytest.mark.parametrize("value", ["no", "yes", "", 2, -1, 0.0, 1.0, None, [True]])
@pytest.mark.parametrize("which", ["multi_precision", "has_bias"])
def test_flags_must_be_bool(backend, which, value):
    """multi_precision / has_bias take bools (and 0/1 ints, as Paddle's op): the string "no"
    counted as True before."""
    x = paddle.ones([4, 3]).astype("bfloat16")
    dw = paddle.zeros([3, 3])
    flags = {"multi_precision": True, "has_bias": True, which: value}
    with pytest.raises(FusedLinearError, match=f"{which} must be a bool"):
        ops.fused_linear_param_grad_add(x, x, dw, None, flags["multi_precision"], flags["has_bias"])
    assert not dw.numpy().any()


@pytest.mark.parametrize("value", [True, False, 1, 0, np.bool_(True), np.int64(0)])
def test_flags_accept_bools_and_0_1(backend, value):
    x = paddle.ones([4, 3]).astype("bfloat16")
    w, b = ops.fused_linear_param_grad_add(x, x, None, None, value, value)
    assert _name(w.dtype) == ("float32" if value else "bfloat16")
    assert (b is not None) == bool(value)
    np.testing.assert_array_equal(w.astype("float32").numpy(), np.full([3, 3], 4.0))


# ---------------------------------------------------------------- places (15)
def test_tensors_on_other_places_are_refused_before_anything_is_written(backend):
    """dout / dweight / dbias on another device than x: FusedLinearError naming both places
    (faked: this machine has no second device), nothing written."""
    x, dy = paddle.randn([4, 5]), paddle.randn([4, 3])
    dw, db = paddle.ones([5, 3]), paddle.ones([3])
    for name, t in (("dout", dy), ("dweight", dw), ("dbias", db)):
        elsewhere = ops.override(place=lambda u, t=t: "Place(gpu:1)" if u is t else str(u.place))
        with elsewhere, pytest.raises(
            FusedLinearError,
            match=re.escape(f"{name} must be on the same device as x (Place(cpu) vs Place(gpu:1))"),
        ):
            ops.fused_linear_param_grad_add(x, dy, dw, db, True, True)
        assert (dw.numpy() == 1).all() and (db.numpy() == 1).all()


def test_xpu_and_custom_device_tensors_take_the_reference():
    """A tensor on neither the CPU nor a GPU (XPU, custom device; faked) never reaches the C++ op
    (it died there with "unsupported place"): the pure-Paddle reference computes it."""
    import types

    module = ops.load()
    assert module is not None
    x, dy, x2, y2 = paddle.randn([6, 4]), paddle.randn([6, 3]), None, None
    x2, y2 = x.numpy().astype("f8"), dy.numpy().astype("f8")
    mg, mb = paddle.ones([4, 3]), paddle.ones([3])
    no_op = types.SimpleNamespace(
        pmg_fused_wgrad_add=lambda *a: pytest.fail("C++ op called for a non-CPU place")
    )
    with ops.override(place="Place(xpu:0)"), loader.settled(module=no_op):
        assert dispatch.tier_for(x, None, None, True, True, dout=dy) == "python"
        ops.fused_linear_param_grad_add(x, dy, mg, mb, True, True)
    np.testing.assert_allclose(mg.numpy(), 1 + x2.T @ y2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mb.numpy(), 1 + y2.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,K,N", ZERO_SHAPES + [(3, 2, 4)])
def test_reference_allocates_on_the_inputs_place(monkeypatch, M, K, N):
    """The reference's fresh / zero results are created on x's place, never on Paddle's default
    device (GPU zeros for CPU inputs in a CUDA build): faked by making the default place
    unusable."""
    import paddle.tensor.creation as creation

    def default_place():
        raise AssertionError("allocated on Paddle's default place")

    x, dy = paddle.ones([M, K]), paddle.ones([M, N])
    monkeypatch.setattr(creation, "_current_expected_place", default_place)
    dw, db = _reference.fused_linear_param_grad_add(x, dy, None, None, True, True)
    assert str(dw.place) == str(db.place) == str(x.place)
    np.testing.assert_array_equal(dw.numpy(), np.full([K, N], float(M)))
    np.testing.assert_array_equal(db.numpy(), np.full([N], float(M)))


@pytest.fixture
def fake_paddle_fused_gpu(monkeypatch):
    """Every tensor is on ``Place(gpu:0)`` and the GPU tier is Paddle's fused op, faked on the
    CPU like its kernel: M = x.numel() / K (K = 0 divides by zero: SIGFPE in the real one)."""
    ops.load()
    calls = []

    def fake_fused(x, dout, dweight, dbias, multi_precision, has_bias):
        calls.append([list(x.shape), list(dout.shape)])
        K = x.shape[-1]
        M = int(np.prod(x.shape)) // K  # ZeroDivisionError where the kernel has SIGFPE
        if M == 0 or dout.shape[-1] == 0:
            raise AssertionError("zero-size GEMM handed to Paddle's kernel")
        g = paddle.matmul(x.astype("float32"), dout.astype("float32"), transpose_x=True)
        dw = g if dweight is None else dweight + g
        db = dout.astype("float32").sum(0)
        db = (db if dbias is None else dbias + db) if has_bias else None
        return dw, db

    from paddle import _C_ops

    monkeypatch.setattr(_C_ops, "fused_linear_param_grad_add", fake_fused, raising=False)
    with ops.override(place="Place(gpu:0)"), loader.settled(gpu="paddle-fused"):
        yield calls


@pytest.mark.parametrize("M,K,N", ZERO_SHAPES)
@pytest.mark.parametrize("given", [False, True])
def test_zero_size_never_reaches_paddles_gpu_kernel(fake_paddle_fused_gpu, M, K, N, given):
    """K = 0, N = 0 or M = 0 (an MoE expert that got no tokens) on the paddle-fused GPU tier go
    to the reference: Paddle's kernel is never called, results as Paddle's semantics say."""
    x, dy = paddle.ones([M, K]), paddle.ones([M, N])
    dw = paddle.full([K, N], 2.0) if given else None
    db = paddle.full([N], 3.0) if given else None
    assert dispatch.tier_for(x, dw, db, True, True, dout=dy) == "python"
    out_w, out_b = ops.fused_linear_param_grad_add(x, dy, dw, db, True, True)
    assert fake_paddle_fused_gpu == []
    np.testing.assert_array_equal(out_w.numpy(), np.full([K, N], (2.0 if given else 0.0) + M))
    np.testing.assert_array_equal(out_b.numpy(), np.full([N], (3.0 if given else 0.0) + M))
    # a non-empty call still goes to Paddle's op (the fake is live)
    ops.fused_linear_param_grad_add(
        paddle.ones([2, 3]), paddle.ones([2, 4]), None, None, True, True
    )
    assert fake_paddle_fused_gpu == [[[2, 3], [2, 4]]]


# ---------------------------------------------------------------- threads
def test_four_threads_calling_the_op_get_right_answers():
    """4 Python threads, each its own inputs and accumulators, every dtype and bf16 path
    (per-thread workspaces in the C++ op): every result equals float64."""
    import threading

    wrong, errors = [], []

    def work(seed):
        rs = np.random.RandomState(seed)
        try:
            for i in range(24):
                dtype = DTYPES[i % 4]
                M, K, N = rs.randint(1, 300), rs.randint(1, 40), rs.randint(1, 40)
                x = _t(rs.standard_normal([M, K]), dtype)
                dy = _t(rs.standard_normal([M, N]), dtype)
                mg = paddle.zeros([K, N], _mp(dtype))
                ops.fused_linear_param_grad_add(x, dy, mg, None, True, False)
                x2, y2 = _as64(x), _as64(dy)
                err = np.abs(_as64(mg) - x2.T @ y2)
                if (err > _tol(_mp(dtype)) * (np.abs(x2).T @ np.abs(y2) + 1e-6)).any():
                    wrong.append((seed, i, dtype))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and wrong == []
