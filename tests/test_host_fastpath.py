"""The host-cost fast paths (issue 23) never change a result or an error.

* :func:`paddle_mgrad.ops._inputs.dtype_name` -- a process-wide name lookup by object identity
  (Paddle 3.x) or ``(type, enum value)`` (Paddle 2.6), in place of ``str()``/``==``/hash on
  Paddle dtype objects;
* ``ops._fast_cpu_call`` -- CPU calls let the C++ op validate (it does before writing); when it
  refuses, the Python check runs and raises its usual error text;
* no per-parameter facts are cached: a sequence of the events that could make such a cache
  stale (main_grad replaced / None, ``layer.to``, dtype casts, stop_gradient toggled,
  enable()/disable(), flags set) is checked against plain Paddle with hypothesis.
"""
from __future__ import annotations

import re

import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from paddle_mgrad import FusedLinearError, ops, stats
from paddle_mgrad.ops import _inputs

IS_2 = paddle.__version__.startswith("2.")


# ------------------------------------------------------------------------- dtype names
@pytest.mark.parametrize("name", ["float32", "float64", "float16", "bfloat16", "int32", "int64",
                                  "bool", "uint8", "int8", "int16"])
def test_dtype_name_equals_str_for_tensor_and_paddle_dtypes(name):
    t = paddle.zeros([2], "float32").astype(name)
    for dt in (t.dtype, getattr(paddle, name), name, "paddle." + name):
        assert _inputs.dtype_name(dt) == name
    assert _inputs.dtype_name(t.dtype) == str(t.dtype).replace("paddle.", "")


def test_dtype_name_keys_enum_values_by_type(monkeypatch):
    """Two enum types share small integers (Paddle 3.x: ``VarType.FP32`` is 5, ``DataType`` 5
    is int16): the enum-value table is keyed by (type, value)."""

    class FakeA(int):
        def __str__(self):
            return "paddle.float32"

    class FakeB(int):
        def __str__(self):
            return "paddle.int16"

    monkeypatch.setattr(_inputs, "_BY_ENUM", {})
    assert _inputs.dtype_name(FakeA(5)) == "float32"
    assert _inputs.dtype_name(FakeB(5)) == "int16"
    assert _inputs.dtype_name(FakeA(5)) == "float32"


def test_dtype_name_identity_table_checks_the_object(monkeypatch):
    """An id() of a dead object can be reused: a hit counts only when it is the same object."""
    monkeypatch.setattr(_inputs, "_BY_ID", {})

    class D(int):
        def __init__(self, v):
            self.text = "paddle.float16"

        def __str__(self):
            return self.text

    a = D(3)
    _inputs._BY_ID[id(a)] = (object(), "float64")  # a stale entry under a's id
    assert _inputs.dtype_name(a) == "float16"


