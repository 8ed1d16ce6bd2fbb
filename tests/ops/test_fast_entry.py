"""The op library's Python fast entry (``csrc/wgrad_pyentry.cc``, :func:`paddle_mgrad.ops.cpu_entry`,
``ops.fast_route``): the op's kernels and the linear's routing questions without Paddle's
custom-op dispatch (it costs the host more than the kernels at small shapes).

* ``linear_bwd`` -- a float32/float64 CPU linear's whole backward: dx = dout . W^T (Paddle's
  matmul kernel: equal to ``paddle.matmul`` bit for bit) and the weight/bias gradients
  accumulated as ``pmg_fused_wgrad_add`` with multi_precision does; ``wgrad_add`` -- that op's
  kernel, every dtype.  Against a float64 numpy reference over shapes hypothesis draws (3-D
  inputs, given or missing accumulators).  A call the entry does not take (strided tensors,
  non-tensors) or the kernel refuses (M = 0 / N = 0, every bad shape or dtype) returns None
  and writes nothing.
* ``route`` -- the same answer as ``routing.route`` asking Paddle question by question, over
  inputs hypothesis draws (tensors, parameters, numpy, tuples, ranks 0-3, zero sizes, dtypes,
  strided views, frozen parameters, a transposed weight).  Places other than the CPU cannot be
  drawn on these machines (no GPU): the place comparison is covered by the fakes of test_ops.
  A SelectedRows operand (a sparse embedding's gradient) stands for the tensors that are not
  dense (dist tensors cannot be made on these machines).
* Garbage arguments in a subprocess: exceptions, never a signal.  Threads: the GIL is released
  while a kernel runs; concurrent calls stay exact.
"""

import subprocess
import sys
import textwrap
import threading

import numpy as np
import paddle
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from helpers import require_cpp_op
from paddle_mgrad import ops, routing
from paddle_mgrad.ops import _inputs


@pytest.fixture(scope="module")
def entry():
    require_cpp_op()
    e = ops.cpu_entry("float32")
    assert e is not None and ops.fast_route is e.route
    return e


def _f32(a):
    return paddle.to_tensor(np.ascontiguousarray(a, dtype="float32"))


def _strided(a):
    """A non-contiguous view holding ``a`` (every other column of a wider buffer)."""
    wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), "float32")
    wide[..., ::2] = a
    return _f32(wide)[..., ::2]


