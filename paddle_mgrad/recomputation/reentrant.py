"""Reentrant recompute (``use_reentrant=True``): a PyLayer that re-runs the block in backward.

As Paddle: a ``PyLayer`` runs the function without grad, and its backward
re-runs it with grad and back-propagates through the re-run.  Paddle rebuilds
each *parameter argument* as a new ``EagerParamBase`` with a deep copy of its
``__dict__``, so ``w.main_grad.add_(dw)`` in backward updated a copy (Paddle
issue #70508).  We pass parameter arguments *around* the ``PyLayer`` instead:
the re-run uses the real parameter, exactly like the parameters a layer reads
from ``self``, so its gradient reaches it once, through its own hooks.  If such
a parameter is the only input that needs a gradient, a one-element anchor
tensor keeps the ``PyLayer``'s outputs differentiable.  Every tensor argument,
also inside a tuple or list, is its own ``PyLayer`` input, so each gets its own
gradient slot (Paddle 2.6 drops the first element's gradient of a tuple).

**No argument needs a gradient** (every tensor argument has ``stop_gradient=True``:
a block fed by frozen embeddings, LoRA/adapter fine-tuning): the ``PyLayer`` would
have no differentiable input, Paddle would create no grad node for it, and the
parameters the block reads from ``self`` would silently get no gradient (plain
Paddle logs "None of the inputs to current recompute block need grad" and drops
them).  Only a forward *with* grad reveals which parameters the block uses, so
such a call runs the non-reentrant implementation (:mod:`.non_reentrant`, same
RNG/AMP replay and determinism checks): gradients equal those without recompute,
outputs have the ``stop_gradient`` they would have without recompute, and a block
with nothing to train builds no graph, saves nothing and is never recomputed.
(A dummy differentiable input instead would make every frozen block's outputs
differentiable and re-run it in backward for nothing.)  ``offload_indices`` does
not apply to such a call: its arguments are kept where they are.

A block that changes one of its tensor arguments in place raises
:class:`RecomputeError` when its forward returns: the re-run would start from the
changed value (use ``use_reentrant=False``, which keeps such a block's activations).
An argument changed in place *after* the block returned raises in backward, before
the re-run, for the same reason (as the non-reentrant mode).

An output that *is* one of the block's inputs (a block returning its residual)
gets its gradient added to that input's in backward, not by back-propagating
from it (see :meth:`_ReentrantRecompute.backward`).

``determinism_check="values"``: the forward runs without grad and saves no
activations, so there is nothing per-activation to compare; instead each tensor
*output* of the block is fingerprinted in forward and again after the re-run in
backward.  A difference (the re-run's gradients would belong to other values
than the ones the rest of the model used) raises :class:`RecomputeError`.
``"shapes"`` and ``"none"`` check nothing here (as Paddle's reentrant mode).
"""

from __future__ import annotations

import inspect

from .. import stats
from .._compat import HAS_SHARED_TENSOR_COPY, is_parameter, is_tensor, paddle, tracer
from ..autograd import backward_errors as _errors, passes as autograd_passes
from ..errors import RecomputeError
from . import amp as _amp, non_reentrant as _non_reentrant, rng as _rng
from .tensors import (
    FINGERPRINT_FIELDS,
    any_needs_grad,
    buffer_sharing_tensor,
    check_arguments_unchanged,
    detached_view,
    fingerprint,
    fingerprint_mismatch,
    first_changed,
    function_name,
    spec,
)


# Arguments are encoded into a layout plus a flat list of tensors: every tensor
# (also inside tuples) is its own PyLayer input, so its gradient has its own
# slot (Paddle 2.6 loses the gradient of the first element of a tuple
# argument), and parameters stay out of the PyLayer entirely (see docstring).
def _encode(arg, tensors):
    if is_parameter(arg):
        return ("param", arg)
    if is_tensor(arg):
        if HAS_SHARED_TENSOR_COPY:
            # A shallow copy, as Paddle does, so that schedulers freeing the
            # caller's tensor (pipeline parallel) do not free what backward needs.
            arg = arg._new_shared_tensor()
        tensors.append(arg)
        return ("tensor", len(tensors) - 1)
    if type(arg) in (tuple, list) and any(is_tensor(a) for a in arg):
        return (type(arg).__name__, [_encode(a, tensors) for a in arg])
    return ("const", arg)


