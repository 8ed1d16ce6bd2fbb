"""``paddle.grad``, double backward and a second backward through paddle_mgrad's PyLayers.

Our linears (:class:`~paddle_mgrad.FusedLinearWithGradAdd` and the overlap linears) are
``PyLayer``\\ s whose ordinary backward accumulates the weight/bias gradients in place
(``main_grad`` / ``.grad``) and returns None for them.  Two kinds of pass reach them:

* **ordinary** -- ``Tensor.backward`` / ``paddle.autograd.backward``: Paddle runs the graph's
  own nodes; the in-place path is what makes the fused linear fast.
* **functional** -- ``paddle.grad`` (and everything built on it): Paddle's ``GeneralGrad``
  runs a *copy* of the graph and marks as stop-gradient every input slot of a node whose
  edge does not lead to one of the requested ``inputs`` (``ModifyBackwardGraph``: a
  needed node's edge to a node that is not needed, or to a ``no_grad_vars`` tensor).  A
  PyLayer's backward must return None exactly at those slots ("should return None at k
  position, because it's forward Tensor's stopgradient is true"), and a gradient at the
  others; it must not touch ``.grad``/``main_grad`` (plain Paddle does not); with
  ``create_graph`` its computation must be differentiable (Paddle runs the backward with
  grad mode on iff ``create_graph``).

:func:`grad` (registry entry ``grad``: the code of ``paddle.grad``'s function, so every
alias runs it) builds a :class:`FunctionalPass` and runs Paddle's ``paddle.grad`` under it
(:func:`paddle_mgrad.autograd.backward_errors.run`; ordinary passes push None).  Our backward asks
:func:`paddle_mgrad.autograd.backward_errors.current_pass`: None -> the fused in-place path; a
``FunctionalPass`` -> :meth:`FunctionalPass.slots` says which of its slots Paddle wants
(the same rule as ``GeneralGrad``, computed once per pass, lazily, on the original graph:
``grad_fn`` / ``next_functions`` / ``node_ptr``), and it returns Paddle-equal plain
gradients there, built from ordinary differentiable Paddle ops.

**A node runs once.**  After an ordinary backward ran a PyLayer's node, Paddle releases
the node's context (``GradNodePyLayer``: ``Py_XDECREF(ctx_); ctx_ = nullptr``, with or
without ``retain_graph``); a second ordinary backward through the node dereferences it
(SIGSEGV), and so does ``paddle.grad`` (copying the node increfs the null context).  Plain
``nn.Linear`` has no such node, so with paddle_mgrad routing every linear through a PyLayer
this would turn working code into a crash.  :class:`GuardedPyLayer` (base class of our
PyLayers) registers a :class:`NodeGuard` as a gradient hook on each output: Paddle keeps the
hook exactly as long as the node, runs it before it touches the context, and copies it into
``paddle.grad``'s copies.  Our backward marks the guard consumed when an ordinary pass ran
it.  A later ordinary pass reaching it raises :class:`~paddle_mgrad.FusedLinearError` from
the hook (before the crash); ``paddle.grad`` checks the graph for consumed nodes still alive
before Paddle copies it.  ``paddle.grad`` passes do not consume nodes (they run copies), so
any number of them, and an ordinary backward after them (the gradient-penalty pattern), work.

**Node addresses.**  ``paddle.grad`` passes identify our nodes by address
(:attr:`NodeGuard.ptr`).  Paddle's ``Tensor.grad_fn`` getter keeps the node it returns alive
for good (~8 KiB per call, 2.6.2 and 3.3.1), so a forward that asked it leaked one node per
fused linear per step: forwards ask it only once the process has run a ``paddle.grad``;
before that a pass finds the address through a living output or by the node's edges
(:meth:`FunctionalPass.slots`).
"""

from __future__ import annotations

import threading
import weakref

from .. import registry
from .._compat import is_tensor, paddle
from ..errors import FusedLinearError
from ..threadstate import thread_state
from . import backward_errors

__all__ = ["GuardedPyLayer", "NodeGuard", "FunctionalPass", "stash_guard", "ran", "grad"]

