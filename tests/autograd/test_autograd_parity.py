"""Autograd through the fused linear exactly as plain Paddle: ``paddle.grad`` (with and
without ``create_graph``, wrt inputs, parameters, hidden
tensors or several), double backward (a WGAN-GP gradient penalty), parameter hooks in every
``main_grad`` mode, and a second backward through a fused linear.

Each scenario is one function run twice on the same data: on plain Paddle
(``paddle_mgrad.disable()``) and with ``paddle_mgrad.enable(fused_linear=True)``; every
returned gradient, every ``.grad`` and ``main_grad`` must agree to 1e-5 (relative to the
largest magnitude).  Each test says whether plain Paddle succeeds (asserted) or raises a named
error (asserted, and ours must raise the same type and message).  Scenarios that
crashed the process before the fix (hooks on Paddle 2.6, a second backward) run in a
subprocess, which must not end by a signal.
"""

import functools
import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from helpers import PADDLE2, ROOT, TESTS, nonzero_biases
from paddle_mgrad import stats

HERE = os.path.dirname(os.path.abspath(__file__))
F = paddle.nn.functional


# ----------------------------------------------------------------------------- helpers
def _np(t):
    return None if t is None else t.numpy().copy()


def _close(ours, plain, what):
    """Equal to 1e-5 of the largest magnitude (or both None).  An error on either side fails:
    where plain Paddle is expected to raise, :func:`_same_error` says so."""
    for run, r in (("plain", plain), ("ours", ours)):
        assert not (isinstance(r, dict) and "error" in r), (what, run, r)
    if isinstance(plain, dict):
        assert isinstance(ours, dict) and set(ours) == set(plain), (what, sorted(plain), ours)
        for k in plain:
            _close(ours[k], plain[k], f"{what}.{k}")
        return
    if isinstance(plain, (list, tuple)) and (not plain or not isinstance(plain[0], (int, float))):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(plain), (what, plain, ours)
        for i, (a, b) in enumerate(zip(ours, plain)):
            _close(a, b, f"{what}[{i}]")
        return
    if plain is None or isinstance(plain, (str, bool)):
        assert ours == plain, (what, plain, ours)
        return
    a, b = np.asarray(ours, dtype="f8"), np.asarray(plain, dtype="f8")
    assert a.shape == b.shape, (what, a.shape, b.shape)
    tol = 1e-5 * max(1.0, float(np.abs(b).max()) if b.size else 1.0)
    err = float(np.abs(a - b).max()) if b.size else 0.0
    assert err <= tol, f"{what}: max |ours - plain| = {err:.3g} > {tol:.3g}"


def _same_error(ours, plain, error, text, what):
    """Plain Paddle raised ``error`` with ``text`` in its message, and ours raised the same."""
    for run, r in (("plain", plain), ("ours", ours)):
        assert isinstance(r, dict) and r.get("error") == error, (what, run, r)
        assert text in r["message"], (what, run, r["message"])


def _both(scenario, *args, recompute=False):
    """(plain Paddle's result, ours) of ``scenario(*args)``; an exception is a result
    (``{"error": type name, "message": ...}``)."""
    out = []
    for ours in (False, True):
        paddle_mgrad.disable()
        if ours:
            paddle_mgrad.enable(recompute=recompute, fused_linear=True)
        paddle.seed(7)
        try:
            out.append(scenario(*args))
        except Exception as e:  # noqa: BLE001 - compared by type with plain Paddle's
            out.append({"error": type(e).__name__, "message": str(e)[:300]})
        finally:
            paddle_mgrad.disable()
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _in_child(name, modes):
    """Run ``_child(name, modes)`` in a fresh interpreter (once per session): for each mode,
    ``{"plain": ..., "ours": ...}``.  The child must not end by a signal."""
    code = (
        f"import sys; sys.path[:0] = [{ROOT!r}, {TESTS!r}, {HERE!r}]; import zlib; "
        f"import test_autograd_parity as t; t._child({name!r}, {modes!r})"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PADDLE_MGRAD", None)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT
    )
    assert r.returncode >= 0, (f"killed by signal {-r.returncode}", r.stderr[-3000:])
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def _child(name, modes):
    paddle.set_device("cpu")
    fn = globals()[name]
    out = {}
    for mode in modes:
        plain, ours = _both(fn, mode, recompute=mode == "recompute")
        out[mode] = {"plain": _jsonable(plain), "ours": _jsonable(ours)}
    print("RESULT " + json.dumps(out), flush=True)


