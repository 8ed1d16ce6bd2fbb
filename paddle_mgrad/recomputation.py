"""Activation recomputation that keeps parameters (and their ``main_grad``) intact.

Drop-in for ``paddle.distributed.fleet.utils.recompute``: same arguments
(``use_reentrant``, ``preserve_rng_state``, ``offload_indices``, keyword
arguments for the function), same results, minus Paddle's bugs that matter to
trainers with fp32 master gradients (``--amp_master_grad``).

Non-reentrant mode (``use_reentrant=False``), the mechanism
------------------------------------------------------------
The forward runs under saved-tensor hooks.  Every tensor that autograd (or a
``PyLayer`` through ``ctx.save_for_backward``) wants to keep is handed to our
``pack`` hook, which returns a small :class:`_Holder` instead:

* a **kept** holder references the saved object itself.  We keep parameters,
  any other leaf that needs a gradient, and the tensors passed to ``recompute``
  as arguments: they are alive anyway (the arguments are needed to re-run the
  function), so holding them costs no memory, and backward gets back the very
  object the forward saw, with ``main_grad``, ``stop_gradient`` and every Python
  attribute.  Paddle instead hands back a buffer-sharing copy named
  ``<name>cpy`` that lost ``main_grad`` (2.6) or any attribute but ``main_grad``
  (3.x), so ``weight.main_grad = weight.main_grad + dw`` landed on the copy.
* every other holder is **empty**: the activation is dropped after forward.

The first ``unpack`` of an empty holder re-runs the function (with the forward's
RNG and AMP state) under an inner pack hook that walks the holders in order:
for holder *i* it stores a ``detach()``-ed view of the recomputed tensor (it
shares the buffer: no copy), with ``stop_gradient`` and Python attributes
carried over.  Each view is popped from storage as soon as backward has it, so
recomputed activations are freed as early as Paddle's own.  Storage is keyed by
weak references to the holders, so a holder whose graph node died never keeps
a recomputed tensor alive.

The forward records each saved tensor's shape and dtype; recomputation checks
them, and a different count, shape or dtype raises :class:`RecomputeError`
naming the tensor, where Paddle silently computes wrong gradients.  Hook
callbacks never raise (an exception thrown through Paddle's C++ hook call loses
its type); they record the problem and it is raised right after.

Reentrant mode (``use_reentrant=True``)
---------------------------------------
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
"""
from __future__ import annotations

import inspect
import weakref

from . import amp_state as _amp
from . import backward_errors as _errors
from . import rng as _rng
from . import saved_hooks as _hooks
from ._compat import IS_PADDLE_2, core, is_parameter, is_tensor, paddle
from .errors import RecomputeError

__all__ = ["recompute", "RecomputeError"]

# Counts calls, for tests and for trainers that want to assert the fix is live.
stats = {"non_reentrant": 0, "reentrant": 0, "recomputations": 0}


def _describe(t) -> str:
    if t is None:
        return "None"
    return f"Tensor(name={t.name!r}, shape={list(t.shape)}, dtype={t.dtype})"


def _spec(t):
    return None if t is None else (tuple(t.shape), t.dtype)


def _fn_name(function) -> str:
    if isinstance(function, paddle.nn.Layer):
        return type(function).__name__
    return getattr(function, "__qualname__", None) or repr(function)


def _iter_tensors(obj):
    if is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _iter_tensors(o)


def _detached_view(t):
    """A tensor sharing ``t``'s buffer, with its flags and Python attributes."""
    view = t.detach()
    view.stop_gradient = t.stop_gradient
    attrs = getattr(t, "__dict__", None)
    if attrs:
        view.__dict__.update(attrs)
    return view


def _buffer_sharing_tensor(t):
    """A new tensor object with its own DenseTensor that shares ``t``'s allocation.

    Paddle 2.6's ``TensorWrapper::recover`` *moves* the memory holder out of
    whatever the unpack hook returns; handing it the parameter itself would
    leave the parameter without storage (wrong values, then a segfault).
    """
    out = core.eager.Tensor(t.dtype, t.shape, t.name + "@mgrad", core.VarDesc.VarType.LOD_TENSOR,
                            t.persistable)
    t._share_buffer_to(out)
    out.stop_gradient = t.stop_gradient
    return out


class _Holder:
    """What autograd keeps instead of a saved tensor (see module docstring)."""

    __slots__ = ("index", "kept", "value", "for_op", "__weakref__")

    def __init__(self, index, kept, value, for_op):
        self.index = index
        self.kept = kept
        self.value = value
        # Paddle 2.6 only: saved by a C++ op (not a PyLayer), so what we return is
        # consumed by TensorWrapper::recover and must be a disposable tensor.
        self.for_op = for_op


