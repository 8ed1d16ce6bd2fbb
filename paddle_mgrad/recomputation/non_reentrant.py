"""Non-reentrant recompute (``use_reentrant=False``): saved-tensor hooks that keep parameters.

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
carried over.  The view is stored on the holder itself and taken off it as soon as
backward has it, so recomputed activations are freed as early as Paddle's own, and
a holder whose graph node died never keeps a recomputed tensor alive (it dies with
the holder).

**A block that changes its own input in place** (``x.add_(...)`` on a tensor argument):
a recomputation would start from the changed value and reproduce other activations (plain
Paddle's non-reentrant recompute computes wrong gradients there, silently).  So during the
forward every saved tensor is also held, and when the forward returns, the tensor
arguments' inplace versions tell: unchanged (the usual case), the empty holders let go of
their tensors -- dropped as before; changed, every holder is kept, the block is never
recomputed, and backward sees exactly what it would see without recompute
(``stats.recompute["kept_from_forward"]`` counts these calls).  Holding the block's saved
tensors until its forward returns costs what its recomputation costs in backward anyway.
They wait in a list the frame drops when the forward returns or raises, not on the holders: a
holder is reached from the graph, and a tensor made inside the graph held from there would hold
its own grad node -- a reference cycle through C++, never collected.  Kept ones become detached
aliases for the same reason.

**What a recompute policy keeps** (:mod:`.policy`, :mod:`.saved_sublayers`): a kept
sublayer's saved tensors get kept holders that also record the inplace version they were
saved at.  A backward that frees the graph (``backward_errors.frees_graph``) lets go of each
once it read it, as Paddle lets go of a saved tensor once its op's backward ran: held until
the graph dies, they would outlive the step wherever its ``loss`` does (a training loop holds
the last one through the next forward).  Read again after that (a ``PyLayer`` that reads its
saved tensor twice), it is recomputed: the next recomputation runs its sublayer
(:meth:`_Frame.wants`) and stores it.  A block that changed an argument in place is never
recomputed: there nothing is let go of.

**A block kept whole** (a ``budget:`` plan that keeps the step's last block,
:meth:`_Frame.keep_whole`): when its forward returns, every saved tensor is kept as a kept
sublayer's is, and the frame becomes its thread's last block.  The next block call of the
thread lets go of it (:func:`release_last`): it will be recomputed.  So does a recomputation
that starts before the block's backward began to read it (a pipeline's backward of an earlier
micro-batch): the step's last block is back-propagated first, so it is not the step's last
one.  What is left kept is the step's last block: its backward reads the forward's values,
nothing is recomputed, and its first read lets go of what the plan kept for a recomputation.
A saved tensor of it changed in place since (an op after the block on an output the block
saved) makes it recomputed as under full recompute, where no recompute would refuse.

The forward records each saved tensor's shape and dtype; recomputation checks
them, and a different count, shape or dtype raises :class:`RecomputeError`
naming the tensor, where Paddle silently computes wrong gradients.  With
``determinism_check="values"`` the forward also keeps a 3-number fingerprint
(:func:`.tensors.fingerprint`) of each tensor that will be recomputed (not of
kept ones), and recomputation compares them: same shapes but different values
(data-dependent slicing, an unseeded random op, a mutated global) raise too.
The fingerprints live on the frame and die with it.  Hook
callbacks never raise (an exception thrown through Paddle's C++ hook call loses
its type); they record the problem and it is raised right after.
"""

from __future__ import annotations

import weakref

from .. import stats
from .._compat import UNPACK_MOVES_HOLDER, is_parameter, paddle
from ..autograd import backward_errors as _errors, recomputing as _recomputing
from ..autograd.recomputing import timed
from ..errors import RecomputeError
from ..threadstate import thread_state
from . import (
    amp as _amp,
    policy as _policy,
    rng as _rng,
    saved_hooks as _hooks,
    saved_sublayers as _saved_sublayers,
)
from .budget import NOTHING, BlockSaved
from .tensors import (
    FINGERPRINT_FIELDS,
    buffer_sharing_tensor,
    check_arguments_unchanged,
    describe,
    detached_view,
    distinct_bytes,
    fingerprint,
    fingerprint_mismatch,
    function_name,
    iter_tensors,
    spec,
)

#: ``_last.frame``: a weak reference to the frame this thread keeps whole (its saved tensors
#: kept from the forward: the thread's last block, under a plan that keeps it), or None
_last = thread_state("LastBlock", frame=None)