def _decode(entry, tensors):
    kind, value = entry
    if kind == "tensor":
        return tensors[value]
    if kind in ("tuple", "list"):
        items = [_decode(e, tensors) for e in value]
        return tuple(items) if kind == "tuple" else items
    return value  # "param" and "const"


def _params_in(layout):
    for kind, value in layout:
        if kind == "param":
            yield value
        elif kind in ("tuple", "list"):
            yield from _params_in(value)


class Offload:
    """How the PyLayer keeps its tensor inputs for backward: as they are, except
    positions ``indices`` moved to the CPU (``offload_indices``).  :mod:`.hybrid`
    subclasses it (offload of every input, mp partitioning)."""

    mark_frozen = False  # mark inputs with stop_gradient=True non-differentiable (fleet hybrid)
    dict_keys = None  # the block returned a dict with these keys (set by forward)

    def __init__(self, indices=()):
        self.indices = list(indices)

    def pack(self, tensors):
        for k in self.indices:
            cpu = tensors[k].cpu()
            cpu._share_buffer_to(tensors[k])
        return list(tensors)

    def unpack(self, saved):
        if self.indices:
            place = paddle.framework._current_expected_place()
            for k in self.indices:
                moved = saved[k].to(place)
                moved.stop_gradient = saved[k].stop_gradient
                saved[k] = moved
        return saved


def _output_specs(outputs):
    """What the output check compares: ``(shape, dtype)`` per tensor output, else the type."""
    outputs = (outputs,) if is_tensor(outputs) else outputs
    if not isinstance(outputs, (tuple, list)):
        return None
    return [spec(o) if is_tensor(o) else type(o).__name__ for o in outputs]


def _show(specs):
    if specs is None:
        return "a non-tensor"
    return (
        "["
        + ", ".join(
            f"Tensor(shape={list(s[0])}, dtype={s[1]})" if isinstance(s, tuple) else s
            for s in specs
        )
        + "]"
    )


def _output_prints(outputs):
    outs = (outputs,) if is_tensor(outputs) else outputs
    if not isinstance(outs, (tuple, list)):
        return []
    return [(k, o.name, fingerprint(o)) for k, o in enumerate(outs) if is_tensor(o)]


def _check_outputs(function, forward, recomputed):
    """Raise RecomputeError if the re-run's outputs differ from the forward's."""
    problems = []
    if [k for k, _, _ in forward] != [k for k, _, _ in recomputed]:
        problems.append(
            f"the forward returned tensors at positions {[k for k, _, _ in forward]}, "
            f"recomputation at {[k for k, _, _ in recomputed]}"
        )
    else:
        pairs = [
            (f, r) for f, r in zip(forward, recomputed) if f[2] is not None and r[2] is not None
        ]
        if pairs:
            both = paddle.stack([f[2] for f, _ in pairs] + [r[2] for _, r in pairs]).numpy()
            for j, (f, _) in enumerate(pairs):
                field = fingerprint_mismatch(both[j], both[len(pairs) + j])
                if field is not None:
                    problems.append(
                        f"output #{f[0]} (forward name {f[1]!r}) has different values: "
                        f"{FINGERPRINT_FIELDS[field]} {both[j][field]!r} in the forward, "
                        f"{both[len(pairs) + j][field]!r} in recomputation"
                    )
    if problems:
        err = RecomputeError(
            f"recompute({function_name(function)}, use_reentrant=True) is not deterministic: "
            + "; ".join(problems)
            + ". Gradients would be wrong. Make the block depend only on "
            "its inputs (use preserve_rng_state=True for dropout, avoid data-dependent branches)."
        )
        _errors.record(err)  # Paddle's engine re-raises it as OSError
        raise err