# ------------------------------------------------------------------------- C++ validation
def _bad_calls():
    """(name, args) that ops._inputs.check refuses; args for fused_linear_param_grad_add."""
    x, dy = paddle.randn([4, 5]), paddle.randn([4, 3])
    xb, dyb = x.astype("bfloat16"), dy.astype("bfloat16")
    return [
        ("dweight shape", (x, dy, paddle.ones([3, 5]), None, True, False)),
        ("dbias shape", (x, dy, paddle.ones([5, 3]), paddle.ones([5]), True, True)),
        ("dweight dtype", (x, dy, paddle.ones([5, 3], "float64"), None, True, False)),
        ("bf16 dweight with mp", (xb, dyb, paddle.ones([5, 3]).astype("bfloat16"), None, True,
                                  False)),
        ("bf16 dbias with mp", (xb, dyb, paddle.ones([5, 3]), paddle.ones([3]).astype("bfloat16"),
                                True, True)),
        ("leading dims", (x, paddle.randn([5, 3]), paddle.ones([5, 3]), None, True, False)),
        ("rank", (x, paddle.randn([1, 4, 3]), None, None, True, False)),
        ("x/dout dtypes", (x, dy.astype("float64"), None, None, True, False)),
        ("unsupported dtype", (x.astype("int32"), dy.astype("int32"), None, None, True, False)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_cpu_fast_path_refusals_raise_the_python_checks_text(case, monkeypatch):
    """Every input the Python check refuses is refused by the fast path too -- by the C++ op,
    before it writes -- and the error is the Python check's, word for word."""
    if ops.load() is None:
        pytest.skip("C++ op not built")
    name, args = _bad_calls()[case]
    with pytest.raises(FusedLinearError) as want:
        _inputs.check(*args)
    before = [None if a is None else a.numpy().copy() for a in args[2:4]]
    calls = []
    real = _inputs.check
    monkeypatch.setattr(_inputs, "check", lambda *a: calls.append(1) or real(*a))
    with pytest.raises(FusedLinearError, match=re.escape(str(want.value))):
        ops.fused_linear_param_grad_add(*args)
    assert calls, "the Python check explains the refusal"
    for b, a in zip(before, args[2:4]):
        if b is not None:
            np.testing.assert_array_equal(a.numpy(), b)  # nothing written


def test_cpu_fast_path_skips_the_python_check_on_valid_calls(monkeypatch):
    if ops.load() is None:
        pytest.skip("C++ op not built")
    calls = []
    real = _inputs.check
    monkeypatch.setattr(_inputs, "check", lambda *a: calls.append(1) or real(*a))
    rs = np.random.RandomState(3)
    x = paddle.to_tensor(rs.standard_normal([2, 4, 5]).astype("float32"))
    dy = paddle.to_tensor(rs.standard_normal([2, 4, 3]).astype("float32"))
    dw, db = paddle.ones([5, 3]), paddle.ones([3])
    pw = dw.data_ptr()
    out_w, out_b = ops.fused_linear_param_grad_add(x, dy, dw, db, True, True)
    assert calls == [] and out_w is dw and out_b is db and dw.data_ptr() == pw
    x2, y2 = x.numpy().reshape(-1, 5).astype("f8"), dy.numpy().reshape(-1, 3).astype("f8")
    np.testing.assert_allclose(dw.numpy(), 1 + x2.T @ y2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db.numpy(), 1 + y2.sum(0), rtol=1e-5, atol=1e-5)
    w_new, b_none = ops.fused_linear_param_grad_add(x, dy, None, None, True, False)
    assert b_none is None and w_new.dtype == paddle.float32 and calls == []
    np.testing.assert_allclose(w_new.numpy(), x2.T @ y2, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ events vs plain Paddle
class _Pair:
    """The same Linear twice under MixPrecisionLayer: ``ours`` runs with the fused linear when
    ``fused`` is on, ``ref`` always with Paddle's own path."""

    def __init__(self):
        paddle.seed(11)
        self.ours = paddle.nn.Linear(5, 3)
        self.ref = paddle.nn.Linear(5, 3)
        for a, b in zip(self.ours.parameters(), self.ref.parameters()):
            b.set_value(a.numpy())
        MixPrecisionLayer(self.ours, dtype="bfloat16")
        MixPrecisionLayer(self.ref, dtype="bfloat16")
        self.fused = True

    def params(self):
        return list(zip(self.ours.parameters(), self.ref.parameters()))


def _step(pair, data):
    x = paddle.to_tensor(data)
    for layer, fused in ((pair.ref, False), (pair.ours, pair.fused)):
        if fused:
            paddle_mgrad.enable(recompute=False, fused_linear=True)
        else:
            paddle_mgrad.disable()
        xi = x.detach()
        xi.stop_gradient = False
        before = stats.linear["into_main_grad"]
        try:
            (layer(xi) ** 2).sum().backward()
        finally:
            paddle_mgrad.disable()
        if fused:
            want = sum(not p.stop_gradient for p in layer.parameters())
            assert stats.linear["into_main_grad"] - before == want  # the fused path ran


def _event(pair, kind, rs):
    if kind == "main_grad=None":
        for p, q in pair.params():
            p.main_grad = q.main_grad = None
    elif kind == "main_grad=other tensor":
        for p, q in pair.params():
            v = rs.standard_normal(p.shape).astype("float32")
            p.main_grad, q.main_grad = paddle.to_tensor(v), paddle.to_tensor(v)
    elif kind == "to(cpu)":
        pair.ours.to("cpu")
        pair.ref.to("cpu")
    elif kind == "toggle stop_gradient":
        for p, q in pair.params()[:1]:
            p.stop_gradient = q.stop_gradient = not p.stop_gradient
    elif kind == "toggle fused":
        pair.fused = not pair.fused
    elif kind == "set_flags":
        if not IS_2:
            flag = "FLAGS_use_legacy_linear"
            cur = paddle.get_flags(flag)[flag]
            paddle.set_flags({flag: not cur})


EVENTS = ["step", "main_grad=None", "main_grad=other tensor", "to(cpu)", "toggle stop_gradient",
          "toggle fused", "set_flags"]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(EVENTS), min_size=3, max_size=12), st.integers(0, 2**31 - 1))
def test_event_sequences_match_plain_paddle(events, seed):
    """Whatever happens between steps, main_grad equals plain Paddle's (fp32 reference path)."""
    flag = None if IS_2 else paddle.get_flags("FLAGS_use_legacy_linear")
    rs = np.random.RandomState(seed)
    pair = _Pair()
    try:
        for kind in events + ["step"]:
            if kind == "step":
                _step(pair, rs.standard_normal([2, 4, 5]).astype("float32"))
                for p, q in pair.params():
                    assert (p.main_grad is None) == (q.main_grad is None), kind
                    if p.main_grad is not None:
                        assert p.main_grad.dtype == paddle.float32
                        np.testing.assert_allclose(p.main_grad.numpy(), q.main_grad.numpy(),
                                                   rtol=1e-5, atol=1e-5)
            else:
                _event(pair, kind, rs)
    finally:
        paddle_mgrad.disable()
        if flag is not None:
            paddle.set_flags(flag)


# ------------------------------------------------------------ errors after a change
def _fused_step(layer, x):
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        xi = x.detach()
        xi.stop_gradient = False
        (layer(xi) ** 2).sum().backward()
    finally:
        paddle_mgrad.disable()


def test_main_grad_replaced_by_other_dtype_or_shape_is_refused_every_time():
    """Between calls of the same layer: a main_grad of another dtype fails in forward, one of
    another shape in backward, each time (nothing remembered from the call before)."""
    lin = paddle.nn.Linear(5, 3)
    MixPrecisionLayer(lin, dtype="bfloat16")
    x = paddle.randn([4, 5])
    _fused_step(lin, x)
    good = lin.weight.main_grad
    for _ in range(2):
        lin.weight.main_grad = paddle.zeros([5, 3], "float16")
        with pytest.raises(FusedLinearError, match=r"main_grad is .*float16.* expected float32"):
            _fused_step(lin, x)
        lin.weight.main_grad = paddle.zeros([3, 5])
        with pytest.raises(FusedLinearError, match=re.escape("dweight must be [K, N] = [5, 3]")):
            _fused_step(lin, x)
        lin.weight.main_grad = good
        _fused_step(lin, x)


def test_parameter_dtype_cast_between_calls():
    """``layer.to(dtype=...)`` between steps: the next step uses the new dtype's master type
    (float64 main_grad for a float64 parameter), and refuses a stale float32 main_grad."""
    lin = paddle.nn.Linear(5, 3)
    MixPrecisionLayer(lin, dtype="bfloat16")
    x = paddle.randn([4, 5])
    _fused_step(lin, x)
    assert lin.weight.main_grad.dtype == paddle.float32
    lin.to(dtype="float64")
    with pytest.raises(FusedLinearError, match=r"main_grad is .*float32.* expected float64"):
        _fused_step(lin, x.astype("float64"))
    for p in lin.parameters():
        p.main_grad = None
    _fused_step(lin, x.astype("float64"))
    assert lin.weight.main_grad.dtype == paddle.float64
    want = x.numpy().astype("f8").T @ (2 * lin(x.astype("float64")).numpy())
    np.testing.assert_allclose(lin.weight.main_grad.numpy(), want, rtol=1e-10, atol=1e-10)
    lin.to(dtype="float32")
    for p in lin.parameters():
        p.main_grad = None
    _fused_step(lin, x)
    assert lin.weight.main_grad.dtype == paddle.float32