def release_last(unread=False):
    """A block call starts: the block this thread kept whole is no longer its last one and will
    be recomputed after all (:meth:`_Frame.keep_whole`).  ``unread``: a recomputation starts;
    the block kept whole is let go of unless its backward began (the step's last block is
    back-propagated before any other, so a recomputation before it means that it is not: a
    pipeline's backward of an earlier micro-batch, a loss that reads an earlier block)."""
    ref = _last.frame
    if ref is not None:
        frame = ref()
        if frame is None or not (unread and frame.whole_read):
            _last.frame = None
            if frame is not None:
                frame.release_whole()


class _Holder:
    """What autograd keeps instead of a saved tensor (see module docstring).

    ``value``: a kept holder's object; an empty holder's recomputed view while it waits for
    its unpack (None before the recomputation and after the unpack: a dropped activation is
    never None, :meth:`_Frame._keep` keeps None).  ``version``: for an activation kept because
    a sublayer the policy does not recompute saved it (:mod:`.saved_sublayers`), its inplace
    version then (None for every other holder)."""

    __slots__ = ("index", "kept", "value", "for_op", "version", "__weakref__")

    def __init__(self, index, kept, value, for_op, version=None):
        self.index = index
        self.kept = kept
        self.value = value
        self.version = version
        # Paddle 2.6 only: saved by a C++ op (not a PyLayer), so what we return is
        # consumed by TensorWrapper::recover and must be a disposable tensor.
        self.for_op = for_op


