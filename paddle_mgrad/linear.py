"""A linear layer whose weight/bias gradients accumulate in place into fp32 ``main_grad``.

Forward is Paddle's own ``linear``.  In an ordinary ``backward()`` the PyLayer computes
``dx = dy · Wᵀ`` and, for each of weight and bias that needs a gradient:

* if the parameter has a ``main_grad`` attribute (``--amp_master_grad``,
  ``MixPrecisionLayer``): the fused op accumulates ``xᵀ·dy`` (beta = 1) straight
  into it, allocating it **on the real parameter** when it is ``None`` (first
  micro-step) in the parameter's master-gradient dtype ``ops.mp_dtype`` (float32;
  float64 for float64 parameters); the PyLayer returns ``None`` for that gradient, so
  ``param.grad`` stays ``None`` and the parameter's hooks still fire once;
* otherwise, if ``param.grad`` exists: the op accumulates into it in place (and clears
  Paddle's "fake empty" mark that ``clear_grad(set_to_zero=True)`` leaves, see
  :func:`_written`);
* otherwise -- or when the parameter has a user gradient hook (:mod:`.autograd.param_hooks`),
  which must see the gradient and may replace it -- a fresh gradient is returned (in the
  parameter's dtype) and Paddle accumulates it as without us.

In a ``paddle.grad`` pass (:mod:`.autograd.passes`) it returns plain gradients exactly
at the slots Paddle wants, computed with differentiable Paddle ops (double backward), and
touches neither ``.grad`` nor ``main_grad``.  Under ``auto_cast`` O1 the product may run in
bf16/fp16 for float32 ``x``/weight: ``dx`` is computed in ``dy``'s dtype and returned in
``x``'s, the weight gradient from ``x`` cast as the forward cast it.

Recompute-proof: only ``x`` goes through ``ctx.save_for_backward`` (so that
recompute may drop it); the parameters are kept on ``ctx`` as Python
attributes, which no saved-tensor hook touches.  Paddle's non-reentrant
recompute would hand back a ``<name>cpy`` copy without ``main_grad``; the
attribute keeps the real object (like Megatron keeps what it needs on ``ctx``).
Holding the parameter costs nothing: the model holds it anyway.

Internal interface (``INTERNAL``): the fleet linears (:mod:`paddle_mgrad.fleet.overlap_linear`,
:mod:`paddle_mgrad.fleet.sp_overlap_linear`) are the same PyLayer with a collective around the
input gradient, so they share this module's forward stash, main_grad checks and gradient paths
by these names.  They are internal to paddle_mgrad -- not in ``__all__``, not re-exported by the
package, free to change with it -- but named without an underscore because another module
calls them; everything with an underscore is this module's own.
"""

from __future__ import annotations

from paddle import _C_ops

from . import _compat, ops, registry, stats
from ._compat import LINEAR_IS_C_OP, MAIN_GRAD_IN_DICT, NO_ATTRS, paddle, tracer
from .autograd import (
    backward_errors,
    param_hooks,
    passes as autograd_passes,
    recomputing as _recomputing,
)
from .errors import EnvError, FusedLinearError
from .registry import original
from .routing import route

__all__ = ["FusedLinearWithGradAdd", "fused_linear"]

# Internal to paddle_mgrad (module docstring): what other modules of the package call.
INTERNAL = (
    "check_main_grad",  # main_grad of the parameter's master-gradient dtype, or None
    "check_main_grads",  # ... for weight and bias, when they need a gradient
    "stash_for_backward",  # forward-time ctx setup of our linear PyLayers
    "weight_and_bias_grads",  # the fused op into main_grad/.grad (ordinary backward)
    "plain_param_grads",  # plain weight/bias gradients (a paddle.grad pass)
    "functional_grads",  # a whole paddle.grad-pass backward, dx supplied by the caller
    "input_grad",  # dx = dy · Wᵀ in dy's dtype, optionally cast back to x's
)

# Set on the copies Paddle's reentrant recompute makes of parameter arguments:
# the real parameter, whose main_grad the backward must write.
ORIGIN = "_paddle_mgrad_origin"