class _Frame:
    """State of one non-reentrant recompute call, shared by its hooks."""

    def __init__(self, function, args, kwargs, preserve_rng_state):
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.rng = _rng.capture() if preserve_rng_state else None
        self.amp = _amp.capture()
        self.arg_ids = {id(t) for t in _iter_tensors((args, kwargs))}
        self.specs: list = []
        self.holders: list = []
        self.storage = weakref.WeakKeyDictionary()

    # -- forward -----------------------------------------------------------
    def _keep(self, x) -> bool:
        if x is None:
            return True
        if is_parameter(x) or id(x) in self.arg_ids:
            return True
        return bool(x.is_leaf and not x.stop_gradient)

    def pack(self, x):
        kept = self._keep(x)
        for_op = IS_PADDLE_2 and not _hooks.in_pylayer_save()
        holder = _Holder(len(self.specs), kept, x if kept else None, for_op)
        self.specs.append(_spec(x))
        self.holders.append(weakref.ref(holder))
        return holder

    def unpack(self, holder):
        if holder.kept:
            if holder.for_op and holder.value is not None:
                return _buffer_sharing_tensor(holder.value)
            return holder.value
        try:
            if holder not in self.storage:
                self.recompute()
            if holder not in self.storage:  # pragma: no cover - defensive
                raise RecomputeError(
                    f"recompute({_fn_name(self.function)}): saved tensor #{holder.index} "
                    "was not reproduced by recomputation"
                )
        except RecomputeError as e:
            _errors.record(e)  # Paddle's engine re-raises it as OSError
            raise
        return self.storage.pop(holder)

    # -- backward ----------------------------------------------------------
    def recompute(self):
        stats["recomputations"] += 1
        counter = 0
        problems: list = []
        specs, holders, storage = self.specs, self.holders, self.storage

        def inner_pack(x):
            nonlocal counter
            i = counter
            counter += 1
            if i >= len(specs):
                if len(problems) < 3:
                    problems.append(
                        f"recomputation saved an extra tensor #{i} {_describe(x)}; "
                        f"the forward saved only {len(specs)}"
                    )
                return None
            if _spec(x) != specs[i]:
                want = "None" if specs[i] is None else (
                    f"shape={list(specs[i][0])}, dtype={specs[i][1]}")
                problems.append(
                    f"saved tensor #{i}: forward saved {want}, "
                    f"recomputation saved {_describe(x)}"
                )
                return None
            holder = holders[i]()
            if holder is None or holder.kept:
                return None
            storage[holder] = _buffer_sharing_tensor(x) if holder.for_op else _detached_view(x)
            return None

        def inner_unpack(_):  # the recomputed graph is never back-propagated
            raise RecomputeError("internal: a tensor saved during recomputation was unpacked")

        with _maybe(self.rng), self.amp.replayed(), paddle.set_grad_enabled(True), \
                _hooks.hooks(inner_pack, inner_unpack):
            self.function(*self.args, **self.kwargs)

        if counter < len(specs):
            problems.append(
                f"recomputation saved {counter} tensors, the forward saved {len(specs)} "
                f"(first missing: #{counter}, forward saved "
                f"{'None' if specs[counter] is None else list(specs[counter][0])})"
            )
        if problems:
            storage.clear()
            raise RecomputeError(
                f"recompute({_fn_name(self.function)}) is not deterministic: "
                + "; ".join(problems)
                + ". Gradients would be wrong. Make the block's saved tensors depend only "
                "on its inputs (use preserve_rng_state=True for dropout, avoid "
                "data-dependent branches)."
            )


class _maybe:
    """``rng.restored()`` when an RNG snapshot exists, else a no-op context."""

    def __init__(self, rng):
        self._cm = rng.restored() if rng is not None else None

    def __enter__(self):
        if self._cm is not None:
            self._cm.__enter__()

    def __exit__(self, *exc):
        if self._cm is not None:
            return self._cm.__exit__(*exc)
        return False


def _recompute_non_reentrant(function, preserve_rng_state, args, kwargs):
    stats["non_reentrant"] += 1
    _hooks.install_none_shim()
    _errors.install()
    frame = _Frame(function, args, kwargs, preserve_rng_state)
    with _hooks.hooks(frame.pack, frame.unpack):
        return function(*args, **kwargs)


# ---------------------------------------------------------------- reentrant
# Arguments are encoded into a layout plus a flat list of tensors: every tensor
# (also inside tuples) is its own PyLayer input, so its gradient has its own
# slot (Paddle 2.6 loses the gradient of the first element of a tuple
# argument), and parameters stay out of the PyLayer entirely (see docstring).
def _encode(arg, tensors):
    if is_parameter(arg):
        return ("param", arg)
    if is_tensor(arg):
        if hasattr(arg, "_new_shared_tensor"):
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


def _needs_grad(obj) -> bool:
    return any(not t.stop_gradient for t in _iter_tensors(obj))


def _detach(t):
    d = t.detach()
    d.stop_gradient = t.stop_gradient
    return d