class _Frame:
    """State of one non-reentrant recompute call, shared by its hooks."""

    def __init__(self, function, args, kwargs, preserve_rng_state, check="shapes", policy=None):
        self.function = function
        # what the block's policy keeps from its forward (:mod:`.policy`); None: full
        self.policy = policy
        self.kept, self.sublayers, self.keeps_whole = (
            NOTHING if policy is None else policy.plan(function, args, kwargs)
        )
        #: the indices of the saved tensors kept because the block was kept whole (None: not)
        self.whole = None
        self.whole_read = False  # backward read a tensor kept because of it
        self.seconds = None  # a measuring call's forward time
        self.replaying = False  # inside rerun()
        self.cursor = 0  # rerun(): the index of the next saved tensor
        self.check = check  # "shapes", "values" or "none"
        # values check: index -> (forward name, fingerprint tensor), recomputed tensors only
        self.prints: dict = {}
        self.args = args
        self.kwargs = kwargs
        self.rng = _rng.capture() if preserve_rng_state else None
        self.amp = _amp.capture()
        self.arg_tensors = list(iter_tensors((args, kwargs)))
        self.arg_ids = {id(t) for t in self.arg_tensors}
        self.arg_versions = [t._inplace_version() for t in self.arg_tensors]
        self.specs: list = []
        self.holders: list = []
        #: ``[(index, tensor)]`` of the empty holders while the forward runs (then None)
        self.pending: list = []
        #: indices of kept sublayers' saved tensors backward let go of and reads again: the next
        #: recomputation runs their sublayers and stores them (:meth:`unpack`)
        self.wanted: set = set()

    # -- forward -----------------------------------------------------------
    def _keep(self, x) -> bool:
        if x is None:
            return True
        if is_parameter(x) or id(x) in self.arg_ids:
            return True
        return bool(x.is_leaf and not x.stop_gradient)

    def pack(self, x):
        """The forward's pack hook; an empty holder's tensor waits in ``self.pending`` until the
        forward returns or raises (:meth:`forward_done`, :meth:`forward_failed`)."""
        kept = self._keep(x)
        for_op = UNPACK_MOVES_HOLDER and not _hooks.in_pylayer_save()
        if not kept and self.sublayers is not None and self.sublayers.depth:
            # saved by a sublayer the policy does not recompute: kept as it is (a detached
            # alias: a tensor made inside the graph held from it would hold its own node)
            holder = _Holder(len(self.specs), True, detached_view(x), for_op, x._inplace_version())
            self.specs.append(spec(x))
            self.holders.append(weakref.ref(holder))
            return holder
        holder = _Holder(len(self.specs), kept, x if kept else None, for_op)
        if not kept:
            self.pending.append((holder.index, x))
        if self.check == "values" and not kept:
            fp = fingerprint(x)
            if fp is not None:
                self.prints[holder.index] = (x.name, fp)
        self.specs.append(spec(x))
        self.holders.append(weakref.ref(holder))
        return holder

    def unpack(self, holder):
        if holder.kept and holder.version is None:  # a parameter, an argument, kept for good
            if id(holder.value) in self.arg_ids:  # (backward reads the argument itself)
                self._check_arguments_unchanged()
            if holder.for_op and holder.value is not None:
                return buffer_sharing_tensor(holder.value)
            return holder.value
        if self.whole is not None and holder.kept and holder.value is not None:
            self._reads_whole(holder)
        if holder.kept and holder.value is not None:  # saved by a kept sublayer
            if holder.value._inplace_version() != holder.version:
                self._raise_modified(holder)
            value = holder.value
            if self.args is not None and _errors.frees_graph():
                holder.value = None  # (module docstring: backward read it)
            return buffer_sharing_tensor(value) if holder.for_op else value
        try:
            if holder.value is None:
                if holder.kept:  # a kept sublayer's, read before and let go of
                    self.wanted.add(holder.index)
                self.rerun()
            if holder.value is None:  # pragma: no cover - defensive
                raise RecomputeError(
                    f"recompute({function_name(self.function)}): saved tensor #{holder.index} "
                    "was not reproduced by recomputation"
                )
        except RecomputeError as e:
            _errors.record(e)  # Paddle's engine re-raises it as OSError
            raise
        if holder.kept:
            return self.unpack(holder)
        value, holder.value = holder.value, None  # backward has it: freed with its use
        return value

    def keep_whole(self, pending):
        """The forward returned, and the plan keeps the block whole while it is its thread's
        last block: every tensor it saved is kept (``pending``: ``[(index, tensor)]``), as a
        kept sublayer's are, and the block stops being the last one when the thread starts
        another block call (:func:`release_last`).  The step's last block keeps its values
        through the loss head to its own backward, which reads them: it is not recomputed
        (its recomputation would start right away, made for nothing but to be read)."""
        whole = []
        holders = self.holders
        for index, x in pending:
            holder = holders[index]()
            if holder is not None:
                holder.kept, holder.version = True, x._inplace_version()
                holder.value = detached_view(x)
                whole.append(index)
        self.whole = frozenset(whole)
        release_last()
        _last.frame = weakref.ref(self)

    def release_whole(self):
        """The block is recomputed after all: what :meth:`keep_whole` kept is dropped (an
        empty holder again; its unpack recomputes)."""
        whole, self.whole = self.whole, None
        if whole is None:
            return
        for index in whole:
            holder = self.holders[index]()
            if holder is not None:
                holder.kept, holder.value, holder.version = False, None, None

    def _reads_whole(self, holder):
        """Backward reads a kept saved tensor of a block kept whole.  One of the block's
        activations changed in place since the forward (an op after the block on an output
        it saved): the block is recomputed, as under full recompute.  At the first read, what
        the policy keeps for a recomputation (GEMM outputs, kept sublayers' outputs) is let
        go of in a backward that frees the graph (a recomputation, if one comes after all,
        computes them)."""
        if holder.index in self.whole and holder.value._inplace_version() != holder.version:
            self.release_whole()
            return
        if not self.whole_read:
            self.whole_read = True
            _policy.record_whole(self.policy, self.kept, self.sublayers, _errors.frees_graph())

    def wants(self, start: int, end: int) -> bool:
        """Whether backward wants one of saved tensors #``start`` to #``end`` (a kept
        sublayer's) again after it let go of it: a recomputation must run that sublayer."""
        return any(start <= i < end for i in self.wanted)

    def _raise_modified(self, holder):
        e = RecomputeError(
            f"recompute({function_name(self.function)}): saved tensor #{holder.index} "
            f"{describe(holder.value)}, kept from the forward by the recompute policy "
            f"{self.policy.name!r}, has been modified by an inplace operation after the forward "
            f"saved it: its inplace version is {holder.value._inplace_version()}, the forward "
            f"saved version {holder.version}; its gradient would be wrong (without recompute "
            "Paddle refuses this too). Compute that change out of place."
        )
        _errors.record(e)  # Paddle's engine re-raises it as OSError
        raise e

    def forward_done(self):
        """The block's forward returned: drop what recomputation will reproduce -- unless the
        block changed one of its tensor arguments in place, when recomputation could not
        reproduce it: then every saved tensor is kept (module docstring), as a detached alias
        (the tensor itself would hold its own grad node from inside the graph: a reference
        cycle through C++ that no garbage collector sees, and the block's graph would live
        for good)."""
        measured = self.sublayers is not None and self.sublayers.measure is not None
        block = self.saved() if measured else None
        pending, self.pending = self.pending, None
        changed = self._release_changed_arguments()
        if changed:
            stats.bump(stats.recompute, "kept_from_forward")
            self.prints.clear()
        if self.policy is not None:
            saved = 0 if changed or self.sublayers is None else self._saved_bytes()
            _policy.forward_done(
                self.policy,
                self.kept,
                self.sublayers,
                recomputed=not changed,
                saved_bytes=saved,
                block=block,
            )
        if not changed and self.keeps_whole:
            self.keep_whole(pending)
        if changed:
            holders = self.holders
            for index, x in pending:
                holder = holders[index]()
                if holder is not None:
                    holder.kept = True
                    holder.value = detached_view(x)
        self.arg_tensors = None  # (the arguments themselves stay in self.args)

    def saved(self) -> BlockSaved:
        """While the forward runs: what the block saved so far, as a measuring call of a
        ``budget:`` plan reports it."""
        return BlockSaved(self.activation_bytes(), self.input_bytes(), self.seconds)

    def activation_bytes(self, start: int = 0, outputs=()) -> int:
        """While the forward runs: the bytes of the activations saved since saved tensor
        #``start`` that recomputation will reproduce (what the block keeps without recompute,
        less the parameters and arguments, kept anyway), with ``outputs`` (a sublayer's, kept
        with what it saved), each buffer once (:func:`.tensors.distinct_bytes`)."""
        saved = [x for index, x in self.pending if index >= start]
        return distinct_bytes(saved + list(outputs))

    def input_bytes(self) -> int:
        """The bytes of the block's tensor arguments that need a gradient: what full recompute
        keeps of each block call alive until its backward (the hidden states passed from block
        to block; a mask or position ids shared by every block are not the block's own)."""
        return distinct_bytes(t for t in self.arg_tensors if not t.stop_gradient)

    def _saved_bytes(self) -> int:
        """The bytes kept because of kept sublayers: the activations they saved and their
        outputs, each buffer once."""
        saved = []
        for ref in self.holders:
            holder = ref()
            if holder is not None and holder.version is not None:
                saved.append(holder.value)
        return distinct_bytes(saved + self.sublayers.held_tensors())

    def _release_changed_arguments(self):
        """The ids of the tensor arguments the forward changed in place (none: nothing done).
        Such an argument now has a grad node inside the block: held from the graph (a kept
        holder, the frame's arguments) it would hold that node itself, a cycle through C++.
        The block is never recomputed then (:meth:`forward_done`), so the arguments are not
        needed, and kept holders get aliases."""
        changed = {
            id(t) for t, v in zip(self.arg_tensors, self.arg_versions) if t._inplace_version() != v
        }
        if changed:
            self.args = self.kwargs = None
            for ref in self.holders:
                holder = ref()
                if (
                    holder is not None
                    and holder.kept
                    and id(holder.value) in changed
                    and not is_parameter(holder.value)
                ):
                    holder.value = detached_view(holder.value)
        return changed

    def forward_failed(self):
        """The block's forward raised: what it made is garbage, and must be collectable."""
        self.pending = None
        self._release_changed_arguments()
        self.arg_tensors = None

    # -- backward ----------------------------------------------------------
    def _check_arguments_unchanged(self):
        check_arguments_unchanged(
            self.function, iter_tensors((self.args, self.kwargs)), self.arg_versions
        )

    def rerun(self):
        """Re-run the function; store a view of each recomputed tensor for its holder."""
        stats.bump(stats.recompute, "recomputations")
        release_last(unread=True)
        self._check_arguments_unchanged()
        self.cursor = 0
        problems: list = []
        specs, holders = self.specs, self.holders
        check_shapes = self.check != "none"
        prints, recomputed_prints = self.prints, []

        def inner_pack(x):
            i = self.cursor
            self.cursor = i + 1
            if i >= len(specs):
                if len(problems) < 3 and check_shapes:
                    problems.append(
                        f"recomputation saved an extra tensor #{i} {describe(x)}; "
                        f"the forward saved only {len(specs)}"
                    )
                return None
            x_spec = spec(x) if check_shapes or UNPACK_MOVES_HOLDER else None
            if check_shapes and x_spec != specs[i]:
                want = (
                    "None"
                    if specs[i] is None
                    else (f"shape={list(specs[i][0])}, dtype={specs[i][1]}")
                )
                problems.append(
                    f"saved tensor #{i}: forward saved {want}, recomputation saved {describe(x)}"
                )
                return None
            holder = holders[i]()
            if holder is None:
                return None
            if holder.kept:
                if i in self.wanted:  # a kept sublayer's, let go of and wanted again
                    self.wanted.discard(i)
                    holder.value, holder.version = detached_view(x), x._inplace_version()
                return None
            if i in prints:
                recomputed_prints.append((i, fingerprint(x), describe(x)))
            holder.value = buffer_sharing_tensor(x, x_spec) if holder.for_op else detached_view(x)
            return None

        def inner_unpack(_):  # the recomputed graph is never back-propagated
            raise RecomputeError("internal: a tensor saved during recomputation was unpacked")

        kept, sublayers = self.kept, self.sublayers
        if self.policy is not None:
            _policy.rewind(self.policy, kept, sublayers, _errors.frees_graph())
        self.replaying = True
        try:
            with _rng.replayed(self.rng), self.amp.replayed(), paddle.set_grad_enabled(
                True
            ), _hooks.hooks(inner_pack, inner_unpack), _recomputing.running(
                inner_pack, kept
            ), _saved_sublayers.running(sublayers, self):
                self.function(*self.args, **self.kwargs)
        finally:
            self.replaying = False
        counter = self.cursor
        if self.policy is not None:
            _policy.record_replay(self.policy, kept, sublayers)

        if counter < len(specs) and check_shapes:
            problems.append(
                f"recomputation saved {counter} tensors, the forward saved {len(specs)} "
                f"(first missing: #{counter}, forward saved "
                f"{'None' if specs[counter] is None else list(specs[counter][0])})"
            )
        if recomputed_prints and not problems:
            problems.extend(_value_problems(prints, recomputed_prints))
        if problems:
            for ref in holders:  # nothing recomputed stays behind
                holder = ref()
                if holder is not None and not holder.kept:
                    holder.value = None
            raise RecomputeError(
                f"recompute({function_name(self.function)}) is not deterministic: "
                + "; ".join(problems)
                + ". Gradients would be wrong. Make the block's saved tensors depend only "
                "on its inputs (use preserve_rng_state=True for dropout, avoid "
                "data-dependent branches)."
            )