def _wants_grad(p) -> bool:
    """Whether the (optional) parameter ``p`` needs a gradient."""
    return p is not None and not p.stop_gradient


def _accumulator(p):
    """Where p's gradient goes: ('main_grad', t|None), ('grad', t) or ('fresh', None).

    A parameter with a user gradient hook (:mod:`.autograd.param_hooks`) gets a fresh gradient:
    Paddle hands it to the hooks and accumulates the hooks' result, as without us."""
    if param_hooks.has_user_hooks(p):
        return "fresh", None
    if hasattr(p, "main_grad"):
        return "main_grad", p.main_grad
    g = p.grad
    if g is not None and (not hasattr(g, "_is_initialized") or g._is_initialized()):
        return "grad", g
    return "fresh", None


def _written(p):
    """``p.grad`` was accumulated in place: it is no longer "fake empty".

    ``clear_grad(set_to_zero=True)`` (the optimizers' default) zero-fills ``.grad`` and marks
    the parameter's accumulation node *fake empty*: the next gradient Paddle accumulates
    *replaces* ``.grad`` instead of adding to it.  When the parameter also gets a gradient
    from another op (a weight shared with a matmul, a tied embedding, a double backward),
    that replacement would drop what we just added in place -- so we clear the mark."""
    unset = getattr(p, "_unset_fake_empty", None)  # (a stand-in for a parameter may lack it)
    if unset is not None:
        unset()


# ``ops._dtype_name``: a dtype's name with one cheap lookup (every question to a Paddle dtype
# object -- str(), ==, hash -- is a pybind call of microseconds; see ops._inputs.dtype_name)
_dtname = ops._dtype_name


def check_main_grad(p, p_name=None):
    """``p.main_grad`` must be None (allocated by the first backward) or of the parameter's
    master-gradient dtype, ``ops.mp_dtype(p.dtype)`` -- float32, float64 for a float64
    parameter: the op's accumulator rule (``ops.acc_dtypes``), the dtype the first backward
    allocates.  ``p_name``: ``p``'s dtype name, when the caller knows it."""
    mg = getattr(p, "main_grad", None)
    if mg is not None:
        _check_main_grad_dtype(p, p_name or _dtname(p.dtype), _dtname(mg.dtype), mg)


def _check_main_grad_dtype(p, p_name, mg_name, mg):
    """:func:`check_main_grad` for a ``main_grad`` ``mg`` whose dtype names the caller has
    (``p_name``: the parameter's, ``mg_name``: ``mg``'s): the rule and its error."""
    want = ops.mp_dtype(p_name)
    if mg_name != want:
        raise FusedLinearError(
            f"{p.name}.main_grad is {mg.dtype} {list(mg.shape)}, expected {want} "
            f"(the master gradient of a {p_name} parameter)"
        )


def check_main_grads(weight, bias, p_name=None):
    """:func:`check_main_grad` for each of ``weight``/``bias`` that needs a gradient.
    ``p_name``: the dtype name both parameters have, when the caller knows it (one question
    to a Paddle dtype fewer per parameter)."""
    for p in (weight, bias):
        if p is not None and not p.stop_gradient:
            check_main_grad(p, p_name)


# what our linears' forward needs installed: backward_errors' wrappers, param_hooks' register_hook
_STASH_KEYS = backward_errors.ENTRY_KEYS | {"Tensor.register_hook"}