def _untouched(accs, call):
    """``call()`` returns None and leaves ``accs`` (tensors or None) as they were."""
    accs = [a for a in accs if a is not None]
    before = [(a.data_ptr(), a.numpy().copy()) for a in accs]
    assert call() is None
    for a, (ptr, values) in zip(accs, before):
        assert a.data_ptr() == ptr
        np.testing.assert_array_equal(a.numpy(), values)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lead=st.lists(st.integers(0, 9), min_size=1, max_size=2),
    k=st.integers(1, 70),
    n=st.integers(0, 70),
    bias=st.booleans(),
    given_acc=st.booleans(),
    strided=st.sampled_from(["none", "x", "dout", "weight", "dweight"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_bwd_matches_float64(entry, lead, k, n, bias, given_acc, strided, seed):
    rs = np.random.RandomState(seed)
    x = rs.standard_normal(lead + [k]).astype("f4")
    dy = rs.standard_normal(lead + [n]).astype("f4")
    w = rs.standard_normal([k, n]).astype("f4")
    w0 = rs.standard_normal([k, n]).astype("f4")
    b0 = rs.standard_normal([n]).astype("f4")
    tx = _strided(x) if strided == "x" else _f32(x)
    tdy = _strided(dy) if strided == "dout" and n else _f32(dy)
    tw = _strided(w) if strided == "weight" and n else _f32(w)
    if given_acc:
        mg = _strided(w0) if strided == "dweight" and n else _f32(w0)
        mb = _f32(b0)
    else:
        mg = mb = None
    m = int(np.prod(lead))
    args = (tx, tdy, tw, mg, mb if bias else None, bias)
    if (
        m == 0
        or n == 0
        or not tx.is_contiguous()
        or not tdy.is_contiguous()
        or (not tw.is_contiguous())
        or (mg is not None and not mg.is_contiguous())
    ):
        # a zero-size product (the checked path's) or a strided tensor (the checked path copies
        # x/dout, and writes a strided accumulator through): not for the entry, nothing written
        _untouched([mg, mb], lambda: entry.linear_bwd(*args))
        return
    dx, dw, db = entry.linear_bwd(*args)
    x2, y2 = x.reshape(m, k).astype("f8"), dy.reshape(m, n).astype("f8")
    assert list(dx.shape) == lead + [k] and dx.dtype == paddle.float32
    np.testing.assert_allclose(
        dx.numpy().reshape(m, k), y2 @ w.astype("f8").T, rtol=1e-4, atol=1e-4
    )
    np.testing.assert_array_equal(dx.numpy(), paddle.matmul(tdy, tw, transpose_y=True).numpy())
    if given_acc:  # in place: nothing new handed back for what the caller passed
        assert dw is None and db is None
        dw, db = mg, mb
    assert dw.dtype == paddle.float32 and list(dw.shape) == [k, n]
    base_w = w0.astype("f8") if given_acc else 0.0
    np.testing.assert_allclose(dw.numpy(), base_w + x2.T @ y2, rtol=1e-4, atol=1e-4)
    if bias:
        base_b = b0.astype("f8") if given_acc else 0.0
        np.testing.assert_allclose(db.numpy(), base_b + y2.sum(0), rtol=1e-4, atol=1e-4)
    else:
        assert db is None or given_acc


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "float64"]),
    mp=st.booleans(),
    lead=st.lists(st.integers(0, 7), min_size=1, max_size=2),
    k=st.integers(1, 40),
    n=st.integers(1, 40),
    bias=st.booleans(),
    given_acc=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_wgrad_add_matches_float64(entry, dtype, mp, lead, k, n, bias, given_acc, seed):
    rs = np.random.RandomState(seed)
    wide = "float64" if dtype == "float64" else "float32"
    acc = wide if mp else dtype
    x = paddle.to_tensor(rs.standard_normal(lead + [k]).astype(wide)).astype(dtype)
    dy = paddle.to_tensor(rs.standard_normal(lead + [n]).astype(wide)).astype(dtype)
    mg = paddle.ones([k, n], acc) if given_acc else None
    mb = paddle.ones([n], acc) if given_acc and bias else None
    _, dw, db = entry.wgrad_add(x, dy, mg, mb, mp, bias)
    if given_acc:
        assert dw is None and db is None
        dw, db = mg, mb
    x2 = x.astype(wide).numpy().reshape(-1, k).astype("f8")
    y2 = dy.astype(wide).numpy().reshape(-1, n).astype("f8")
    base = 1.0 if given_acc else 0.0
    tol = 1e-4 if dtype in ("float32", "float64") or mp else 5e-2
    assert dw.dtype == paddle.to_tensor(np.zeros(1, "f4")).astype(acc).dtype
    np.testing.assert_allclose(dw.astype("float64").numpy(), base + x2.T @ y2, rtol=tol, atol=tol)
    if bias:
        np.testing.assert_allclose(
            db.astype("float64").numpy(), base + y2.sum(0), rtol=tol, atol=tol
        )
    else:
        assert db is None