def _check_inputs_unchanged(function, tensors, versions):
    """Raise RecomputeError if the block changed one of its tensor arguments in place.

    The re-run in backward would start from the changed value and build another graph than
    the forward's: wrong gradients (plain Paddle's reentrant recompute raises an in-place
    error in backward, or -- ``paddle.assign(..., output=x)`` -- computes them wrong).  The
    non-reentrant mode keeps such a block's activations from the forward instead
    (:mod:`.non_reentrant`)."""
    changed = first_changed(tensors, versions)
    if changed is not None:
        k, t, _ = changed
        raise RecomputeError(
            f"recompute({function_name(function)}, use_reentrant=True): the block changed "
            f"its tensor argument #{k} (shape={list(t.shape)}, dtype={t.dtype}) in place. "
            "A reentrant recompute re-runs the block in backward from the changed value, so "
            "its gradients would be wrong. Use use_reentrant=False (paddle_mgrad then keeps "
            "this block's activations from the forward), clone the argument inside the "
            "block before changing it, or move the in-place op out of the block."
        )


def _reuse_error(layer):
    return RecomputeError(
        f"paddle_mgrad: a backward pass reached {layer} whose backward already ran in an earlier "
        "backward() (with retain_graph=True, or a second backward() of the same graph). Paddle's "
        "PyLayer releases its context after its first backward, so running it again crashes the "
        "process (plain Paddle's reentrant recompute segfaults here); paddle_mgrad stops first. "
        "Use use_reentrant=False (it supports retain_graph and a second backward), or run the "
        "forward again before each backward()."
    )


def _fresh_outputs(outputs, tensors):
    """``(outputs, frozen)``: each output that *is* one of the PyLayer's tensor inputs
    (a block returning its residual or a mask) replaced by a new tensor sharing its
    buffer, and those of them whose input needs no gradient.

    Paddle treats a PyLayer output that is one of its inputs as an in-place result: a
    leaf input that needs a gradient raises "Leaf Var ... can't use inplace strategy"
    (plain Paddle's reentrant recompute too), a non-leaf one has its graph rewired.  A
    new tensor is an ordinary output; one whose input needs no gradient is marked
    non-differentiable, so it keeps ``stop_gradient=True`` as without recompute."""
    single = is_tensor(outputs)
    items = [outputs] if single else outputs
    if not isinstance(items, (tuple, list)):
        return outputs, []
    inputs = {id(t): t for t in tensors}
    fresh, frozen = [], []
    for o in items:
        if is_tensor(o) and id(o) in inputs:
            new = buffer_sharing_tensor(o)  # own DenseTensor (detach() shares the input's)
            if inputs[id(o)].stop_gradient:
                frozen.append(new)
            o = new
        fresh.append(o)
    if not frozen and all(a is b for a, b in zip(fresh, items)):
        return outputs, []
    if single:
        return fresh[0], frozen
    return type(items)(fresh) if isinstance(items, tuple) else fresh, frozen