def stash_for_backward(ctx, x, weight, bias, p_name=None, checked=False):
    """The forward-time ctx setup shared by our PyLayers (this linear, the overlap linears).

    Checks every parameter that needs a gradient with :func:`check_main_grad` -- a
    non-fp32 ``main_grad`` fails here, in forward, with a :class:`FusedLinearError`, not
    deep inside Paddle's backward engine -- then saves only ``x`` with
    ``save_for_backward`` (recompute may drop it) and keeps ``weight``/``bias`` on ``ctx``
    as the real objects, out of reach of saved-tensor hooks (module docstring).  ``p_name``:
    the dtype name of ``weight`` and ``bias`` when the caller knows it; ``checked``: the
    op library's fast entry found every ``main_grad`` of the master dtype already
    (``RouteFacts.main_grads``): nothing to check.
    """
    if not checked:
        try:
            check_main_grads(weight, bias, p_name)
        except FusedLinearError as e:
            # a forward re-run by a recomputation runs in backward: the error reaches the
            # caller of backward() as itself, not as Paddle's OSError
            backward_errors.record(e)
            raise
    if not registry.all_installed(_STASH_KEYS):  # one set operation once all are in
        backward_errors.install()  # a FusedLinearError in backward keeps its type; paddle.grad
        registry.ensure("Tensor.register_hook")  # fused_linear without enable()
    autograd_passes.stash_guard(ctx)
    ctx.save_for_backward(x)
    ctx.weight = weight
    ctx.bias = bias
    ctx.x_needs_grad = not x.stop_gradient


def weight_and_bias_grads(x, dy, weight, bias, transpose_weight, names=None):
    """Run the fused op once for weight (and bias); returns grads to hand to Paddle.

    Runs in backward: a :class:`FusedLinearError` (say, a ``main_grad`` swapped for one of
    another shape after the forward) or an :class:`EnvError` (a variable the op reads holds
    garbage) is recorded so that it reaches the caller of ``backward()`` as itself, not as
    Paddle's ``OSError`` (:mod:`.autograd.backward_errors`)."""
    try:
        return _fused_grads(x, dy, weight, bias, transpose_weight, names)
    except (FusedLinearError, EnvError) as e:
        backward_errors.record(e)
        raise


def _compute_dtypes(x, dy):
    """``x`` and ``dy`` in the dtype the forward product ran in.

    They differ when Paddle's linear ran under ``paddle.amp.auto_cast`` (O1): ``x`` and the
    weight are float32, the product ran in bf16/fp16 and returned it (matmul is on the white
    list; no bias), so ``dy`` is bf16/fp16.  The narrower dtype is the product's: ``x`` is
    cast to it, as autocast cast it in forward.  (A wider ``dy`` -- no autocast does that --
    is cast to ``x``'s dtype.)"""
    if _dtname(dy.dtype) == _dtname(x.dtype):
        return x, dy
    if dy.element_size() < x.element_size():
        return x.astype(dy.dtype), dy
    return x, dy.astype(x.dtype)


def input_grad(dy, weight, transpose_weight=False, x_dtype=None, names=None):
    """``dx``: ``dy · Wᵀ`` (``dy · W`` for a transposed ``[N, K]`` weight) computed in ``dy``'s
    dtype (the weight cast to it, as autocast did in forward) and returned in ``x_dtype`` --
    or in ``dy``'s dtype when ``x_dtype`` is None: the fleet linears, whose collective runs on
    ``dx`` in that dtype, as fleet's own.  Differentiable (create_graph).  ``names``: the dtype
    names of (x, dy, weight) when the caller has them."""
    if names is None:
        names = (
            None if x_dtype is None else _dtname(x_dtype),
            _dtname(dy.dtype),
            _dtname(weight.dtype),
        )
    x_name, dy_name, w_name = names
    w = weight if w_name == dy_name else weight.astype(dy.dtype)
    # paddle.matmul in dynamic mode (a backward always is), without its Python frame
    dx = _C_ops.matmul(dy, w, False, not transpose_weight)
    return dx if x_dtype is None or dy_name == x_name else dx.astype(x_dtype)