def _jsonable(v):
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.ndarray):
        return v.astype("f8").tolist()
    return v


class _MLP(paddle.nn.Layer):
    def __init__(self, bias=True, act="tanh", d_in=6, d_hidden=8, d_out=3):
        super().__init__()
        b = None if bias else False
        self.l1 = paddle.nn.Linear(d_in, d_hidden, bias_attr=b)
        self.l2 = paddle.nn.Linear(d_hidden, d_out, bias_attr=b)
        nonzero_biases(self)
        self.act = act
        self.hidden = None

    def forward(self, x):
        self.hidden = self.l1(x)
        h = paddle.tanh(self.hidden) if self.act == "tanh" else F.leaky_relu(self.hidden, 0.2)
        return self.l2(h)


def _params_state(net):
    """.grad and main_grad (None when absent/unset) of every parameter."""
    out = {}
    for p in net.parameters():
        out[p.name.split(".")[-1] + "@" + str(len(out))] = {
            "grad": _np(p.grad),
            "main_grad": _np(getattr(p, "main_grad", None))
            if hasattr(p, "main_grad")
            else "absent",
        }
    return out


# ------------------------------------------------------------------ paddle.grad (19.1)
WRT = ["x", "params", "x+params", "x+weights", "hidden", "x+hidden", "no_grad_x", "no_grad_w1"]
BEFORE = ["fresh", "after_backward", "after_clear_to_zero", "main_grad", "main_grad_after_backward"]


def _grad_scenario(wrt, before, create_graph, bias, act):
    rs = np.random.RandomState(3)
    net = _MLP(bias=bias, act=act)
    if before.startswith("main_grad"):
        MixPrecisionLayer(net, dtype="bfloat16")
    # Paddle 2.6's own matmul double grad gives a 3-D x's [K, N] weight a [1, K, N] gradient
    # (MixPrecisionLayer's hook then fails on it; 3.x fixed it): 2-D x there
    shape = [10, 6] if PADDLE2 and create_graph else [2, 5, 6]
    x = paddle.to_tensor(rs.standard_normal(shape).astype("float32"))
    x.stop_gradient = False
    if before in ("after_backward", "after_clear_to_zero", "main_grad_after_backward"):
        (net(x) ** 2).sum().backward()
        if before == "after_clear_to_zero":
            for p in net.parameters():
                p.clear_gradient(set_to_zero=True)
    x.clear_gradient()
    before_fn = stats.linear["functional_backward"]
    y = net(x)
    loss = (y**2).sum()
    weights = [net.l1.weight, net.l2.weight]
    no_grad_vars = None
    if wrt == "x":
        inputs = [x]
    elif wrt == "params":
        inputs = list(net.parameters())
    elif wrt == "x+params":
        inputs = [x] + list(net.parameters())
    elif wrt == "x+weights":
        inputs = [x] + weights
    elif wrt == "hidden":
        inputs = [net.hidden]
    elif wrt == "x+hidden":
        inputs = [x, net.hidden]
    else:  # a no_grad_vars leaf cut off (Paddle itself fails on a non-leaf one)
        inputs = [net.l2.weight, x, net.l1.weight]
        no_grad_vars = [x] if wrt == "no_grad_x" else [net.l1.weight]
    grads = paddle.grad(
        loss, inputs, create_graph=create_graph, allow_unused=True, no_grad_vars=no_grad_vars
    )
    result = {
        "grads": [_np(g) for g in grads],
        "state_after_grad": _params_state(net),
        "x.grad": _np(x.grad),
    }
    if create_graph:  # double backward: the ordinary pass through both graphs
        penalty = sum((g**2).sum() for g in grads if g is not None)
        penalty.backward()
        result["state_after_double_backward"] = _params_state(net)
        result["x.grad_after_double_backward"] = _np(x.grad)
    result["ran_functional"] = stats.linear["functional_backward"] > before_fn
    return result