def _refused_calls():
    x, dy, w = paddle.randn([4, 5]), paddle.randn([4, 3]), paddle.randn([5, 3])
    mg, mb = paddle.ones([5, 3]), paddle.ones([3])
    return {
        "weight shape": (x, dy, paddle.randn([3, 5]), mg, mb, True),
        "weight K": (x, dy, paddle.randn([6, 3]), mg, mb, True),
        "weight dtype": (x, dy, w.astype("float64"), mg, mb, True),
        "x dtype": (x.astype("float64"), dy.astype("float64"), w, mg, mb, True),
        "bfloat16": (
            x.astype("bfloat16"),
            dy.astype("bfloat16"),
            w.astype("bfloat16"),
            mg,
            mb,
            True,
        ),
        "float64 accumulators for float32": (x, dy, w, mg.astype("float64"), None, False),
        "leading dims": (x, paddle.randn([5, 3]), w, mg, mb, True),
        "dweight shape": (x, dy, w, paddle.ones([3, 5]), mb, True),
        "dweight dtype": (x, dy, w, paddle.ones([5, 3], "float64"), mb, True),
        "dbias shape": (x, dy, w, mg, paddle.ones([5]), True),
        "dbias dtype": (x, dy, w, mg, paddle.ones([3], "bfloat16"), True),
        "zero rows": (paddle.randn([0, 5]), paddle.randn([0, 3]), w, mg, mb, True),
        "numpy x": (x.numpy(), dy, w, mg, mb, True),
        "numpy dweight": (x, dy, w, mg.numpy(), mb, True),
        "tuple dout": ((dy,), dy, w, mg, mb, True),
        "uninitialized x": (paddle.Tensor(), dy, w, mg, mb, True),
    }


@pytest.mark.parametrize("case", sorted(_refused_calls()))
def test_a_refused_call_writes_nothing(entry, case):
    args = _refused_calls()[case]
    accs = [a for a in args[3:5] if isinstance(a, paddle.Tensor)]
    _untouched(accs, lambda: entry.linear_bwd(*args))
    # the same accumulators refused by the weight-gradient kernel, where they are the problem
    if case.startswith(("dweight", "dbias", "float64 acc", "numpy dweight", "leading", "x dtype")):
        _untouched(accs, lambda: entry.wgrad_add(args[0], args[1], args[3], args[4], True, args[5]))


def test_float64(entry):
    rs = np.random.RandomState(4)
    x, dy, w = (paddle.to_tensor(rs.standard_normal(s)) for s in ([2, 6, 5], [2, 6, 3], [5, 3]))
    mg, mb = paddle.ones([5, 3], "float64"), paddle.ones([3], "float64")
    ptrs = mg.data_ptr(), mb.data_ptr()
    dx, dw, db = entry.linear_bwd(x, dy, w, mg, mb, True)
    assert dw is None and db is None and (mg.data_ptr(), mb.data_ptr()) == ptrs
    x2, y2 = x.numpy().reshape(12, 5), dy.numpy().reshape(12, 3)
    np.testing.assert_allclose(dx.numpy().reshape(12, 5), y2 @ w.numpy().T, rtol=1e-12)
    np.testing.assert_allclose(mg.numpy(), 1 + x2.T @ y2, rtol=1e-12)
    np.testing.assert_allclose(mb.numpy(), 1 + y2.sum(0), rtol=1e-12)


def test_new_accumulators_are_plain_tensors(entry):
    """What a first micro-step's ``main_grad`` becomes: a tensor like the op's output was --
    no gradient wanted, the multi-precision dtype, its own allocation."""
    x, dy, w = paddle.randn([3, 4]), paddle.randn([3, 2]), paddle.randn([4, 2])
    dx, dw, db = entry.linear_bwd(x, dy, w, None, None, True)
    for t in (dx, dw, db):
        assert isinstance(t, paddle.Tensor) and t.stop_gradient and t.is_contiguous()
        assert t.place.is_cpu_place() and t.dtype == paddle.float32
    assert len({dx.data_ptr(), dw.data_ptr(), db.data_ptr(), x.data_ptr(), dy.data_ptr()}) == 5


# ----------------------------------------------------------------------------- route
_DTYPES = ["float32", "float64", "bfloat16", "float16", "int32"]