def plain_param_grads(x, dy, weight, bias, transpose_weight, want_w, want_b):
    """The weight/bias gradients as Paddle's linear computes them -- new tensors in the
    parameters' dtypes, nothing accumulated -- from differentiable Paddle ops (a
    ``paddle.grad`` pass; with create_graph the result has a graph)."""
    dw = db = None
    if not (want_w or want_b):
        return dw, db
    x, dy = _compute_dtypes(x, dy)
    dy2 = dy.reshape([-1, dy.shape[-1]])
    if want_w:
        x2 = x.reshape([-1, x.shape[-1]])
        if transpose_weight:  # weight [N, K]: dW = dyᵀ · x
            dw = paddle.matmul(dy2, x2, transpose_x=True)
        else:
            dw = paddle.matmul(x2, dy2, transpose_x=True)
        if dw.dtype != weight.dtype:
            dw = dw.astype(weight.dtype)
    if want_b:
        db = dy2.sum(axis=0)
        if db.dtype != bias.dtype:
            db = db.astype(bias.dtype)
    return dw, db


# input dtypes whose common-case backward computes dx inside our op (Paddle's CPU matmul kernel
# takes float32 and float64; there is no bf16/fp16 matmul on Paddle's CPU)
_ONE_CALL_DTYPES = frozenset(("float32", "float64"))


def _backward_fast(ctx, x, dy, weight, bias):
    """The ordinary backward of :class:`FusedLinearWithGradAdd` in its common case, in few steps.

    The forward found (``ctx.facts``, from :func:`.routing.route`): ``x``, ``weight`` (``[K, N]``) and
    ``bias`` (or None) plain dense tensors of one dtype, K, N > 0, on the CPU or on a GPU.
    Here: grad mode off (no ``create_graph``), ``dy`` of that dtype (no autocast), weight and
    bias needing a gradient, each with a ``main_grad`` attribute and no user gradient hook,
    ``main_grad`` contiguous or None.  Then the op's kernel runs straight into ``main_grad``
    (or allocates it: first micro-step) and checks the rest itself before writing anything: the
    accumulator dtypes (``main_grad`` must be the master-gradient dtype), shapes and places.  For float32 and
    float64 the same call also computes ``dx`` (by Paddle's own matmul kernel).  The call goes
    through the op library's fast entry (:func:`paddle_mgrad.ops.cpu_entry`), not Paddle's
    custom-op dispatch: a linear's whole backward is one call from Python.  On a GPU (only
    where our CUDA op is the GPU tier, :func:`paddle_mgrad.ops.gpu_entry`) the entry runs the
    weight-gradient kernel and ``dx`` is Paddle's matmul, as in the checked path, without its
    checks in Python.

    Returns the backward's result, or None for any other case, and when the kernel refuses the
    call: nothing was written then, and the general path (:func:`weight_and_bias_grads`) runs
    every check in Python and raises the usual error."""
    x_name, where = ctx.facts.dtype, ctx.facts.where
    if tracer()._has_grad or weight.stop_gradient or not MAIN_GRAD_IN_DICT:
        return None
    if _dtname(dy.dtype) != x_name:
        return None
    # Paddle 2.6's plain (non-parameter) tensors have no __dict__, hence no main_grad either
    wd = getattr(weight, "__dict__", NO_ATTRS)
    hooked = param_hooks.hooked  # empty unless some tensor got a user hook: one test then
    if "main_grad" not in wd or (hooked and param_hooks.has_user_hooks(weight)):
        return None
    w_acc = wd["main_grad"]
    if bias is not None:
        bd = getattr(bias, "__dict__", NO_ATTRS)
        if (
            bias.stop_gradient
            or "main_grad" not in bd
            or (hooked and param_hooks.has_user_hooks(bias))
        ):
            return None
        b_acc = bd["main_grad"]
    else:
        b_acc = None
    # One call into the op library's fast entry, without Paddle's custom-op dispatch (that
    # costs the host more than the kernels at small shapes).  None: a tensor the entry does not
    # take -- x or dy strided (the checked path copies them), an accumulator strided (written
    # through by the checked path) -- or refused by the kernel before it wrote anything.
    if where == "cpu":
        entry = ops.cpu_entry(x_name)
        one_call = ctx.x_needs_grad and x_name in _ONE_CALL_DTYPES
    else:  # "gpu": our CUDA op's tier only (Paddle's fused op and the reference: checked path)
        entry = ops.gpu_entry()
        one_call = False
    if entry is None:
        return None
    if one_call:  # dx too, in the same call, by Paddle's own matmul kernel
        done = entry.linear_bwd(x, dy, weight, w_acc, b_acc, bias is not None)
    else:
        done = entry.wgrad_add(x, dy, w_acc, b_acc, True, bias is not None)
    if done is None:
        return None
    dx, dw, db = done
    if dx is None and ctx.x_needs_grad:
        dx = _C_ops.matmul(dy, weight, False, True)
    fused = stats.fused_params
    fused.add(weight.name)
    if w_acc is None:
        weight.main_grad = dw  # first micro-step: mp dtype, on the real parameter
    if bias is None:
        stats.bump2(stats.linear, "backward", 1, "into_main_grad", 1)
        return dx, None
    fused.add(bias.name)
    if b_acc is None:
        bias.main_grad = db
    stats.bump2(stats.linear, "backward", 1, "into_main_grad", 2)
    return dx, None, None


