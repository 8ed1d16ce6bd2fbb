"""The host-cost fast paths never change a result or an error.

* :func:`paddle_mgrad.ops._inputs.dtype_name` -- a process-wide name lookup by object identity
  (Paddle 3.x) or ``(type, enum value)`` (Paddle 2.6), in place of ``str()``/``==``/hash on
  Paddle dtype objects;
* ``ops.entries.fast_cpu_call`` -- CPU calls let the C++ op validate (it does before writing); when it
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
from helpers import PADDLE2, nonzero_biases, require_cpp_op
from paddle_mgrad import FusedLinearError, linear as L, ops, stats
from paddle_mgrad.ops import _inputs, entries


# ------------------------------------------------------------------------- dtype names
@pytest.mark.parametrize(
    "name",
    [
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int32",
        "int64",
        "bool",
        "uint8",
        "int8",
        "int16",
    ],
)
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
        (
            "bf16 dweight with mp",
            (xb, dyb, paddle.ones([5, 3]).astype("bfloat16"), None, True, False),
        ),
        (
            "bf16 dbias with mp",
            (xb, dyb, paddle.ones([5, 3]), paddle.ones([3]).astype("bfloat16"), True, True),
        ),
        ("leading dims", (x, paddle.randn([5, 3]), paddle.ones([5, 3]), None, True, False)),
        ("rank", (x, paddle.randn([1, 4, 3]), None, None, True, False)),
        ("x/dout dtypes", (x, dy.astype("float64"), None, None, True, False)),
        ("unsupported dtype", (x.astype("int32"), dy.astype("int32"), None, None, True, False)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_cpu_fast_path_refusals_raise_the_python_checks_text(case, monkeypatch):
    """Every input the Python check refuses is refused by the fast path too -- by the C++ op,
    before it writes -- and the error is the Python check's, word for word."""
    require_cpp_op()
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


def _strided_twin(t):
    """A strided view holding ``t``'s values (a column slice of a buffer twice as wide; a
    ``[n]`` tensor a ``[::2]`` slice), or ``t`` when it is None."""
    if t is None:
        return None
    shape = list(t.shape)
    store = paddle.zeros(shape[:-1] + [2 * shape[-1]], t.dtype)
    view = store[..., ::2] if len(shape) > 1 else store[::2]
    paddle.assign(t, output=view)
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[c[0] for c in _bad_calls()])
def test_checked_cpu_path_refusals_come_from_the_op(case, monkeypatch):
    """The CPU calls the fast path declines (strided accumulators) are decided by the C++ op
    too: the Python check runs only to word a refusal the op made, before anything was written
    into the views, and the error is its text."""
    require_cpp_op()
    name, (x, dy, dw, db, mp, has_bias) = _bad_calls()[case]
    if dw is None:  # (a valid one, for a call the fast path declines)
        dw = paddle.ones([x.shape[-1], dy.shape[-1]])
    dw, db = _strided_twin(dw), _strided_twin(db)
    with pytest.raises(FusedLinearError) as want:
        _inputs.check(x, dy, dw, db, mp, has_bias)
    before = [None if a is None else a.numpy().copy() for a in (dw, db)]
    events = []
    real_check = _inputs.check
    monkeypatch.setattr(_inputs, "check", lambda *a: events.append("check") or real_check(*a))
    module = ops.load()
    real_op = module.pmg_fused_wgrad_add

    def op(*a):
        events.append("op")
        return real_op(*a)

    monkeypatch.setattr(module, "pmg_fused_wgrad_add", op)
    with pytest.raises(FusedLinearError, match=re.escape(str(want.value))):
        ops.fused_linear_param_grad_add(x, dy, dw, db, mp, has_bias)
    assert events == ["op", "check"], events
    for b, a in zip(before, (dw, db)):
        if b is not None:
            np.testing.assert_array_equal(a.numpy(), b)  # nothing written