def _make(draw, kind, shape, dtype, grad):
    """x, weight or bias as ``kind``: a tensor, a parameter, or something Paddle's linear may get."""
    data = np.ones(shape, "float64" if dtype == "float64" else "float32")
    if kind == "numpy":
        return data
    if kind == "uninitialized":
        return paddle.Tensor()
    if kind == "selected_rows" and len(shape) == 2 and shape[0] and shape[1]:
        return _selected_rows(*shape)
    if kind == "param" and shape and 0 not in shape and dtype != "int32":
        p = paddle.create_parameter(
            shape, dtype, default_initializer=paddle.nn.initializer.Constant(1.0)
        )
        p.stop_gradient = not grad
        return p
    if kind == "strided" and shape:
        t = paddle.to_tensor(np.concatenate([data, data], axis=-1)).astype(dtype)[..., ::2]
    else:
        t = paddle.to_tensor(data).astype(dtype)
    t.stop_gradient = not grad
    return (t,) if kind == "tuple" else t


def _selected_rows(rows, width):
    """A float32 SelectedRows tensor of shape [rows, width] (not dense): a sparse embedding's
    gradient."""
    emb = paddle.nn.Embedding(rows + 1, width, sparse=True)
    emb(paddle.arange(rows)).sum().backward()
    g = emb.weight.grad
    assert g.is_selected_rows() and not g.is_dense() and list(g.shape) == [rows, width]
    return g


@st.composite
def _linear_args(draw):
    """(x, weight, bias, transpose_weight): a valid linear call, then, each with some
    probability, one thing about one operand changed (kind, rank, a dim, dtype, size 0)."""
    dtype = draw(st.sampled_from(_DTYPES[:4]))
    lead = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    k, n = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    transpose = draw(st.booleans())
    shapes = {"x": lead + [k], "weight": [n, k] if transpose else [k, n], "bias": [n]}
    kinds = {r: draw(st.sampled_from(["tensor", "param"])) for r in shapes}
    kinds["x"] = "tensor"
    dtypes = dict.fromkeys(shapes, dtype)
    grads = {r: draw(st.integers(0, 3)) > 0 for r in shapes}
    bias = draw(st.integers(0, 2)) > 0
    for _ in range(draw(st.integers(0, 2))):
        role = draw(st.sampled_from(sorted(shapes)))
        change = draw(st.sampled_from(["kind", "rank", "dim", "dtype", "zero"]))
        if change == "kind":
            kinds[role] = draw(
                st.sampled_from(["numpy", "tuple", "strided", "uninitialized", "selected_rows"])
            )
        elif change == "rank":
            shapes[role] = draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
        elif change == "dim" and shapes[role]:
            i = draw(st.integers(0, len(shapes[role]) - 1))
            shapes[role][i] = max(0, shapes[role][i] + draw(st.sampled_from([-1, 1])))
        elif change == "dtype":
            dtypes[role] = draw(st.sampled_from(_DTYPES))
        elif change == "zero" and shapes[role]:
            shapes[role][draw(st.integers(0, len(shapes[role]) - 1))] = 0
    made = {r: _make(draw, kinds[r], shapes[r], dtypes[r], grads[r]) for r in shapes}
    return made["x"], made["weight"], made["bias"] if bias else None, transpose


def _answer(x, w, b, transpose):
    """The route's answer, without ``main_grads`` (only the fast entry checks them: see
    :func:`test_route_checks_main_grads_as_the_forward_would`)."""
    try:
        facts = routing.route(x, w, b, transpose)
        kind = type(facts).__name__  # (a RouteFacts, from either route)
        return ("ok", facts if facts is None else facts[:2], kind)
    except Exception as e:  # noqa: BLE001 -- compared: type and text
        return ("raised", type(e), str(e))


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(args=_linear_args())
def test_route_answers_as_python(entry, args):
    """``routing.route`` with the fast entry == asking Paddle question by question."""
    assert ops.fast_route is entry.route
    fast = _answer(*args)
    event(f"{fast[0]} {fast[1] if fast[0] == 'ok' else fast[1].__name__}")
    ops.fast_route = None  # (per example: a fixture's monkeypatch would last for all of them)
    try:
        slow = _answer(*args)
        facts = routing.route(*args) if slow[0] == "ok" else None
        assert facts is None or facts.main_grads is False  # Python leaves them to the forward
    finally:
        ops.fast_route = entry.route
    assert fast == slow