class _ReentrantRecompute(autograd_passes.GuardedPyLayer):
    """Paddle's reentrant recompute as a PyLayer.  A :class:`GuardedPyLayer`: a second
    ordinary backward through the same node raises :class:`RecomputeError` instead of the
    segfault Paddle's released context gives (autograd_passes module doc)."""

    @staticmethod
    def forward(
        ctx, run_function, preserve_rng_state, stash, layout, kwargs, check, n_tensors, *tensors
    ):
        ctx.run_function = run_function
        ctx.kwargs = kwargs
        ctx.layout = layout
        ctx.stash = stash
        ctx.amp = _amp.capture()
        ctx.n_anchor = len(tensors) - n_tensors
        tensors = tensors[:n_tensors]
        versions = [t._inplace_version() for t in tensors]
        with _rng.exclusive(preserve_rng_state), paddle.no_grad():  # see rng.py
            ctx.rng = _rng.capture() if preserve_rng_state else None
            outputs = run_function(*[_decode(e, tensors) for e in layout], **kwargs)
        _check_inputs_unchanged(run_function, tensors, versions)
        if isinstance(outputs, dict):
            # a PyLayer returns tensors, or tuples/lists of them: hand back the values,
            # run() rebuilds the dict (plain Paddle raises "At least one output ...")
            stash.dict_keys = list(outputs)
            outputs = tuple(outputs.values())
        ctx.dict_keys = stash.dict_keys
        # determinism check: "shapes" compares the outputs' shapes/dtypes, "values" also
        # their fingerprints, "none" nothing
        ctx.output_specs = _output_specs(outputs) if check != "none" else None
        ctx.prints = _output_prints(outputs) if check == "values" else None
        outputs, frozen = _fresh_outputs(outputs, tensors)
        if stash.mark_frozen:
            # As fleet's recompute_hybrid: (pipeline stages pass masks through)
            frozen += [t for t in tensors if t.stop_gradient]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        saved = stash.pack(tensors)
        # A saved input that still shares the caller's tensor (its version counter) must be
        # unchanged when backward replays from it; a copy (offload, partition) cannot change.
        ctx.versions = [t._inplace_version() for t in saved]
        ctx.save_for_backward(*saved)
        # last: the block's own PyLayers (our fused linears) took their guards already
        autograd_passes.stash_guard(
            ctx, f"recompute({function_name(run_function)}, use_reentrant=True)", _reuse_error
        )
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = list(ctx.saved_tensor() or ())
        check_arguments_unchanged(ctx.run_function, saved, ctx.versions)
        saved = ctx.stash.unpack(saved)
        detached = [detached_view(t) for t in saved]
        run_args = [_decode(e, detached) for e in ctx.layout]

        stats.bump(stats.recompute, "recomputations")
        _non_reentrant.release_last(unread=True)
        t = tracer()
        has_grad = t._has_grad
        t._has_grad = True
        try:
            with _rng.replayed(ctx.rng), ctx.amp.replayed():
                outputs = ctx.run_function(*run_args, **ctx.kwargs)
        finally:
            t._has_grad = has_grad
        if (
            ctx.dict_keys is not None
            and isinstance(outputs, dict)
            and list(outputs) == ctx.dict_keys
        ):
            outputs = tuple(outputs.values())
        specs = _output_specs(outputs) if ctx.output_specs is not None else None
        if specs != ctx.output_specs:
            err = RecomputeError(
                f"recompute({function_name(ctx.run_function)}) is not deterministic: the forward "
                f"returned {_show(ctx.output_specs)}, recomputation returned {_show(specs)}. "
                "Gradients would be wrong. Make the block depend "
                "only on its inputs (dropout: keep preserve_rng_state=True)."
            )
            _errors.record(err)
            raise err
        if ctx.prints is not None:
            _check_outputs(ctx.run_function, ctx.prints, _output_prints(outputs))
        if is_tensor(outputs):
            outputs = (outputs,)

        # PyLayer hands one gradient per output (as Paddle's RecomputeFunction
        # assumes); if it dropped non-tensor outputs, align with the tensors.
        if len(outputs) != len(grads):
            outputs = [o for o in outputs if is_tensor(o)]
        # An output that *is* one of the (detached) inputs -- a block returning its
        # residual -- gets its gradient added to that input's directly: it has no graph
        # of its own to run, and handing a leaf to backward() beside a graph that also
        # reaches it breaks Paddle 2.6's engine when a PyLayer (our fused linear) sits
        # between them ("Unable to find next node in the GradTensorHolder").
        position = {id(d): k for k, d in enumerate(detached)}
        direct: dict = {}
        roots, root_grads = [], []
        for o, g in zip(outputs, grads):
            if not is_tensor(o) or g is None:
                continue
            k = position.get(id(o))
            if k is not None:
                if not detached[k].stop_gradient:
                    direct[k] = g if k not in direct else direct[k] + g
            elif not o.stop_gradient:
                roots.append(o)
                root_grads.append(g)
        # No root: nothing in the block needed a gradient here (an output computed under
        # no_grad, or from inputs that need none): as without recompute, no gradient flows.
        if roots:
            with paddle.amp.auto_cast(enable=False):
                paddle.autograd.backward(roots, root_grads)
        result = [None if d.stop_gradient else d._grad_ivar() for d in detached]
        for k, g in direct.items():
            result[k] = g if result[k] is None else result[k] + g
        result.extend(paddle.zeros([1]) for _ in range(ctx.n_anchor))
        if _errors.current_pass() is None:  # paddle.grad runs a copy: the node stays usable
            autograd_passes.ran(ctx)
        return tuple(result)