@pytest.mark.parametrize("strided", [False, True], ids=["fast-path", "checked-path-strided"])
def test_cpu_paths_skip_the_python_check_on_valid_calls(monkeypatch, strided):
    """Valid calls never reach ``_inputs.check``: on the fast path (contiguous accumulators,
    written in place) and on the checked path (strided views, written through)."""
    require_cpp_op()
    calls = []
    real = _inputs.check
    monkeypatch.setattr(_inputs, "check", lambda *a: calls.append(1) or real(*a))
    rs = np.random.RandomState(3)
    x = paddle.to_tensor(rs.standard_normal([2, 4, 5]).astype("float32"))
    dy = paddle.to_tensor(rs.standard_normal([2, 4, 3]).astype("float32"))
    dw, db = paddle.ones([5, 3]), paddle.ones([3])
    if strided:
        dw, db = _strided_twin(dw), _strided_twin(db)
    pw = dw.data_ptr()
    out_w, out_b = ops.fused_linear_param_grad_add(x, dy, dw, db, True, True)
    assert calls == [] and out_w is dw and out_b is db and dw.data_ptr() == pw
    x2, y2 = x.numpy().reshape(-1, 5).astype("f8"), dy.numpy().reshape(-1, 3).astype("f8")
    np.testing.assert_allclose(dw.numpy(), 1 + x2.T @ y2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db.numpy(), 1 + y2.sum(0), rtol=1e-5, atol=1e-5)
    w_new, b_none = ops.fused_linear_param_grad_add(x, dy, None, None, True, False)
    assert b_none is None and w_new.dtype == paddle.float32 and calls == []
    np.testing.assert_allclose(w_new.numpy(), x2.T @ y2, rtol=1e-5, atol=1e-5)


def test_the_forward_asks_no_main_grad_question_the_route_answered(monkeypatch):
    """The forward checks each ``main_grad`` once, with what the route found: not at all
    where the op library's fast entry already checked them all (``RouteFacts.main_grads``),
    and with the dtype name the Python route read (no second question to Paddle) where not."""
    require_cpp_op()
    seen = []
    real = L.check_main_grad
    monkeypatch.setattr(
        L, "check_main_grad", lambda p, p_name=None: seen.append(p_name) or real(p, p_name)
    )
    paddle.seed(5)
    layer = paddle.nn.Linear(5, 3)
    MixPrecisionLayer(layer, dtype="bfloat16")
    x = paddle.randn([4, 5])
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        for first_micro_step in (True, False):
            assert (layer.weight.main_grad is None) == first_micro_step
            seen.clear()
            before = stats.snapshot()["linear"]["forward"]
            y = layer(x)  # the fast entry's route
            assert stats.snapshot()["linear"]["forward"] == before + 1 and seen == []
            with monkeypatch.context() as m:
                m.setattr(ops, "fast_route", None)  # the Python route, as before the op loads
                layer(x)
            assert seen == ["float32", "float32"], seen  # weight and bias, by the name read
            y.sum().backward()
    finally:
        paddle_mgrad.disable()


@pytest.mark.parametrize(
    "policy, reentrant",
    [(None, None), ("full", False), ("full", True), ("gemm", False), ("gemm", True)],
    ids=[
        "no-recompute",
        "full-non-reentrant",
        "full-reentrant",
        "gemm-non-reentrant",
        "gemm-reentrant",
    ],
)
def test_common_case_backward_takes_the_fast_path_under_every_policy(
    monkeypatch, policy, reentrant
):
    """A CPU fp32 linear with ``main_grad`` takes the fast backward (the op library's entry)
    outside recompute, inside it, and where a recompute policy keeps its output from the
    forward: the route's facts reach the backward on every path."""
    require_cpp_op()
    checked = []
    real = L._backward_checked
    monkeypatch.setattr(L, "_backward_checked", lambda *a: checked.append(1) or real(*a))
    paddle.seed(6)
    net = paddle.nn.Sequential(paddle.nn.Linear(5, 6), paddle.nn.ReLU(), paddle.nn.Linear(6, 3))
    MixPrecisionLayer(net, dtype="bfloat16")
    x = paddle.randn([4, 5])
    x.stop_gradient = False
    paddle_mgrad.enable(recompute=True, fused_linear=True)
    try:
        for _ in range(2):  # first micro-step (main_grad None), then a later one
            before = stats.snapshot()["linear"]["into_main_grad"]
            if policy is None:
                y = net(x)
            else:
                y = paddle_mgrad.recompute(net, x, use_reentrant=reentrant, policy=policy)
            y.sum().backward()
            assert stats.snapshot()["linear"]["into_main_grad"] == before + 4
    finally:
        paddle_mgrad.disable()
    assert checked == []


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
        if not PADDLE2:
            flag = "FLAGS_use_legacy_linear"
            cur = paddle.get_flags(flag)[flag]
            paddle.set_flags({flag: not cur})