_pending = thread_state("PendingGuard", guard=None)  # made by forward, picked up by apply
# Weak references to the guards of nodes an ordinary backward already ran.  A guard dies with
# its node (Paddle drops the hook then); dead references are purged in bulk (_purge) when the
# list has doubled since the last purge.
_consumed: list = []
# set by the first paddle.grad of the process: from then on forwards record their node's
# address (NodeGuard.ptr)
_functional_seen = False
_PURGE_MIN = 1024
_purge_at = _PURGE_MIN
_consumed_lock = threading.Lock()


def _reuse_message(layer):
    return (
        f"paddle_mgrad: a backward pass reached a {layer} node whose backward already ran in "
        "an earlier backward() (with retain_graph=True, or a second backward() of the same "
        "graph). Paddle's PyLayer releases its context after its first backward; running it "
        "again would crash the process, so paddle_mgrad stops here (plain nn.Linear, which is "
        "no PyLayer, would accumulate the gradient again). Run the forward again before each "
        "backward(), use paddle.grad(...) for the earlier passes (it runs a copy of the "
        "graph), or switch the fused linear off for this model: "
        "paddle_mgrad.enable(fused_linear=False)."
    )


class NodeGuard:
    """A gradient hook on the outputs of one of our PyLayer calls (see module doc)."""

    __slots__ = ("_ptr", "out", "consumed", "layer", "error", "__weakref__")

    def __init__(self, layer, error=None):
        self._ptr = None  # the graph node's address, once asked (see ptr)
        self.out = None  # weakref to an output of the node, set by GuardedPyLayer.apply
        self.consumed = False
        self.layer = layer
        self.error = error  # layer -> the exception to raise; None: FusedLinearError

    @property
    def ptr(self):
        """The node's address, found through a still-living output (``Tensor.grad_fn``), or
        None.

        Paddle's ``grad_fn`` getter keeps the node it wraps alive for good (measured: ~8 KiB
        per call on 2.6.2 and 3.3.1), so a forward that asked it would leak one node per fused
        linear per step.  Only ``paddle.grad`` passes need the address; so a forward asks for
        it only once the process has run a ``paddle.grad`` (the address is then known however
        the graph evolves, at the price of that leak), and otherwise the pass finds it here, or
        by the node's edges (:meth:`FunctionalPass.slots`)."""
        if self._ptr is None and self.out is not None:
            t = self.out()
            if t is not None:
                self._ptr = _node_ptr(t)
        return self._ptr

    def reuse_error(self):
        """The exception for a pass that reaches this already-run node."""
        if self.error is None:
            return FusedLinearError(_reuse_message(self.layer))
        return self.error(self.layer)

    def __call__(self, grad):
        if self.consumed and backward_errors.current_pass() is None:
            err = self.reuse_error()
            backward_errors.record(err)
            raise err
        return None  # the gradient passes unchanged


def stash_guard(ctx, layer=None, error=None):
    """In a PyLayer's forward: make the node's guard (``ctx.guard``) for ``apply`` to attach.

    Call it last in ``forward`` when the forward runs other PyLayers (their ``apply`` takes
    the pending guard).  ``layer`` names the node in the error (default: the class name);
    ``error(layer)`` builds the exception (default: :class:`FusedLinearError`)."""
    guard = NodeGuard(layer or type(ctx)._forward_cls.__name__, error)
    ctx.guard = guard
    _pending.guard = guard


def _purge() -> list:
    """Drop the dead references from ``_consumed``; returns the consumed guards still alive.
    Under ``_consumed_lock``: backward passes of other threads add entries meanwhile."""
    global _purge_at
    with _consumed_lock:
        live = [ref for ref in _consumed if ref() is not None]
        _consumed[:] = live
        _purge_at = max(_PURGE_MIN, 2 * len(live))
    return [g for g in (ref() for ref in live) if g is not None]