def _flatten_call(function, args, kwargs):
    """Bind ``args``/``kwargs`` to the signature and return them positionally,
    or None when that is impossible (keyword-only parameters, extra ``**kwargs``)."""
    target = function.forward if isinstance(function, paddle.nn.Layer) else function
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    flat = []
    for value, param in zip(bound.arguments.values(), sig.parameters.values()):
        if param.kind == param.VAR_POSITIONAL:
            flat.extend(value)
        elif param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            flat.append(value)
        elif param.kind == param.VAR_KEYWORD and not value:
            continue
        else:
            return None
    return flat


def _prepare(function, args, kwargs, what):
    """``(layout, tensors, call_kwargs, anchor)`` for the PyLayer (see module docstring)."""
    flat = _flatten_call(function, args, kwargs) if kwargs else list(args)
    call_kwargs = {}
    if flat is None:  # keyword-only / **kwargs: tensors there must not need grad
        flat, call_kwargs = list(args), dict(kwargs)
        bad = [k for k, v in call_kwargs.items() if any_needs_grad(v)]
        if bad:
            raise ValueError(
                f"{what}: keyword-only argument(s) {bad} hold tensors "
                "that need gradients, which the reentrant PyLayer cannot route; pass them "
                "positionally or use use_reentrant=False"
            )
    tensors: list = []
    layout = [_encode(a, tensors) for a in flat]
    anchor = []
    if any(not p.stop_gradient for p in _params_in(layout)) and not any(
        not t.stop_gradient for t in tensors
    ):
        # Parameters bypass the PyLayer; keep its outputs differentiable.
        a = paddle.zeros([1])
        a.stop_gradient = False
        anchor.append(a)
    return layout, tensors, call_kwargs, anchor


def run(function, preserve_rng_state, stash, layout, tensors, call_kwargs, anchor, check="shapes"):
    """Apply the PyLayer (shared with :mod:`.hybrid`)."""
    _errors.install()  # RecomputeError from backward keeps its type
    _non_reentrant.release_last()  # (a block call: the block kept whole is not the last one)
    outputs = _ReentrantRecompute.apply(
        function,
        preserve_rng_state,
        stash,
        layout,
        call_kwargs,
        check,
        len(tensors),
        *tensors,
        *anchor,
    )
    if stash.dict_keys is not None:
        outputs = (outputs,) if is_tensor(outputs) else outputs
        return dict(zip(stash.dict_keys, outputs))
    return outputs


def recompute_reentrant(
    function, preserve_rng_state, offload_indices, args, kwargs, check="shapes", policy=None
):
    """Paddle's PyLayer recompute, with parameter arguments routed around the PyLayer."""
    if not any_needs_grad((args, kwargs)) or (policy is not None and not offload_indices):
        # Nothing passed in needs a gradient, so the PyLayer would get no differentiable
        # input and Paddle would make no grad node: parameters read inside the block
        # (LoRA behind frozen embeddings) would silently get no gradient.  See the module
        # docstring: the block runs non-reentrant instead.  So does a block with a recompute
        # policy (:mod:`.policy`: what it keeps meets the replay in the non-reentrant engine).
        stats.bump(stats.recompute, "reentrant")
        stats.bump(stats.recompute, "reentrant_as_non_reentrant")
        return _non_reentrant.run(function, preserve_rng_state, args, kwargs, check, policy)
    stats.bump(stats.recompute, "reentrant")
    layout, tensors, call_kwargs, anchor = _prepare(
        function, args, kwargs, "recompute(use_reentrant=True)"
    )
    offload = []
    for i in offload_indices:
        if layout[i][0] != "tensor":
            raise ValueError(f"offload_indices: argument {i} is not a (non-parameter) tensor")
        offload.append(layout[i][1])
    return run(
        function, preserve_rng_state, Offload(offload), layout, tensors, call_kwargs, anchor, check
    )