EVENTS = [
    "step",
    "main_grad=None",
    "main_grad=other tensor",
    "to(cpu)",
    "toggle stop_gradient",
    "toggle fused",
    "set_flags",
]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(EVENTS), min_size=3, max_size=12), st.integers(0, 2**31 - 1))
def test_event_sequences_match_plain_paddle(events, seed):
    """Whatever happens between steps, main_grad equals plain Paddle's (fp32 reference path)."""
    flag = None if PADDLE2 else paddle.get_flags("FLAGS_use_legacy_linear")
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
                        np.testing.assert_allclose(
                            p.main_grad.numpy(), q.main_grad.numpy(), rtol=1e-5, atol=1e-5
                        )
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


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_main_grad_that_cannot_be_read_fails_in_the_forward(which):
    """A ``main_grad`` whose read raises (a user's property) is not a missing one: the forward
    raises the user's error, and the op library's route leaves no Python error pending."""
    lin = paddle.nn.Linear(5, 3)
    x = paddle.randn([4, 5])
    p = getattr(lin, which)

    class Unreadable(type(p)):
        @property
        def main_grad(self):
            raise RuntimeError("main_grad is on another device")

    cls = p.__class__
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        xi = x.detach()
        xi.stop_gradient = False
        p.__class__ = Unreadable
        with pytest.raises(RuntimeError, match="main_grad is on another device"):
            lin(xi)
        p.__class__ = cls
        lin(xi).sum().backward()  # and the next call goes on
        assert p.grad is not None  # (no main_grad here: the plain gradient)
    finally:
        p.__class__ = cls
        paddle_mgrad.disable()


@pytest.mark.parametrize("which", ["weight", "bias"])
def test_main_grad_of_another_dtype_fails_in_the_forward(which):
    """The forward itself refuses a non-master ``main_grad`` (the op library's route checks it,
    the forward raises), before any backward runs."""
    lin = paddle.nn.Linear(5, 3)
    MixPrecisionLayer(lin, dtype="bfloat16")
    x = paddle.randn([4, 5])
    _fused_step(lin, x)
    p = getattr(lin, which)
    good = p.main_grad
    p.main_grad = paddle.zeros(p.shape, "bfloat16")
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        xi = x.detach()
        xi.stop_gradient = False
        with pytest.raises(FusedLinearError, match=r"main_grad is .*bfloat16.* expected float32"):
            lin(xi)
        p.main_grad = good
        y = lin(xi)  # and the next call goes on
    finally:
        paddle_mgrad.disable()
    (y**2).sum().backward()


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


def test_the_pylayer_called_without_route_facts_checks_against_the_parameter_dtype():
    """``FusedLinearWithGradAdd.apply(x, w, b)`` as user code calls it (no route facts): the
    forward reads the parameters' dtype itself -- a float64 parameter wants a float64
    ``main_grad`` -- and the backward accumulates into it."""
    rs = np.random.RandomState(4)
    w, b = (
        paddle.create_parameter(
            s, "float64", default_initializer=paddle.nn.initializer.Assign(rs.standard_normal(s))
        )
        for s in ([5, 3], [3])
    )
    x = paddle.to_tensor(rs.standard_normal([4, 5]))
    w.main_grad, b.main_grad = paddle.zeros([5, 3]), None
    with pytest.raises(FusedLinearError, match=r"main_grad is .*float32.* expected float64"):
        L.FusedLinearWithGradAdd.apply(x, w, b)
    w.main_grad = paddle.zeros([5, 3], "float64")
    ptr = w.main_grad.data_ptr()
    y = L.FusedLinearWithGradAdd.apply(x, w, b)
    (y**2).sum().backward()
    dy = 2 * (x.numpy() @ w.numpy() + b.numpy())
    assert w.main_grad.data_ptr() == ptr
    np.testing.assert_allclose(w.main_grad.numpy(), x.numpy().T @ dy, rtol=1e-12)
    np.testing.assert_allclose(b.main_grad.numpy(), dy.sum(0), rtol=1e-12)
    assert b.main_grad.dtype == paddle.float64