@pytest.mark.parametrize(
    "bias,act", [(True, "tanh"), (False, "leaky_relu")], ids=["bias-tanh", "nobias-leaky_relu"]
)
@pytest.mark.parametrize("create_graph", [False, True], ids=["grad", "create_graph"])
@pytest.mark.parametrize("before", BEFORE)
@pytest.mark.parametrize("wrt", WRT)
def test_paddle_grad_equals_plain_paddle(wrt, before, create_graph, bias, act):
    """paddle.grad returns what plain Paddle returns and leaves every .grad and main_grad
    as plain Paddle leaves them (untouched); with create_graph the double backward that
    follows gives plain Paddle's gradients.  Before the fix: 'should return None at k
    position' (fresh layer), or dW/db silently added into .grad / main_grad."""
    plain, ours = _both(_grad_scenario, wrt, before, create_graph, bias, act)
    assert "error" not in plain, plain
    plain_ran = plain.pop("ran_functional")
    assert not plain_ran
    if "error" not in ours:
        ran = ours.pop("ran_functional")
        # every pass whose graph holds a fused linear on the way to the inputs ran our
        # functional backward (wrt hidden: only the second linear is on the way)
        assert ran, "the fused linear's functional path did not run"
    _close(ours, plain, "result")


def _wgan_gp_scenario(act, clear, main_grad, steps=3):
    """A WGAN-GP critic trained a few steps: gradient penalty via paddle.grad(create_graph)."""
    rs = np.random.RandomState(11)
    net = paddle.nn.Sequential(
        paddle.nn.Linear(4, 16),
        paddle.nn.Tanh() if act == "tanh" else paddle.nn.LeakyReLU(0.2),
        paddle.nn.Linear(16, 16),
        paddle.nn.Tanh() if act == "tanh" else paddle.nn.LeakyReLU(0.2),
        paddle.nn.Linear(16, 1),
    )
    opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=net.parameters())
    if main_grad:
        from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionOptimizer

        net = MixPrecisionLayer(net, dtype="bfloat16")
        opt = MixPrecisionOptimizer(opt)
    losses = []
    for _ in range(steps):
        real = paddle.to_tensor(rs.standard_normal([8, 4]).astype("float32"))
        fake = paddle.to_tensor(rs.standard_normal([8, 4]).astype("float32") * 0.5 + 1)
        alpha = paddle.to_tensor(rs.uniform(size=[8, 1]).astype("float32"))
        interp = alpha * real + (1 - alpha) * fake
        interp.stop_gradient = False
        (g,) = paddle.grad(net(interp).sum(), interp, create_graph=True)
        gp = ((paddle.sqrt((g**2).sum(axis=1) + 1e-12) - 1) ** 2).mean()
        loss = net(fake).mean() - net(real).mean() + 10 * gp
        loss.backward()
        losses.append(float(loss))
        opt.step()
        if clear == "none":
            opt.clear_grad()
        else:
            opt.clear_grad(set_to_zero=clear == "zero")
    return {"losses": losses, "params": [_np(p) for p in net.parameters()]}


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("clear", ["zero", "none_set"])
@pytest.mark.parametrize("act", ["leaky_relu", "tanh"])
def test_gradient_penalty_trains_as_plain_paddle(act, clear, main_grad):
    """Double backward through the fused linear: a WGAN-GP critic (gradient penalty from
    paddle.grad(create_graph=True), then loss.backward(), SGD, clear_grad) ends with plain
    Paddle's parameters.  tanh makes the second pass run the critic's forward nodes again
    (a paddle.grad pass runs a copy; the ordinary pass then runs the originals)."""
    plain, ours = _both(_wgan_gp_scenario, act, clear, main_grad)
    assert "error" not in plain, plain
    _close(ours, plain, "wgan-gp")


def test_paddle_grad_alias_and_no_side_effect_on_fused_path():
    """paddle.autograd.grad is the same function (the registry swaps its code, so every
    alias runs the wrapper); an ordinary backward after paddle.grad still fuses in place."""
    paddle_mgrad.enable(recompute=False, fused_linear=True)
    lin = paddle.nn.Linear(4, 3)
    MixPrecisionLayer(lin, dtype="bfloat16")
    x = paddle.randn([5, 4])
    x.stop_gradient = False
    before = dict(stats.linear)
    (gx,) = paddle.autograd.grad(lin(x).sum(), x)
    np.testing.assert_allclose(gx.numpy(), np.ones([5, 3]) @ lin.weight.numpy().T, rtol=1e-5)
    assert lin.weight.main_grad is None and lin.bias.main_grad is None
    lin(x).sum().backward()
    assert stats.linear["functional_backward"] == before["functional_backward"] + 1
    assert stats.linear["into_main_grad"] == before["into_main_grad"] + 2


# ------------------------------------------------------------------- hooks (19.2)
HOOK_MODES = (
    "plain",
    "grad_present",
    "main_grad_attr",
    "mpl_after",
    "mpl_before",
    "observe_only",
    "bias_only",
    "removed",
    "recompute",
)