def _fused_grads(x, dy, weight, bias, transpose_weight, names=None):
    want_w, want_b = _wants_grad(weight), _wants_grad(bias)
    if not (want_w or want_b):
        return None, None
    # Each dtype is asked once (every question to a Paddle dtype is a pybind call); ``names``:
    # those of (x, dy, weight) when the caller has them.
    if names is None:
        names = (_dtname(x.dtype), _dtname(dy.dtype), _dtname(weight.dtype))
    x_name, dy_name, w_name = names
    if x_name != dy_name:  # autocast (O1): see _compute_dtypes
        x, dy = _compute_dtypes(x, dy)
        x_name = _dtname(x.dtype)
    mp_name = ops.mp_dtype(x_name)
    w_kind, w_acc = _accumulator(weight) if want_w else (None, None)
    b_kind, b_acc = _accumulator(bias) if want_b else (None, None)
    w_acc_name = _dtname(w_acc.dtype) if w_acc is not None else None
    if w_kind == "grad" and w_acc_name not in ops.acc_dtypes(x_name, False):
        # The op's accumulator rule (ops.acc_dtypes: the input dtype or its multi-precision
        # type -- float64 only for float64 inputs) refuses this .grad: return a fresh
        # gradient instead, which Paddle adds to .grad itself.
        w_acc = w_acc_name = None
        w_kind = "fresh"
    if w_kind == "main_grad" and w_acc is not None:
        _check_main_grad_dtype(weight, w_name, w_acc_name, w_acc)
    if b_kind == "main_grad" and b_acc is not None:
        check_main_grad(bias)
    # multi-precision accumulators whenever the destination is main_grad or a .grad of that
    # dtype, or the parameter itself has it (float32 for float32/bf16/fp16 inputs)
    mp = w_kind == "main_grad" or w_acc_name == mp_name or w_name == mp_name

    dw = db = None
    if want_w:
        if transpose_weight:  # weight [N, K]: dW = dyᵀ · x
            dw, _ = ops.accumulate_checked(dy, x, w_acc, None, mp, False, x_name)
        else:
            # The bias rides along in the same op call when its accumulator can be the
            # multi-precision type (main_grad or fresh) and the weight's is that type too.
            fuse_bias = want_b and b_kind != "grad" and w_acc_name in (None, mp_name)
            dw, db = ops.accumulate_checked(
                x,
                dy,
                w_acc,
                b_acc if fuse_bias else None,
                True if fuse_bias else mp,
                fuse_bias,
                x_name,
            )
    if want_b and db is None:
        db = dy.reshape([-1, dy.shape[-1]]).astype(mp_name).sum(axis=0)
        if b_acc is not None:  # (then nothing below hands db on)
            b_acc.add_(db.astype(b_acc.dtype))

    if w_kind == "grad":
        _written(weight)
    if b_kind == "grad":
        _written(bias)
    if want_w:
        stats.fused_params.add(weight.name)
    if want_b:
        stats.fused_params.add(bias.name)
    stats.bump(stats.linear, "into_main_grad", (w_kind == "main_grad") + (b_kind == "main_grad"))
    out_w = out_b = None
    if want_w:
        if w_kind == "main_grad":
            if w_acc is None:
                weight.main_grad = dw  # first micro-step: mp dtype, on the real parameter
        elif w_kind == "fresh":
            out_w = dw if dw.dtype == weight.dtype else dw.astype(weight.dtype)
    if want_b:
        if b_kind == "main_grad":
            if b_acc is None:
                bias.main_grad = db if _dtname(db.dtype) == mp_name else db.astype(mp_name)
        elif b_kind == "fresh":
            out_b = db if db.dtype == bias.dtype else db.astype(bias.dtype)
    return out_w, out_b