def test_the_checked_backward_names_each_tensors_dtype_once(monkeypatch):
    """The checked backward (here: the PyLayer applied without route facts) names the dtypes of
    ``x``, ``dy`` and the weight once and hands the names on, to ``dx``'s product and to the
    weight-gradient rules; the bias' ``main_grad`` rule names the bias and its ``main_grad``,
    the weight's its ``main_grad``: six questions, each tensor's dtype once (every one is a
    pybind call)."""
    rs = np.random.RandomState(4)
    w = paddle.create_parameter([5, 3], "float32")
    b = paddle.create_parameter([3], "float32", is_bias=True)
    w.main_grad, b.main_grad = paddle.zeros([5, 3]), paddle.zeros([3])
    x = paddle.to_tensor(rs.standard_normal([4, 5]).astype("float32"))
    x.stop_gradient = False
    y = L.FusedLinearWithGradAdd.apply(x, w, b)
    asked = []
    real = L._dtname
    monkeypatch.setattr(L, "_dtname", lambda dtype: asked.append(dtype) or real(dtype))
    (y**2).sum().backward()
    assert len(asked) == 6
    dy = 2 * (x.numpy() @ w.numpy() + b.numpy())
    np.testing.assert_allclose(w.main_grad.numpy(), x.numpy().T @ dy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), dy @ w.numpy().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", ["fastest", "1; rm -rf /", ""])
def test_a_bad_cpu_knob_of_the_inputs_dtype_is_named_by_backward(monkeypatch, value):
    """A garbage value in a variable the CPU op reads for the inputs' dtype (float64:
    ``PADDLE_MGRAD_CPU_FP64_KERNEL``): the fast path steps aside, and ``backward()`` raises the
    checked path's :class:`EnvError` naming the variable -- as itself, not as Paddle's bare
    error around a PyLayer's backward -- and writes nothing; the next step, the variable
    fixed, is clean."""
    require_cpp_op()
    monkeypatch.setenv("PADDLE_MGRAD_CPU_FP64_KERNEL", value)
    paddle.seed(2)
    lin = paddle.nn.Linear(5, 3)
    lin.to(dtype="float64")
    for p in lin.parameters():
        p.main_grad = None
    x = paddle.randn([4, 5], "float64")
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        if value == "":  # (empty: unset, the default kernel)
            (lin(x) ** 2).sum().backward()
            assert lin.weight.main_grad is not None
            return
        with pytest.raises(paddle_mgrad.EnvError, match="PADDLE_MGRAD_CPU_FP64_KERNEL"):
            (lin(x) ** 2).sum().backward()
        assert lin.weight.main_grad is None and lin.bias.main_grad is None
        assert paddle.is_grad_enabled()
        monkeypatch.delenv("PADDLE_MGRAD_CPU_FP64_KERNEL")
        (lin(x) ** 2).sum().backward()
        dy = 2 * (x.numpy() @ lin.weight.numpy() + lin.bias.numpy())
        np.testing.assert_allclose(lin.weight.main_grad.numpy(), x.numpy().T @ dy, rtol=1e-12)
    finally:
        paddle_mgrad.disable()