def _hooks_scenario(mode, steps=3):
    rs = np.random.RandomState(5)
    lin = paddle.nn.Linear(4, 3)
    seen = []

    def double(g):
        seen.append(None if g is None else list(g.shape))
        if g is None or not g._is_initialized():  # MixPrecisionLayer's hook clears its input
            return None
        return g * 2

    def observe(g):
        seen.append(None if g is None else float(g.astype("float64").sum()))

    if mode == "main_grad_attr":  # amp_master_grad style attribute without MixPrecisionLayer
        lin.weight.main_grad = None
        lin.bias.main_grad = None
    handles = []
    if mode == "mpl_before":
        handles = [lin.weight.register_hook(double), lin.bias.register_hook(double)]
    if mode.startswith("mpl"):
        MixPrecisionLayer(lin, dtype="bfloat16")
    if mode == "observe_only":
        handles = [lin.weight.register_hook(observe), lin.bias.register_hook(observe)]
    elif mode == "bias_only":
        handles = [lin.bias.register_hook(double)]
    elif mode != "mpl_before":
        handles = [lin.weight.register_hook(double), lin.bias.register_hook(double)]
    states, ptrs = [], []
    for step in range(steps):
        x = paddle.to_tensor(rs.standard_normal([5, 4]).astype("float32"))
        x.stop_gradient = False
        if mode == "recompute":
            from paddle.distributed.fleet.utils import recompute

            y = recompute(lin, x, use_reentrant=False, preserve_rng_state=False)
        else:
            y = lin(x)
        (y * y).sum().backward()
        states.append(_params_state(lin))
        ptrs.append(None if lin.weight.grad is None else lin.weight.grad.data_ptr())
        if mode == "grad_present":
            for p in lin.parameters():
                p.clear_gradient(set_to_zero=True)
        if mode == "removed" and step == 0:
            assert all(h.remove() for h in handles)
    return {
        "states": states,
        "seen": seen,
        "weight_grad_in_place": ptrs[-1] is not None and ptrs[-1] == ptrs[-2],
    }


@pytest.mark.probe
@pytest.mark.parametrize("mode", HOOK_MODES)
def test_parameter_hooks_as_plain_paddle(mode):
    """A user hook on a weight or bias sees the gradient and its return value takes effect
    exactly as in plain Paddle, in every main_grad mode (MixPrecisionLayer's own hook changes
    plain behaviour too: registered before it, the doubled gradient reaches .grad and its
    assert fires on the next step, in both runs).  What goes wrong otherwise: the hook sees
    None on Paddle 3.3 (TypeError in the user's lambda), and the process dies on Paddle 2.6.
    In a subprocess: never a signal."""
    res = _in_child("_hooks_scenario", HOOK_MODES)[mode]
    plain, ours = dict(res["plain"]), dict(res["ours"])  # (a copy: the result is cached)
    if mode == "mpl_before":  # MixPrecisionLayer's assert on the second step, in both runs
        _same_error(ours, plain, "OSError", "param.grad should be None", mode)
        return
    assert "error" not in plain, plain
    assert "error" not in ours, ours
    plain_in_place = plain.pop("weight_grad_in_place")
    ours_in_place = ours.pop("weight_grad_in_place")
    _close(ours, plain, mode)
    # .grad is accumulated in place exactly where plain Paddle's is
    assert ours_in_place == plain_in_place, (ours_in_place, plain_in_place)
    if mode in ("bias_only", "removed"):
        # parameters without a (live) user hook keep the fused in-place path
        assert ours_in_place, "the unhooked weight's .grad was not accumulated in place"


def test_hook_count_follows_register_and_remove():
    from paddle_mgrad.autograd import param_hooks

    paddle_mgrad.enable(recompute=False, fused_linear=True)
    p = paddle.create_parameter([3], "float32")
    assert not param_hooks.has_user_hooks(p)
    h1 = p.register_hook(lambda g: g)
    h2 = p.register_hook(lambda g: g)
    assert param_hooks.has_user_hooks(p)
    assert h1.remove()
    assert param_hooks.has_user_hooks(p)
    with pytest.warns(RuntimeWarning):  # Paddle's own warning; the count changes nothing
        h1.remove()
    assert param_hooks.has_user_hooks(p)
    assert h2.remove()
    assert not param_hooks.has_user_hooks(p)