def ran(ctx):
    """Our backward of ``ctx`` returns from an ordinary pass: Paddle releases the node's
    context now, so the node must not run again."""
    guard = getattr(ctx, "guard", None)
    if guard is None or guard.consumed:
        return
    guard.consumed = True  # a later ordinary pass: the guard's hook raises
    # for paddle.grad's check (before Paddle copies the graph): a plain weak reference, no
    # callback -- this runs in every backward of every linear; dead ones are purged in bulk
    ref = weakref.ref(guard)
    with _consumed_lock:
        _consumed.append(ref)
        full = len(_consumed) > _purge_at
    if full:
        _purge()


class GuardedPyLayer(paddle.autograd.PyLayer):
    """A ``PyLayer`` whose node carries a :class:`NodeGuard` (forward calls :func:`stash_guard`)."""

    @classmethod
    def apply(cls, *args, **kwargs):
        _pending.guard = None
        out = super().apply(*args, **kwargs)
        guard, _pending.guard = _pending.guard, None
        if guard is not None:
            # every differentiable output: a later pass may reach the node through any of them
            for t in (out,) if is_tensor(out) else _tensor_list(out):
                if not t.stop_gradient:  # (an output that needs a gradient has the node)
                    if guard.out is None:
                        guard.out = weakref.ref(t)
                        if _functional_seen:  # see NodeGuard.ptr
                            guard.ptr  # noqa: B018 -- asked now, while the output lives
                    t._register_grad_hook(guard)
        return out


def _tensor_list(value):
    if is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple, set)):
        return [t for t in value if is_tensor(t)]
    return []


def _node_ptr(t):
    """The address of ``t``'s grad node, or None (``Tensor.grad_fn``: see NodeGuard.ptr)."""
    node = t.grad_fn
    return None if node is None else node.node_ptr()


def _edge(t):
    """The address of the node a PyLayer's edge for input ``t`` leads to, or None."""
    return None if t is None or t.stop_gradient else _node_ptr(t)


def _node_ptrs(tensors):
    return {p for p in map(_node_ptr, tensors) if p is not None}