# ------------------------------------------- the linear's common-case backward (_backward_fast)
def _spy_backward_fast(monkeypatch):
    """Record, per backward of our linear, whether its common-case path did the work."""
    import paddle_mgrad.linear as linear_mod

    taken = []
    real = linear_mod._backward_fast

    def spy(*args):
        out = real(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(linear_mod, "_backward_fast", spy)
    return taken


def _squares_step(layer, data, fused, x_grad):
    """One backward of sum(layer(x)^2) for x = data, fused linear on or off; returns x."""
    x = paddle.to_tensor(data)
    x.stop_gradient = not x_grad
    if fused:
        paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        (layer(x) ** 2).sum().backward()
    finally:
        paddle_mgrad.disable()
    return x


def _layer_pair(bias, mixprec, rs):
    paddle.seed(int(rs.randint(1 << 30)))
    ours = nonzero_biases(paddle.nn.Linear(5, 3, bias_attr=None if bias else False))
    ref = paddle.nn.Linear(5, 3, bias_attr=None if bias else False)
    for a, b in zip(ours.parameters(), ref.parameters()):
        b.set_value(a.numpy())
    if mixprec:
        MixPrecisionLayer(ours, dtype="bfloat16")
        MixPrecisionLayer(ref, dtype="bfloat16")
    return ours, ref


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    bias=st.booleans(),
    mixprec=st.booleans(),
    w_first=st.booleans(),
    b_first=st.booleans(),
    strided=st.booleans(),
    x_grad=st.booleans(),
    w_frozen=st.booleans(),
    b_frozen=st.booleans(),
    hook=st.booleans(),
    steps=st.integers(1, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_common_case_backward_is_taken_exactly_when_it_may_and_matches_paddle(
    monkeypatch,
    bias,
    mixprec,
    w_first,
    b_first,
    strided,
    x_grad,
    w_frozen,
    b_frozen,
    hook,
    steps,
    seed,
):
    """Our linear's backward does its work on the short path (``linear._backward_fast``) exactly
    in the common case -- main_grad on every parameter that needs a gradient, contiguous or
    None, no user gradient hook -- and takes the general path in every other one; either way
    main_grad / .grad / x.grad equal plain Paddle's (same layer, MixPrecisionLayer or not,
    first micro-step or a later one)."""
    require_cpp_op()
    rs = np.random.RandomState(seed)
    ours, ref = _layer_pair(bias, mixprec, rs)
    pairs = list(zip(ours.parameters(), ref.parameters()))
    if w_frozen and (b_frozen or not bias):
        w_frozen = False  # something must need a gradient
    for (p, q), frozen in zip(pairs, (w_frozen, b_frozen)):
        p.stop_gradient = q.stop_gradient = frozen
    if mixprec:
        for (p, q), first in zip(pairs, (w_first, b_first)):
            if first:
                continue
            v = rs.standard_normal(p.shape).astype("float32")
            if strided and p is ours.weight:  # a zeroed view into a flat gradient buffer
                flats = [paddle.zeros([5 * 6]) for _ in range(2)]
                p.main_grad, q.main_grad = (f.reshape([5, 6])[:, ::2] for f in flats)
            else:
                p.main_grad, q.main_grad = paddle.to_tensor(v), paddle.to_tensor(v)
    hook = hook and not w_frozen  # Paddle refuses a hook on a stop-gradient tensor
    if hook:
        # (under MixPrecisionLayer, Paddle's own main_grad hook runs first and hands on None;
        # on Paddle 2.6 an uninitialized tensor)
        def double(g):
            return None if g is None or not g._is_initialized() else g * 2

        ref.weight.register_hook(double)
        paddle_mgrad.enable(recompute=False, fused_linear=True)  # counts hooks from here on
        try:
            ours.weight.register_hook(double)
        finally:
            paddle_mgrad.disable()
    taken = _spy_backward_fast(monkeypatch)
    xs_ours, xs_ref = [], []
    for _ in range(steps):
        data = rs.standard_normal([2, 4, 5]).astype("float32")
        for layer, fused, keep in ((ref, False, xs_ref), (ours, True, xs_ours)):
            keep.append(_squares_step(layer, data, fused, x_grad))
    needy = [p for p in ours.parameters() if not p.stop_gradient]
    strided_mg = any(
        getattr(p, "main_grad", None) is not None and not p.main_grad.is_contiguous() for p in needy
    )
    want_fast = (
        mixprec and not hook and len(needy) == len(list(ours.parameters())) and not strided_mg
    )
    assert taken == [want_fast] * steps
    for p, q in pairs:
        for attr in ("main_grad", "grad"):
            a, b = getattr(p, attr, None), getattr(q, attr, None)
            assert (a is None) == (b is None), (p.name, attr)
            if a is not None:
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)
    for a, b in zip(xs_ours, xs_ref):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-5, atol=1e-5)