# ----------------------------------------------- a second backward (15, crash 3)
RETAIN_MODES = (
    "retain_then_backward",
    "backward_twice",
    "retain_then_grad",
    "retain_then_grad_through_tanh",
    "main_grad_retain",
)


def _second_backward_scenario(mode):
    paddle.seed(3)
    lin = paddle.nn.Linear(4, 3)
    if mode.startswith("main_grad"):
        MixPrecisionLayer(lin, dtype="bfloat16")
    x = paddle.randn([5, 4])
    x.stop_gradient = False
    y = lin(x)
    out = {}
    try:
        if mode in ("retain_then_backward", "main_grad_retain"):
            y.sum().backward(retain_graph=True)
            y.sum().backward()
        elif mode == "backward_twice":
            y.sum().backward()
            y.sum().backward()
        elif mode == "retain_then_grad":
            y.sum().backward(retain_graph=True)
            out["grad"] = _np(paddle.grad(y.sum(), x)[0])
        else:
            z = paddle.tanh(y)
            del y
            z.sum().backward(retain_graph=True)
            out["grad"] = _np(paddle.grad(z.sum(), x)[0])
        out["state"] = _params_state(lin)
    except Exception as e:  # noqa: BLE001
        out["error"] = type(e).__name__
        out["message"] = str(e)[:400]
    # the process and grad mode are fine afterwards: a new forward/backward is right
    out["grad_enabled_after"] = paddle.is_grad_enabled()
    lin2 = paddle.nn.Linear(4, 3)
    x2 = paddle.ones([2, 4])
    lin2(x2).sum().backward()
    out["fresh_bias_grad"] = _np(lin2.bias.grad)
    return out


@pytest.mark.probe
@pytest.mark.parametrize("mode", RETAIN_MODES)
def test_second_backward_is_an_error_not_a_crash(mode):
    """y.sum().backward(retain_graph=True); y.sum().backward() through a fused linear: plain
    Paddle accumulates the gradient twice; Paddle's PyLayer frees its context after its first
    backward (a second run -- backward or paddle.grad -- segfaults), so ours raises a
    FusedLinearError naming the cause before Paddle can crash (the documented difference).
    Plain Paddle's second backward without retain_graph is an error too."""
    res = _in_child("_second_backward_scenario", RETAIN_MODES)[mode]
    plain, ours = res["plain"], res["ours"]
    assert ours.get("error") == "FusedLinearError", ours
    assert "already ran" in ours["message"] and "retain_graph" in ours["message"]
    if mode == "backward_twice":
        assert "error" in plain  # plain Paddle refuses it as well
    else:
        assert "error" not in plain, plain
    for r in (plain, ours):
        assert r["grad_enabled_after"] is True
        np.testing.assert_allclose(r["fresh_bias_grad"], [2.0, 2.0, 2.0])


def test_graph_copies_run_any_number_of_times():
    """paddle.grad runs a copy of the graph: any number of paddle.grad passes, then one
    ordinary backward, through the same fused linear -- as plain Paddle."""

    def scenario():
        lin = paddle.nn.Linear(4, 3)
        x = paddle.randn([5, 4])
        x.stop_gradient = False
        y = paddle.tanh(lin(x))
        g1 = paddle.grad(y.sum(), x, retain_graph=True)[0]
        g2 = paddle.grad(y.sum(), [x, lin.weight], retain_graph=True)
        y.sum().backward()
        return {
            "g1": _np(g1),
            "g2": [_np(g) for g in g2],
            "state": _params_state(lin),
            "x.grad": _np(x.grad),
        }

    plain, ours = _both(scenario)
    assert "error" not in plain, plain
    _close(ours, plain, "copies")


def _recompute_grad_scenario(reentrant, create_graph):
    from paddle.distributed.fleet.utils import recompute

    rs = np.random.RandomState(2)
    l1, l2 = paddle.nn.Linear(4, 8), paddle.nn.Linear(8, 3)
    x = paddle.to_tensor(rs.standard_normal([5, 4]).astype("float32"))
    x.stop_gradient = False
    y = recompute(
        lambda t: l2(paddle.tanh(l1(t))), x, use_reentrant=reentrant, preserve_rng_state=False
    )
    grads = paddle.grad((y**2).sum(), [x, l1.weight], create_graph=create_graph)
    return {
        "grads": [_np(g) for g in grads],
        "state": {"l1": _params_state(l1), "l2": _params_state(l2)},
    }