@pytest.mark.parametrize(
    "x_shape, w_shape, bias",
    [
        ([2, 0], [0, 3], True),
        ([2, 4], [4, 0], True),
        ([0, 4], [4, 3], True),
        ([2, 0], [0, 0], False),
    ],
    ids=["K=0", "N=0", "M=0", "K=N=0"],
)
def test_route_answers_zero_sizes_as_python(entry, x_shape, w_shape, bias):
    """Zero-size products (rare in drawn examples): the same answer from both routes -- ours,
    without the fast backward's common case where K or N is 0.  The Python route checks no
    ``main_grad`` (``main_grads`` False: the forward checks them)."""
    w = paddle.zeros(w_shape)  # (Paddle 2.6 makes no zero-size parameter)
    b = paddle.zeros(w_shape[1:]) if bias else None
    for t in (w, b):
        if t is not None:
            t.stop_gradient = False
    x = paddle.zeros(x_shape)
    fast = _answer(x, w, b, False)
    ops.fast_route = None
    try:
        slow = _answer(x, w, b, False)
        assert routing.route(x, w, b, False).main_grads is False
    finally:
        ops.fast_route = entry.route
    assert fast == slow
    want = None if 0 in (x_shape[-1], w_shape[1]) else "cpu"
    assert fast == ("ok", ("float32", want), "RouteFacts")


# what a parameter's main_grad may be: absent, None, a dense tensor of any dtype, a strided
# view, something else
_MAIN_GRADS = ["absent", "none", *_DTYPES, "strided", "numpy", "string"]
_MAIN_GRADS += ["raises", "raises_attribute"]
_RAISING = {}


def _raising(p, error):
    """``p`` with a ``main_grad`` property that raises ``error`` (a user's lazy ``main_grad``
    that fails): its class swapped for a subclass, one per error type."""
    if error not in _RAISING:

        def main_grad(self):
            raise error("main_grad cannot be read")

        _RAISING[error] = type(
            f"Raising{error.__name__}", (type(p),), {"main_grad": property(main_grad)}
        )
    p.__dict__.pop("main_grad", None)
    p.__class__ = _RAISING[error]


def _with_main_grad(p, kind):
    if kind == "raises":
        _raising(p, RuntimeError)
    elif kind == "raises_attribute":
        _raising(p, AttributeError)  # as a missing attribute
    elif kind == "absent":
        p.__dict__.pop("main_grad", None)
    elif kind == "none":
        p.main_grad = None
    elif kind == "strided":
        p.main_grad = _strided(np.zeros(p.shape, "float32"))
    elif kind == "numpy":
        p.main_grad = np.zeros(p.shape, "float32")
    elif kind == "string":
        p.main_grad = "float32"
    else:
        p.main_grad = paddle.zeros(p.shape, kind)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    dtype=st.sampled_from(_DTYPES[:4]),
    bias=st.booleans(),
    kinds=st.tuples(st.sampled_from(_MAIN_GRADS), st.sampled_from(_MAIN_GRADS)),
    frozen=st.tuples(st.booleans(), st.booleans()),
)
def test_route_checks_main_grads_as_the_forward_would(entry, dtype, bias, kinds, frozen):
    """``RouteFacts.main_grads`` lets the forward skip ``linear.check_main_grads``: it is True
    only where that check passes, and True for every master-dtype (or missing) ``main_grad``
    -- the common case, where the skip saves the forward its questions to Paddle."""
    from paddle_mgrad import linear

    one = paddle.nn.initializer.Constant(1.0)
    w = paddle.create_parameter([3, 2], dtype, default_initializer=one)
    b = paddle.create_parameter([2], dtype, default_initializer=one) if bias else None
    for p, kind, fr in zip((w, b), kinds, frozen):
        if p is not None:
            _with_main_grad(p, kind)
            p.stop_gradient = fr
    facts = ops.fast_route(paddle.ones([4, 3], dtype), w, b, False)
    assert (facts.dtype, facts.where) == (dtype, "cpu")
    master = "float64" if dtype == "float64" else "float32"
    plain = {"absent", "raises_attribute", "none", master}
    plain |= {"strided"} if master == "float32" else set()
    used = kinds[: 1 + bias]
    event(f"main_grads {facts.main_grads}")
    assert facts.main_grads is all(k in plain for k in used)
    if facts.main_grads:
        linear.check_main_grads(w, b, dtype)  # raises nothing