def functional_grads(ctx, x, dy, fpass, dx_fn):
    """Our linears' backward in a ``paddle.grad`` pass (:mod:`.autograd.passes`): plain
    gradients exactly at the slots Paddle wants, ``.grad``/``main_grad`` untouched.
    ``dx_fn()`` computes the input gradient (the overlap linears add their collective)."""
    weight, bias = ctx.weight, ctx.bias  # the forward's tensors: the graph's own edges
    need = fpass.slots(
        ctx.guard, 2 if bias is None else 3, (x, weight) if bias is None else (x, weight, bias)
    )
    stats.bump(stats.linear, "functional_backward")
    dx = dx_fn() if need[0] else None
    dw, db = plain_param_grads(
        x,
        dy,
        weight,
        bias,
        getattr(ctx, "transpose_weight", False),
        need[1],
        bias is not None and need[2],
    )
    return (dx, dw) if bias is None else (dx, dw, db)


def _paddle_linear(x, weight, bias):
    """``y = x·W + b`` exactly as ``paddle.nn.functional.linear`` computes it in dynamic mode.

    On Paddle 2.6, and on 3.x built without CUDA, that function is ``_C_ops.linear`` after
    Python-level checks that cannot fail here (3.x also reads ``FLAGS_use_legacy_linear``
    through ``paddle.get_flags``, ~30 us, whose value matters only with CUDA): call the op
    itself.  A CUDA build of 3.x picks its kernel by that flag, so there it is Paddle's
    function, flags and all."""
    if LINEAR_IS_C_OP:
        return _C_ops.linear(x, weight, bias)
    return original("linear")(x, weight, bias)