@pytest.mark.parametrize("create_graph", [False, True], ids=["grad", "create_graph"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_paddle_grad_through_recompute(reentrant, create_graph):
    """paddle.grad through Paddle's recompute with both of paddle_mgrad's features on (our
    recompute, the fused linears inside it, recomputed in the functional pass): plain
    Paddle's result -- or, reentrant, plain Paddle's error: the reentrant PyLayer detaches its
    inputs, so the weight asked for is not in the graph paddle.grad walks."""
    plain, ours = _both(_recompute_grad_scenario, reentrant, create_graph, recompute=True)
    if reentrant:
        _same_error(ours, plain, "ValueError", "does not appear in the backward graph", "recompute")
        return
    assert "error" not in plain, plain
    _close(ours, plain, "recompute")


@pytest.mark.parametrize("create_graph", [False, True], ids=["grad", "create_graph"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_paddle_grad_through_a_transposed_weight(bias, create_graph):
    """``paddle.incubate.nn.functional.fused_linear(..., transpose_weight=True)`` (an ``[N, K]``
    weight) in a ``paddle.grad`` pass: the gradients of x, the weight and the bias -- and with
    create_graph, those of the double backward that follows -- equal those of the same product
    in plain Paddle ops (Paddle's own incubate op has no CPU kernel with a bias); the pass
    accumulates nothing."""
    from paddle.incubate.nn.functional import fused_linear as inc

    rs = np.random.RandomState(3)
    # 2-D x: Paddle 2.6's double backward of a broadcast matmul gives the weight a [1, N, K]
    # gradient (plain Paddle's own result, compared with here)
    xv, wv, bv = (rs.standard_normal(s).astype("float32") for s in ([6, 4], [5, 4], [5]))

    def scenario():
        x = paddle.to_tensor(xv, stop_gradient=False)
        w, b = (paddle.to_tensor(v, stop_gradient=False) for v in (wv, bv))
        ins = [x, w, b] if bias else [x, w]
        before = stats.linear["functional_backward"]
        if paddle_mgrad.enabled()["fused_linear"]:
            y = inc(x, w, b if bias else None, transpose_weight=True)
        else:
            y = paddle.matmul(x, w, transpose_y=True) + (b if bias else 0)
        grads = paddle.grad((paddle.tanh(y) ** 2).sum(), ins, create_graph=create_graph)
        result = {"grads": [_np(g) for g in grads]}
        result["untouched"] = [t.grad is None for t in ins]
        if create_graph:
            sum((g * g).sum() for g in grads).backward()
            result["double"] = [_np(t.grad) for t in ins]
        result["functional"] = stats.linear["functional_backward"] - before
        return result

    plain, ours = _both(scenario)
    assert "error" not in plain and "error" not in ours, (plain, ours)
    assert plain.pop("functional") == 0 and ours.pop("functional") >= 1  # our paddle.grad path
    assert plain["untouched"] == [True] * len(plain["untouched"])
    _close(ours, plain, "result")


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_paddle_grad_finds_a_node_whose_output_died(monkeypatch, bias):
    """The first ``paddle.grad`` of a process, through a fused linear whose output no longer
    lives (``tanh`` keeps its own output, not its input): the pass finds our node by its edges
    (the forward's inputs) and returns plain Paddle's gradients.  (Once a process has run a
    ``paddle.grad``, forwards record their node's address and this path is not taken: the
    test starts from a process state before the first one.)"""
    from paddle_mgrad.autograd import passes

    rs = np.random.RandomState(8)
    xv, wv, bv = (rs.standard_normal(s).astype("float32") for s in ([3, 4], [4, 5], [5]))

    def scenario():
        x = paddle.to_tensor(xv, stop_gradient=False)
        w, b = (paddle.to_tensor(v, stop_gradient=False) for v in (wv, bv))
        monkeypatch.setattr(passes, "_functional_seen", False)
        out = paddle.tanh(F.linear(x, w, b if bias else None)).sum()  # (the linear's output dies)
        before = stats.linear["functional_backward"]
        grads = paddle.grad(out, [x, w])
        return {
            "grads": [_np(g) for g in grads],
            "functional": stats.linear["functional_backward"] - before,
        }

    plain, ours = _both(scenario)
    assert "error" not in plain and "error" not in ours, (plain, ours)
    assert plain.pop("functional") == 0 and ours.pop("functional") == 1  # our paddle.grad path
    _close(ours, plain, "grads")