def test_route_checks_main_grads_common_cases(entry):
    w = paddle.create_parameter([4, 3], "float32")
    b = paddle.create_parameter([3], "float32")
    x = paddle.randn([2, 4])
    assert ops.fast_route(x, w, b, False).main_grads is True  # none yet
    w.main_grad, b.main_grad = paddle.zeros([4, 3]), None
    assert ops.fast_route(x, w, b, False) is ops.fast_route(x, w, None, False)  # made once
    assert ops.fast_route(x, w, b, False).main_grads is True
    b.main_grad = paddle.zeros([3], "bfloat16")
    assert ops.fast_route(x, w, b, False).main_grads is False
    assert ops.fast_route(x, w, None, False).main_grads is True  # (no bias: not asked)
    _raising(b, RuntimeError)  # a failing read is not an absent main_grad: checked again
    assert ops.fast_route(x, w, b, False).main_grads is False
    _raising(b, AttributeError)  # is a missing one
    assert ops.fast_route(x, w, b, False).main_grads is True
    w64 = paddle.create_parameter([4, 3], "float64")
    w64.main_grad = paddle.zeros([4, 3])
    assert ops.fast_route(x.astype("float64"), w64, None, False).main_grads is False
    w64.main_grad = paddle.zeros([4, 3], "float64")
    assert ops.fast_route(x.astype("float64"), w64, None, False).main_grads is True


def test_route_common_cases(entry):
    w = paddle.create_parameter([4, 3], "float32")
    b = paddle.create_parameter([3], "float32")
    x = paddle.randn([2, 5, 4])
    facts = ops.fast_route(x, w, b, False)
    assert type(facts) is _inputs.RouteFacts and facts == ("float32", "cpu", True)
    assert ops.fast_route(x, w, b, False) is facts  # made once per combination
    assert ops.fast_route(x, w, None, False) == ("float32", "cpu", True)
    assert ops.fast_route(x, w.T, None, True) == ("float32", "cpu", True)
    assert ops.fast_route(paddle.randn([2, 3]), w, b, False) is False  # K mismatch
    assert ops.fast_route(x.astype("float64"), w, b, False) is None  # dtype mix: Paddle's
    assert ops.fast_route(x, w, paddle.randn([1, 3]), False) is None  # broadcast bias
    assert ops.fast_route(paddle.randn([2, 0]), paddle.randn([0, 3]), None, False) == (
        "float32",
        None,
        True,
    )  # K = 0: not the common case of the fast backward
    with pytest.raises(TypeError):
        ops.fast_route(x, w, b)


# ----------------------------------------------------------------------------- adversarial
GARBAGE = """
    import zlib, itertools, paddle
    from paddle_mgrad import ops
    ops.load(); e = ops.cpu_entry("float32")
    t = paddle.randn([2, 3])
    emb = paddle.nn.Embedding(4, 3, sparse=True)
    emb(paddle.arange(2)).sum().backward()
    values = [None, 0, 1.5, "x", b"", (), [], {}, object(), t, t.T, paddle.Tensor(),
              t.numpy(), paddle.randn([0, 0]), paddle.randn([3]), emb.weight.grad]
    n = 0
    for f, arity in ((e.route, 4), (e.linear_bwd, 6), (e.wgrad_add, 6)):
        for count in range(arity + 2):
            try:
                f(*values[:count])
            except TypeError:
                pass
        for args in itertools.product(values, repeat=2):
            for pos in range(arity - 1):
                full = [t] * arity
                full[pos:pos + 2] = args
                try:
                    f(*full)
                except Exception:
                    pass
                n += 1
    print("CALLS", n)
"""