class _ReentrantRecompute(paddle.autograd.PyLayer):
    @staticmethod
    def forward(ctx, run_function, preserve_rng_state, offload, layout, kwargs, n_tensors, *tensors):
        ctx.run_function = run_function
        ctx.kwargs = kwargs
        ctx.layout = layout
        ctx.offload = offload
        ctx.rng = _rng.capture() if preserve_rng_state else None
        ctx.amp = _amp.capture()
        ctx.n_anchor = len(tensors) - n_tensors
        tensors = tensors[:n_tensors]
        with paddle.no_grad():
            outputs = run_function(*[_decode(e, tensors) for e in layout], **kwargs)
        for k in offload:
            cpu = tensors[k].cpu()
            cpu._share_buffer_to(tensors[k])
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = list(ctx.saved_tensor() or ())
        if ctx.offload:
            place = paddle.framework._current_expected_place()
            for k in ctx.offload:
                moved = saved[k].to(place)
                moved.stop_gradient = saved[k].stop_gradient
                saved[k] = moved
        detached = [_detach(t) for t in saved]
        run_args = [_decode(e, detached) for e in ctx.layout]

        stats["recomputations"] += 1
        tracer = paddle.framework._dygraph_tracer()
        has_grad = tracer._has_grad
        tracer._has_grad = True
        try:
            with _maybe(ctx.rng), ctx.amp.replayed():
                outputs = ctx.run_function(*run_args, **ctx.kwargs)
        finally:
            tracer._has_grad = has_grad
        if is_tensor(outputs):
            outputs = (outputs,)

        # PyLayer hands one gradient per output (as Paddle's RecomputeFunction
        # assumes); if it dropped non-tensor outputs, align with the tensors.
        if len(outputs) != len(grads):
            outputs = [o for o in outputs if is_tensor(o)]
        roots, root_grads = [], []
        for o, g in zip(outputs, grads):
            if is_tensor(o) and not o.stop_gradient and g is not None:
                roots.append(o)
                root_grads.append(g)
        if not roots:
            raise RuntimeError(
                "recompute: none of the recomputed outputs needs a gradient; "
                "this recompute() is not necessary"
            )
        with paddle.amp.auto_cast(enable=False):
            paddle.autograd.backward(roots, root_grads)
        result = [None if d.stop_gradient else d._grad_ivar() for d in detached]
        result.extend(paddle.zeros([1]) for _ in range(ctx.n_anchor))
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


def _recompute_reentrant(function, preserve_rng_state, offload_indices, args, kwargs):
    stats["reentrant"] += 1
    flat = _flatten_call(function, args, kwargs) if kwargs else list(args)
    call_kwargs = {}
    if flat is None:  # keyword-only / **kwargs: tensors there must not need grad
        flat, call_kwargs = list(args), dict(kwargs)
        bad = [k for k, v in call_kwargs.items() if _needs_grad(v)]
        if bad:
            raise ValueError(
                f"recompute(use_reentrant=True): keyword-only argument(s) {bad} hold tensors "
                "that need gradients, which the reentrant PyLayer cannot route; pass them "
                "positionally or use use_reentrant=False"
            )
    tensors: list = []
    layout = [_encode(a, tensors) for a in flat]
    offload = []
    for i in offload_indices:
        if layout[i][0] != "tensor":
            raise ValueError(f"offload_indices: argument {i} is not a (non-parameter) tensor")
        offload.append(layout[i][1])
    anchor = []
    if any(not p.stop_gradient for p in _params_in(layout)) and not any(
            not t.stop_gradient for t in tensors):
        # Parameters bypass the PyLayer; keep its outputs differentiable.
        a = paddle.zeros([1])
        a.stop_gradient = False
        anchor.append(a)
    return _ReentrantRecompute.apply(
        function, preserve_rng_state, offload, layout, call_kwargs, len(tensors),
        *tensors, *anchor,
    )


def recompute(function, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping its activations for backward.

    Arguments as ``paddle.distributed.fleet.utils.recompute``:

    * ``use_reentrant`` (default ``True``, as Paddle): ``False`` selects the
      saved-tensor-hook implementation.
    * ``preserve_rng_state`` (default ``True``): replay the forward's random
      state (CPU, GPU, XPU, custom devices, fleet's RNG tracker, numpy, Python
      ``random``) so that dropout masks are identical in recomputation.
    * ``offload_indices`` (reentrant only): positions of arguments to keep on
      the CPU between forward and backward.

    Raises :class:`RecomputeError` in backward if recomputation does not save
    the same tensors (count, shapes, dtypes) as the forward did.
    """
    preserve = kwargs.pop("preserve_rng_state", True)
    use_reentrant = kwargs.pop("use_reentrant", True)
    offload_indices = kwargs.pop("offload_indices", [])

    if not paddle.in_dynamic_mode():
        from paddle.distributed.auto_parallel.interface import recompute as static_recompute

        return static_recompute(function)(*args, **kwargs)

    tracer = paddle.framework._dygraph_tracer()
    if not tracer._has_grad:
        return function(*args, **kwargs)
    if use_reentrant:
        return _recompute_reentrant(function, preserve, offload_indices, args, kwargs)
    if offload_indices:
        raise ValueError("offload_indices is only supported with use_reentrant=True (as in Paddle)")
    return _recompute_non_reentrant(function, preserve, args, kwargs)