class FusedLinearWithGradAdd(autograd_passes.GuardedPyLayer):
    """``y = x·W + b`` with weight/bias gradients accumulated in place (see module doc).

    ``facts``: the ``RouteFacts`` :func:`.routing.route` found for the inputs, kept on ``ctx``
    so that the backward asks Paddle nothing again; None when the caller did not route (the
    checked backward then asks).

    The backward of an ordinary ``backward()`` is one decision and two paths:
    :func:`_backward_fast` (one call into the op library's fast entry) when the forward's
    facts name the common case and the entry takes the call, else :func:`_backward_checked`
    (every rule checked in Python, the op through its tier).  A ``paddle.grad`` pass computes
    plain gradients instead (:func:`functional_grads`).  The table is in
    docs/how-it-works.md."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, transpose_weight=False, facts=None):
        if transpose_weight:
            y = paddle.matmul(x, weight, transpose_y=True)
            if bias is not None:
                y = y + bias
        else:
            y = _paddle_linear(x, weight, bias)
        if facts is None:
            stash_for_backward(ctx, x, weight, bias)
        else:  # (the op library's fast entry may have checked every main_grad already)
            stash_for_backward(ctx, x, weight, bias, facts.dtype, facts.main_grads)
        ctx.transpose_weight = transpose_weight
        # the common case's backward (_backward_fast): a [K, N] weight on the CPU or a GPU
        ctx.facts = facts if facts is not None and facts.where and not transpose_weight else None
        stats.bump(stats.linear, "forward")
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensor()
        fpass = backward_errors.current_pass()
        if fpass is not None:  # paddle.grad: plain gradients, nothing accumulated
            return functional_grads(
                ctx, x, dy, fpass, lambda: input_grad(dy, ctx.weight, ctx.transpose_weight, x.dtype)
            )
        # Under Paddle's reentrant recompute a parameter *argument* arrives as a copy;
        # enable(fused_linear=True) tags it with the real parameter (ORIGIN).
        weight, bias = ctx.weight, ctx.bias
        # (the tag lives in __dict__: looked up there, no AttributeError raised and caught;
        # Paddle 2.6's plain tensors have no __dict__ at all)
        weight = getattr(weight, "__dict__", NO_ATTRS).get(ORIGIN, weight)
        if bias is not None:
            bias = getattr(bias, "__dict__", NO_ATTRS).get(ORIGIN, bias)
        done = None if ctx.facts is None else _backward_fast(ctx, x, dy, weight, bias)
        if done is None:
            done = _backward_checked(ctx, x, dy, weight, bias)
        autograd_passes.ran(ctx)
        return done


def _backward_checked(ctx, x, dy, weight, bias):
    """The ordinary backward of :class:`FusedLinearWithGradAdd` in every case: ``dx`` by
    :func:`input_grad`, the weight/bias gradients by :func:`weight_and_bias_grads` (each
    accumulator rule checked in Python, the op through the tier for the tensors' place).
    Returns the backward's result."""
    stats.bump(stats.linear, "backward")
    names = (_dtname(x.dtype), _dtname(dy.dtype), _dtname(weight.dtype))
    dx = None
    if ctx.x_needs_grad:
        dx = input_grad(dy, weight, ctx.transpose_weight, x.dtype, names)
    # An ordinary backward runs with grad off already (a paddle.grad pass, the one that may
    # create a graph, takes functional_grads): no_grad keeps the accumulation out of any graph
    # whatever calls this.
    with paddle.no_grad():
        dw, db = weight_and_bias_grads(x, dy, weight, bias, ctx.transpose_weight, names)
    if bias is None:
        return dx, dw
    return dx, dw, db


# ``paddle.in_dynamic_mode()`` is ``_dygraph_tracer_ is not None`` (a thread-local of
# paddle.base.framework, 2.6 and 3.x); where :func:`fused_linear` learns that a recomputation
# re-runs it (``.pack``)
_global_var = _compat.global_var
_recomputing_state = _recomputing.state


def fused_linear(x, weight, bias=None, name=None):
    """Drop-in for ``paddle.nn.functional.linear`` with fused in-place weight gradients."""
    facts = route(x, weight, bias)
    if facts is None:
        if _recomputing_state.kept is not None and not _global_var._dygraph_tracer_._has_grad:
            # with grad off (a user's PyLayer forward, a no_grad region) it saves nothing for
            # backward, but its output is still a GEMM output the policy may keep
            return apply_under_policy(original("linear"), x, weight, bias, name, saves=_nothing)
        return original("linear")(x, weight, bias, name)
    pack = _recomputing_state.pack
    if pack is not None:
        return _recomputed_linear(x, weight, bias, pack)
    kept = _recomputing_state.kept
    if kept is not None:  # a recompute policy that keeps GEMM outputs
        return kept.offer(FusedLinearWithGradAdd.apply, x, weight, bias, False, facts)
    return FusedLinearWithGradAdd.apply(x, weight, bias, False, facts)


def _recomputed_linear(x, weight, bias, pack):
    """Our linear re-run by a non-reentrant recomputation (:mod:`.autograd.recomputing`),
    without the ``PyLayer``.

    The recomputed graph is never back-propagated (the forward's graph is: its node of our
    linear unpacks the recomputed ``x``); all a recomputation needs are the tensors the block
    saves, in the forward's order, computed from the same values.  Our ``PyLayer`` saves one,
    ``x``, through ``save_for_backward`` (its forward runs with grad off, so Paddle's linear
    inside saves nothing).  So: Paddle's linear with grad off, and ``x`` handed to the
    recomputation's pack hook.

    The output must then behave as the ``PyLayer``'s did for the rest of the block, needing a
    gradient and taking in-place ops (fleet's ``RowParallelLinear`` all-reduces it in place,
    PaddleFormers' families add to it): :func:`.autograd.recomputing.replayed_output`.

    Where the block's recompute policy kept this linear's output from the forward
    (:class:`.autograd.recomputing.KeptOutputs`), that output is handed back the same way
    instead of multiplying again."""
    kept = _recomputing_state.kept
    found = None if kept is None else kept.take(x, weight)
    pack(x)
    if found is not None:
        return _recomputing.replayed_output(found[0].detach(), found[1])
    tr = _global_var._dygraph_tracer_
    has_grad = tr._has_grad  # (on: route saw it)
    tr._has_grad = False
    try:
        y = _paddle_linear(x, weight, bias)
    finally:
        tr._has_grad = has_grad
    return _recomputing.replayed_output(y, False)


def _nothing(x):
    """``saves=`` of a linear that saves nothing for backward (run with grad off)."""
    return None


def apply_under_policy(apply, x, weight, *args, saves=None):
    """``apply(x, weight, *args)``: a linear that saves at most one tensor for backward
    (fleet's overlap linears' ``PyLayer.apply``, Paddle's linear with grad off), under the
    recompute policy of the block running it.  In the block's forward the output is offered to
    the policy (``KeptOutputs.offer``); in its recomputation a kept output is handed back instead
    of multiplying again, and the tensor the linear would save goes to the pack hook: ``x``, or
    ``saves(x)`` (the sequence-parallel linear saves its all-gathered input; None: nothing).
    Outside a policy: ``apply`` itself."""
    kept = _recomputing_state.kept
    if kept is None:
        return apply(x, weight, *args)
    pack = _recomputing_state.pack
    if pack is None:
        return kept.offer(apply, x, weight, *args)
    found = kept.take(x, weight)
    if found is None:
        return apply(x, weight, *args)
    saved = x if saves is None else saves(x)
    if saved is not None:
        pack(saved)
    # (an output that needed no gradient in the forward comes back as the kept alias itself)
    return _recomputing.replayed_output(found[0].detach(), found[1])


def _incubate_fused_linear(x, weight, bias, transpose_weight, name):
    """Drop-in for ``paddle.incubate.nn.functional.fused_linear`` (its trampoline hands on every
    argument, Paddle's defaults applied)."""
    facts = route(x, weight, bias, transpose_weight)
    if facts is None:
        return original("incubate_fused_linear")(x, weight, bias, transpose_weight, name)
    return FusedLinearWithGradAdd.apply(x, weight, bias, transpose_weight, facts)


def _param_copy_with_origin(param):
    """Paddle's reentrant recompute re-creates parameter *arguments* as new parameters
    with a deep copy of ``__dict__`` (so ``main_grad`` on them is a copy).  Tag the copy
    with the real parameter, so the fused linear writes ``main_grad`` where it belongs."""
    origin = param.__dict__.pop(ORIGIN, None)  # never deep-copy a parameter
    try:
        new = original("varbase_help")(param)
    finally:
        if origin is not None:
            param.__dict__[ORIGIN] = origin
    new.__dict__[ORIGIN] = origin if origin is not None else param
    return new


# Trampolines: their code replaces Paddle's functions' code (registry entries
# "linear", "incubate_fused_linear", "varbase_help"); they run in Paddle's module
# globals, hence the imports inside, and are not mutated: a mutated function closes over its
# mutants, and Paddle's functions' code cannot take a closure.
def _paddle_linear_trampoline(x, weight, bias=None, name=None):  # pragma: no mutate block
    import paddle_mgrad.linear as _m

    return _m.fused_linear(x, weight, bias, name)


def _paddle_incubate_fused_linear_trampoline(
    x, weight, bias=None, transpose_weight=False, name=None
):  # pragma: no mutate block
    import paddle_mgrad.linear as _m

    return _m._incubate_fused_linear(x, weight, bias, transpose_weight, name)


def _paddle_varbase_help_trampoline(param):  # pragma: no mutate block
    import paddle_mgrad.linear as _m

    return _m._param_copy_with_origin(param)