def _value_problems(prints, recomputed):
    """Messages for recomputed tensors whose fingerprint differs from the forward's.

    ``prints``: index -> (forward name, fingerprint); ``recomputed``: [(index,
    fingerprint, description)].  One device-to-host copy for all of them."""
    idx = [i for i, _, _ in recomputed]
    both = paddle.stack([prints[i][1] for i in idx] + [fp for _, fp, _ in recomputed]).numpy()
    fwd, rec = both[: len(idx)], both[len(idx) :]
    problems = []
    for k, (i, _, desc) in enumerate(recomputed):
        field = fingerprint_mismatch(fwd[k], rec[k])
        if field is not None:
            problems.append(
                f"saved tensor #{i} (forward name {prints[i][0]!r}; recomputed {desc}) has "
                f"different values: {FINGERPRINT_FIELDS[field]} {fwd[k][field]!r} in the forward, "
                f"{rec[k][field]!r} in recomputation"
            )
            if len(problems) == 3:
                break
    return problems


def recompute_non_reentrant(
    function, preserve_rng_state, args, kwargs, check="shapes", policy=None
):
    """Run ``function`` under hooks that drop activations and keep parameters."""
    stats.bump(stats.recompute, "non_reentrant")
    return run(function, preserve_rng_state, args, kwargs, check, policy)