@pytest.mark.probe
def test_garbage_arguments_never_crash(entry):
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(GARBAGE)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-3000:]}"
    assert "CALLS" in r.stdout


def test_threads_stay_exact(entry):
    """Four threads accumulate into their own and into one shared accumulator; the kernel runs
    with the GIL released, each call's writes are its own: every sum exact."""
    rs = np.random.RandomState(0)
    x = paddle.to_tensor(rs.standard_normal([64, 32]).astype("f4"))
    dy = paddle.to_tensor(rs.standard_normal([64, 16]).astype("f4"))
    w = paddle.to_tensor(rs.standard_normal([32, 16]).astype("f4"))
    own = [paddle.zeros([32, 16]) for _ in range(4)]
    lock = threading.Lock()
    shared = paddle.zeros([32, 16])
    errors = []

    def work(i):
        try:
            for _ in range(25):
                assert entry.linear_bwd(x, dy, w, own[i], None, False) is not None
                with lock:  # (one accumulator: writes must not interleave, as in Paddle)
                    assert entry.wgrad_add(x, dy, shared, None, True, False) is not None
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    one = x.numpy().astype("f8").T @ dy.numpy().astype("f8")
    for acc in own:
        np.testing.assert_allclose(acc.numpy(), 25 * one, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(shared.numpy(), 100 * one, rtol=1e-4, atol=1e-3)


def test_without_the_entry_the_linear_takes_the_checked_path(entry):
    """A library without the fast entry (a Paddle lacking an accessor it needs): routing asks
    Python, the backward goes through the checked path (the custom op), gradients the same."""
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

    import paddle_mgrad
    from paddle_mgrad import stats

    def grads():
        paddle.seed(0)
        layer = paddle.nn.Linear(4, 3)
        MixPrecisionLayer(layer, dtype="bfloat16")
        x = paddle.randn([5, 4])
        x.stop_gradient = False
        paddle_mgrad.enable(recompute=False, fused_linear=True)
        try:
            before = stats.snapshot()["linear"]["into_main_grad"]
            for _ in range(2):
                (layer(x) ** 2).sum().backward()
            assert stats.snapshot()["linear"]["into_main_grad"] - before == 4
        finally:
            paddle_mgrad.disable()
        return [layer.weight.main_grad.numpy(), layer.bias.main_grad.numpy(), x.grad.numpy()]

    with_entry = grads()
    with ops.loader.settled(fast=None):
        assert ops.fast_route is None
        assert ops.cpu_entry("float32") is None and ops.cpu_runner("float32") is not None
        without = grads()
    for a, b in zip(with_entry, without):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_failing_entry_lookup_leaves_the_op_working(monkeypatch, caplog):
    """``_build._fast_entry`` never fails the load: a library without the symbol (or ctypes
    failing) means no fast entry and one warning."""
    import ctypes

    from paddle_mgrad.ops import _build

    class Broken:
        def __init__(self, path):
            raise OSError(f"cannot open {path}")

    monkeypatch.setattr(ctypes, "PyDLL", Broken)
    with caplog.at_level("WARNING", logger="paddle_mgrad"):
        assert _build._fast_entry("/nonexistent.so") is None
    assert "fast entry is unavailable" in caplog.text and "OSError" in caplog.text


_DT = ("float32", "bfloat16", "float16", "float64", "int32")


@st.composite
def _wgrad_calls(draw):
    """A ``pmg_fused_wgrad_add`` call of dense contiguous CPU tensors, valid or not: ranks,
    leading dims, dtypes of the inputs and of each accumulator, shapes, the two flags."""
    rank = draw(st.integers(1, 3))
    lead = draw(st.lists(st.integers(1, 3), min_size=rank - 1, max_size=rank - 1))
    k, n = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    x_dt = draw(st.sampled_from(_DT[:4])) if draw(st.integers(0, 7)) else "int32"
    dy_dt = x_dt if draw(st.integers(0, 3)) else draw(st.sampled_from(_DT))
    dy_lead = lead if draw(st.integers(0, 5)) else [d + 1 for d in lead]
    mp, has_bias = draw(st.booleans()), draw(st.booleans())

    def acc(shape):  # (after x_dt: it draws from it)
        if draw(st.booleans()):
            return None
        if not draw(st.integers(0, 4)):  # a wrong shape
            shape = [s + 1 for s in shape]
        # float32 (the multi-precision type) and x's own dtype drawn most often
        return paddle.zeros(shape, draw(st.sampled_from(("float32", x_dt) * 2 + _DT)))

    x = paddle.ones(lead + [k], "float32").astype(x_dt)
    dy = paddle.ones(dy_lead + [n], "float32").astype(dy_dt)
    return x, dy, acc([k, n]), acc([n]), mp, has_bias


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(call=_wgrad_calls())
def test_the_op_and_the_python_check_refuse_the_same_calls(entry, call):
    """Each input rule is the C++ core's (``check_args``): the op -- through the library's fast
    entry and through Paddle's custom-op dispatch, the two ways our code calls it -- refuses a
    call exactly when ``ops._inputs.check`` (what words the refusal as a FusedLinearError
    naming the shapes, and decides where the op does not run) finds it bad, over calls
    hypothesis draws."""
    x, dy, dw, db, mp, has_bias = call
    db = db if has_bias else None
    try:
        _inputs.check(x, dy, dw, db, mp, has_bias)
        python_refuses = False
    except Exception:  # noqa: BLE001 -- the verdict is compared
        python_refuses = True
    entry_refuses = entry.wgrad_add(x, dy, dw, db, mp, has_bias) is None
    try:
        with paddle.no_grad():
            ops.load().pmg_fused_wgrad_add(x, dy, dw, db, mp, has_bias)
        op_refuses = False
    except Exception:  # noqa: BLE001 -- the verdict is compared
        op_refuses = True
    event(f"refused: {python_refuses}")
    assert entry_refuses == op_refuses == python_refuses, (
        entry_refuses,
        op_refuses,
        python_refuses,
        [None if t is None else (list(t.shape), str(t.dtype)) for t in (x, dy, dw, db)],
        mp,
        has_bias,
    )


def test_the_python_route_sends_another_place_to_the_checked_backward(monkeypatch):
    """A tensor on neither the CPU nor a GPU (XPU, a custom device, CUDA-pinned memory;
    simulated here: the CPU's place string is made another's): the Python route answers its
    dtype, no place of the fast backward's common case and ``main_grads`` False (the forward
    checks them), so the checked backward runs its reference kernel."""
    monkeypatch.setattr(routing, "_CPU_PLACE", "Place(elsewhere)")
    w = paddle.zeros([4, 3])
    w.stop_gradient = False
    facts = routing._route_meta(paddle.zeros([2, 4]), w, None, False)
    assert facts == _inputs.RouteFacts("float32", None, False)
    assert facts.main_grads is False


@pytest.mark.parametrize("x_dtype, w_dtype", [("float32", "float64"), ("int32", "int32")])
def test_the_python_route_leaves_other_dtypes_to_paddle(x_dtype, w_dtype):
    """x and weight of two dtypes, or of one dtype the op does not take: the Python route
    answers None (Paddle's own linear runs, and raises or computes as it would)."""
    w = paddle.zeros([4, 3], dtype=w_dtype)
    w.stop_gradient = False
    assert routing._route_meta(paddle.zeros([2, 4], dtype=x_dtype), w, None, False) is None