class FunctionalPass:
    """One ``paddle.grad`` call: which input slots of a node Paddle's ``GeneralGrad`` wants.

    Paddle copies the graph reachable from ``outputs``; a node is *needed* when it is the
    grad node of one of ``inputs`` or one of them is reachable from it.  In a needed node
    with more than one input slot, a slot whose edge leads to a node that is not needed is
    stop-gradient for this pass; so is an edge to a ``no_grad_vars`` tensor's node.
    """

    __slots__ = (
        "_outputs",
        "_inputs",
        "_no_grad_vars",
        "_edges",
        "_needed",
        "_no_grad",
        "_pylayers",
    )

    def __init__(self, outputs, inputs, no_grad_vars=None):
        self._outputs = _tensor_list(outputs)
        self._inputs = _tensor_list(inputs)
        self._no_grad_vars = _tensor_list(no_grad_vars)
        self._edges = None

    def _build(self):
        if self._edges is not None:
            return
        edges = {}  # node address -> addresses of its next nodes, one per edge (None: no edge)
        pylayers = set()  # addresses of PyLayer nodes
        todo = [t.grad_fn for t in self._outputs]
        while todo:
            node = todo.pop()
            if node is None:
                continue
            ptr = node.node_ptr()
            if ptr in edges:
                continue
            if node.name().startswith("GradNodePyLayer"):
                pylayers.add(ptr)
            nxt = node.next_functions
            edges[ptr] = tuple(None if n is None else n.node_ptr() for n in nxt)
            todo.extend(nxt)
        parents = {}
        for ptr, nxt in edges.items():
            for q in nxt:
                if q is not None:
                    parents.setdefault(q, []).append(ptr)
        needed = set()
        todo = list(_node_ptrs(self._inputs))
        while todo:
            q = todo.pop()
            if q not in needed:
                needed.add(q)
                todo.extend(parents.get(q, ()))
        self._no_grad = _node_ptrs(self._no_grad_vars)
        self._needed = needed
        self._pylayers = pylayers
        self._edges = edges

    def check_not_consumed(self, live):
        """Raise before Paddle copies a node that an ordinary backward already ran: one of
        ``live`` (the consumed guards still alive) in this pass's graph.  A guard whose node
        cannot be found (no output of it is alive any more) counts as in the graph when the
        graph holds any PyLayer node: the cautious answer (a false alarm needs a retained graph
        with a run fused linear, and paddle.grad over another graph with one)."""
        self._build()
        unknown = None
        for guard in live:
            ptr = guard.ptr
            if ptr is None:
                unknown = unknown or guard
            elif ptr in self._edges:
                raise guard.reuse_error()
        if unknown is not None and self._pylayers:
            raise unknown.reuse_error()

    def _find_by_edges(self, want):
        """The one PyLayer node of this graph whose edges are ``want``; else the one whose
        edges after the first are ``want[1:]`` (the parameters' nodes: under recompute the
        first input, ``x``, is a recomputed tensor whose node is not the graph's); None when
        neither is unique."""
        want = tuple(want)
        found = [p for p in self._pylayers if self._edges[p] == want]
        if not found:
            found = [
                p
                for p in self._pylayers
                if len(self._edges[p]) == len(want) and self._edges[p][1:] == want[1:]
            ]
        return found[0] if len(found) == 1 else None

    def slots(self, guard, n, inputs=None):
        """For the node of ``guard`` (``n`` input slots): a tuple, True where Paddle wants
        a gradient in this pass.

        The node is found by its address (:attr:`NodeGuard.ptr`, through a living output).
        When no output lives any more (``paddle.grad(tanh(linear(x)), x)``), ``inputs`` -- the
        forward's tensor arguments, in order -- name the node by its edges (each input's grad
        node, None for a stop-gradient one), accepted only when they single out one PyLayer node
        of this graph (:meth:`_find_by_edges`); else the node cannot be identified: an error,
        never a guess."""
        self._build()
        nxt = self._edges.get(getattr(guard, "ptr", None))
        if nxt is None and inputs is not None and len(inputs) == n:
            found = self._find_by_edges([_edge(t) for t in inputs])
            if found is not None:
                nxt = self._edges[found]
                guard._ptr = found  # known from now on (check_not_consumed asks it)
        if nxt is None or len(nxt) != n:
            raise FusedLinearError(
                "paddle_mgrad: paddle.grad reached one of our PyLayer nodes that it cannot "
                f"identify ({getattr(guard, 'layer', '?')}); please report this with the code "
                "that builds the graph"
            )
        if n == 1:  # Paddle prunes only nodes with more than one slot
            return (nxt[0] is not None and nxt[0] not in self._no_grad,)
        return tuple(q is not None and q in self._needed and q not in self._no_grad for q in nxt)


def grad(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph=None,
    create_graph=False,
    only_inputs=True,
    allow_unused=False,
    no_grad_vars=None,
    *,
    dump_backward_graph_path=None,
):
    """``paddle.grad`` run as a functional pass (module doc), same arguments and result."""
    kwargs = {}
    if dump_backward_graph_path is not None:  # Paddle 3.x only
        kwargs["dump_backward_graph_path"] = dump_backward_graph_path
    global _functional_seen
    _functional_seen = True
    fpass = FunctionalPass(outputs, inputs, no_grad_vars)
    live = _purge() if _consumed else ()
    if live:  # a node an ordinary backward ran is still alive somewhere
        fpass.check_not_consumed(live)
    return backward_errors.run(
        registry.original("grad"),
        (
            outputs,
            inputs,
            grad_outputs,
            retain_graph,
            create_graph,
            only_inputs,
            allow_unused,
            no_grad_vars,
        ),
        kwargs,
        fpass,
    )


# Trampoline: its code replaces the code of the function paddle.grad wraps (registry entry
# "grad"); it runs in Paddle's module globals, hence the import inside.
def _paddle_grad_trampoline(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph=None,
    create_graph=False,
    only_inputs=True,
    allow_unused=False,
    no_grad_vars=None,
    *,
    dump_backward_graph_path=None,
):
    import paddle_mgrad.autograd.passes as _m

    return _m.grad(
        outputs,
        inputs,
        grad_outputs,
        retain_graph,
        create_graph,
        only_inputs,
        allow_unused,
        no_grad_vars,
        dump_backward_graph_path=dump_backward_graph_path,
    )