def run(function, preserve_rng_state, args, kwargs, check="shapes", policy=None):
    """The non-reentrant recompute itself (also what a reentrant call runs whose inputs
    need no gradient or that has a policy: :func:`.reentrant.recompute_reentrant`); counts
    nothing.  ``policy``: a :class:`.policy.Policy`, or None for full recompute."""
    _hooks.install_save_shim()
    _errors.install()
    release_last()
    with _rng.exclusive(preserve_rng_state):  # capture .. end of forward: see rng.py
        frame = _Frame(function, args, kwargs, preserve_rng_state, check, policy)
        # The frame holds the forward's saved tensors until the forward returns or raises, and
        # must let go of them then whatever happens: the graph reaches the frame (through its
        # unpack hook), and a tensor made inside the graph held there holds its grad node -- a
        # reference cycle through C++ that no garbage collector sees.
        try:
            with _hooks.hooks(frame.pack, frame.unpack), _recomputing.running(
                None, frame.kept
            ), _saved_sublayers.running(frame.sublayers, frame):
                if frame.sublayers is None or frame.sublayers.measure is None:
                    outputs = function(*args, **kwargs)
                else:  # (a budget: policy's measuring call: the block's time too)
                    first = next(iter(frame.arg_tensors), None)
                    outputs, frame.seconds = timed(first, function, *args, **kwargs)
        except BaseException:
            frame.forward_failed()
            raise
        frame.forward_done()
        return outputs