def _spy_entry(monkeypatch, getter):
    """Replace ``ops.<getter>`` (``cpu_entry`` / ``gpu_entry``) so that the fast entry it hands
    out records each call as ``(function name, whether it took the call)``; returns the record."""
    real = getattr(ops, getter)
    calls = []

    class Spy:
        def __init__(self, entry):
            self.entry = entry

        def __getattr__(self, name):
            fn = getattr(self.entry, name)

            def spy(*args):
                out = fn(*args)
                calls.append((name, out is not None))
                return out

            return spy

    def spied(*args):
        entry = real(*args)
        return None if entry is None else Spy(entry)

    monkeypatch.setattr(ops, getter, spied)
    return calls


@pytest.mark.parametrize(
    "dtype,x_grad,op",
    [
        ("float32", True, "linear_bwd"),  # dx in the same call
        ("float32", False, "wgrad_add"),  # no dx wanted
        ("float64", True, "linear_bwd"),
        ("float64", False, "wgrad_add"),
    ],
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_common_case_backward_is_one_op_call(monkeypatch, dtype, x_grad, op, bias):
    """A float32/float64 linear's common-case backward is ONE call from Python, into the op
    library's fast entry: dx too (``linear_bwd``, Paddle's matmul kernel inside); without an
    input gradient, the weight-gradient kernel.  No custom-op dispatch.  Gradients equal plain
    Paddle's either way (dx bit for bit: the same matmul kernel); the statistics count each
    parameter written into its ``main_grad``, by name."""
    require_cpp_op()
    calls = _spy_entry(monkeypatch, "cpu_entry")

    def no_runner(*args, **kwargs):
        raise AssertionError("the custom-op dispatch ran")

    monkeypatch.setitem(entries._RAW, "run", no_runner)
    monkeypatch.setitem(entries._RAW, "for", ops.load())
    rs = np.random.RandomState(1)
    ours, ref = _layer_pair(bias, True, rs)
    if dtype == "float64":
        for layer in (ours, ref):
            layer.to(dtype="float64")
            for p in layer.parameters():
                p.main_grad = None
    data = rs.standard_normal([3, 5]).astype(dtype)
    stats.reset()
    xs = [
        _squares_step(layer, data, fused, x_grad) for layer, fused in ((ref, False), (ours, True))
    ]
    assert calls == [(op, True)]
    assert stats.linear["into_main_grad"] == 1 + bias
    assert stats.fused_params == {p.name for p in ours.parameters()}
    for p, q in zip(ours.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.main_grad.numpy(), q.main_grad.numpy(), rtol=1e-5, atol=1e-5)
    if x_grad:
        np.testing.assert_array_equal(xs[1].grad.numpy(), xs[0].grad.numpy())


@pytest.mark.parametrize("bias_has", ["no_main_grad", "user_hook"])
def test_a_bias_the_common_case_cannot_take_sends_the_backward_to_the_checked_path(
    monkeypatch, bias_has
):
    """The weight has a ``main_grad`` and no hook; the bias has no ``main_grad`` (its gradient
    goes to ``.grad``) or a user hook besides it (the hook must see the gradient, and Paddle
    accumulates what it returns): the common case does not take the call, and the gradients
    equal plain Paddle's (``.grad`` throughout, the same hook)."""
    taken = _spy_backward_fast(monkeypatch)
    rs = np.random.RandomState(3)
    ours, ref = _layer_pair(True, False, rs)
    ours.weight.main_grad = None
    seen = {"ours": [], "ref": []}

    def hook(log):
        return lambda g: log.append(g.numpy()) or g * 2

    if bias_has == "user_hook":  # (ours registered while paddle_mgrad is on: docs/limits.md)
        ours.bias.main_grad = None
        ref.bias.register_hook(hook(seen["ref"]))
        paddle_mgrad.enable(recompute=False, fused_linear=True)
        ours.bias.register_hook(hook(seen["ours"]))
        paddle_mgrad.disable()
    data = rs.standard_normal([3, 5]).astype("float32")
    for layer, fused in ((ref, False), (ours, True)):
        _squares_step(layer, data, fused, True)
    assert taken == [False]
    np.testing.assert_allclose(
        ours.weight.main_grad.numpy(), ref.weight.grad.numpy(), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(ours.bias.grad.numpy(), ref.bias.grad.numpy(), rtol=1e-5, atol=1e-5)
    if bias_has == "user_hook":
        assert len(seen["ours"]) == len(seen["ref"]) == 1
        np.testing.assert_allclose(seen["ours"][0], seen["ref"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gpu_tier", ["cuda", "paddle-fused", "python"])
@pytest.mark.parametrize("x_grad", [True, False])
def test_gpu_common_case_backward_calls_the_entry_only_on_our_cuda_tier(
    monkeypatch, gpu_tier, x_grad
):
    """A CUDA linear's common-case backward, faked: the route calls the (CPU) tensors "gpu".
    With our CUDA op as the GPU tier (``ops.gpu_entry``), the backward is one call of the fast
    entry's weight-gradient kernel (CUDA's, on a GPU) and Paddle's matmul for dx -- no checks in
    Python, no custom-op dispatch.  With Paddle's fused op or the reference as the tier, the
    checked path runs.  Gradients equal plain Paddle's either way."""
    require_cpp_op()
    real_route = ops.fast_route

    def route(*args):
        facts = real_route(*args)
        return (
            facts._replace(where="gpu")
            if isinstance(facts, _inputs.RouteFacts) and facts.where == "cpu"
            else facts
        )

    monkeypatch.setattr(ops, "fast_route", route)
    calls, checked = _spy_entry(monkeypatch, "gpu_entry"), []

    def general(*args, **kwargs):
        checked.append(True)
        return real_general(*args, **kwargs)

    real_general = L.weight_and_bias_grads
    monkeypatch.setattr(L, "weight_and_bias_grads", general)
    rs = np.random.RandomState(2)
    ours, ref = _layer_pair(True, True, rs)
    for _ in range(2):  # first micro-step (main_grad None), then accumulation
        data = rs.standard_normal([3, 5]).astype("float32")
        with ops.loader.settled(gpu=gpu_tier):
            xs = [
                _squares_step(layer, data, fused, x_grad)
                for layer, fused in ((ref, False), (ours, True))
            ]
        for p, q in zip(ours.parameters(), ref.parameters()):
            np.testing.assert_allclose(
                p.main_grad.numpy(), q.main_grad.numpy(), rtol=1e-5, atol=1e-5
            )
        if x_grad:
            np.testing.assert_allclose(xs[1].grad.numpy(), xs[0].grad.numpy(), rtol=1e-6, atol=1e-6)
    if gpu_tier == "cuda":
        assert calls == [("wgrad_add", True)] * 2 and checked == []
    else:
        assert calls == [] and checked == [True] * 2


@pytest.mark.parametrize("transpose_weight", [False, True])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_incubate_fused_linear_takes_the_common_case_backward(monkeypatch, bias, transpose_weight):
    """``paddle.incubate.nn.functional.fused_linear`` with a ``[K, N]`` weight hands the route's
    facts to our linear as ``F.linear`` does: its backward takes the short path, into main_grad.
    A transposed (``[N, K]``) weight takes the general one.  main_grad right either way."""
    require_cpp_op()
    from paddle.incubate.nn.functional import fused_linear as inc

    rs = np.random.RandomState(3)
    wv = rs.standard_normal([5, 3]).astype("float32")
    w = paddle.create_parameter([3, 5] if transpose_weight else [5, 3], "float32")
    w.set_value(wv.T.copy() if transpose_weight else wv)
    params = [w]
    b = None
    if bias:
        b = paddle.create_parameter([3], "float32", is_bias=True)
        b.set_value(rs.standard_normal([3]).astype("float32"))
        params.append(b)
    for p in params:
        p.main_grad = None
    data = rs.standard_normal([2, 4, 5]).astype("float32")
    taken = _spy_backward_fast(monkeypatch)
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    try:
        y = inc(paddle.to_tensor(data), w, b, transpose_weight=transpose_weight)
        (y**2).sum().backward()
    finally:
        paddle_mgrad.disable()
    assert taken == ([] if transpose_weight else [True])
    x2 = data.reshape(-1, 5).astype("float64")
    dy = 2 * (x2 @ wv + (b.numpy() if bias else 0))
    dw = x2.T @ dy
    np.testing.assert_allclose(w.main_grad.numpy(), dw.T if transpose_weight else dw, rtol=1e-5)
    if bias:
        np.testing.assert_allclose(b.main_grad.numpy(), dy.sum(0), rtol=1e-5, atol=1e-5)
