"""The ``budget:<fraction>`` recompute policy: which sublayers and GEMM outputs to keep, measured
on this machine.

``save:<pattern>`` keeps the sublayers the user names (:mod:`.saved_sublayers`); ``gemm`` keeps
every GEMM output.  ``budget:f`` chooses among both: keep what spares the most replay time, so
that the recompute blocks alive at once hold ``f`` times the bytes they hold without
recompute, and recompute the rest.  What is costly depends on the machine and the model
(on a GPU the GEMMs dominate a decoder layer's time, on a CPU attention's softmax and the
elementwise ops weigh more), so it is measured, not assumed:

* **Candidates**: the direct sublayers of the Layer the block runs (a decoder layer's norms,
  attention, MLP; the block's Layer found as for ``save:``), kept whole; and the output of each
  fused linear whose weight is a parameter of that Layer (``gemm:<parameter path>``,
  ``gemm:mlp.up_proj.weight``), kept as ``gemm`` keeps it.  Blocks are planned by kind: the
  Layer's class, its sublayers' names and its parameters' paths, so every decoder layer of a
  model shares one plan, and a dense and a mixture-of-experts decoder layer of one class
  (DeepSeek's first layers and the others) are two kinds (``stats.plans``: the class name, then
  ``#2``, ``#3``, ... for further kinds of one class).
* **Measuring**: the first :data:`MEASURED_CALLS` calls of a kind, and any before the first
  backward, run as full recompute (so bit-identical like every policy; each kept whole while it
  is its thread's last block call: the step's last block, below) while each candidate's
  forward is timed (host clock; on an accelerator synchronised around each candidate, in these
  calls only) and the bytes it costs to keep are counted: for a sublayer, the activations its
  ops save (the pack hook sees them; parameters and the block's arguments are kept anyway and
  cost nothing) plus its tensor outputs, each buffer once (a tensor saved by two ops, a reshape
  of it); for a linear, its output.  A linear whose output is changed in place after it (fleet's
  in-place all-reduce, a residual ``add_``) cannot be kept and is no candidate.  The block's own
  activation bytes (what it keeps without recompute, ``A``) and its arguments that need a
  gradient (what full recompute keeps of it, ``I``: the hidden state) are counted too, and the
  first backward tells how many block calls were alive at once (``L``: the calls since the last
  recomputation, at a recomputation; a step's decoder layers, or a pipeline's layers times its
  micro-batches in flight).  A candidate's time is its minimum over those calls (the first call
  of a process pays warm-ups), its bytes their mean.
* **Budget**: the blocks hold ``L·(A + I)`` without recompute, ``L·I + A`` under full recompute
  (every block's input, and the activations of the one being recomputed).  A plan keeping ``K``
  of each block adds ``L·K``: ``K`` in every other block alive, and in the one being
  recomputed too -- its replay peaks where its costliest activations are made (a decoder
  layer's attention scores and softmax), and holds then every value kept for the ops after
  that point, which full recompute has not made yet (measured on a llama decoder layer, host
  allocator read at each tensor the replay saves: keeping the gate or up projection's output
  or the post-attention norm raised the step's peak by their bytes in every block alive;
  keeping q, the input norm, the MLP or the attention whole by less, down to ``(L - 1)·K``,
  as what the replay consumes before its peak is there under full recompute too: the count
  errs high, never low).
  A step also holds memory outside its blocks at its peak (``O``: logits, the loss, gradients,
  backward's temporaries), under every policy alike: it is read from the allocator
  (:mod:`.memory`) in the measured steps -- the most a step held above what was allocated at its
  first block call (the allocator's peak, where the step raised it; else what it holds at each
  replay), less what full recompute's blocks hold then.  So that the step's peak is ``f`` times
  no recompute's, ``f·(O + L·(A + I))``, the plan may add ``f·(O + L·(A + I)) - O - L·I - A``
  (:meth:`Planner.accounting`); with one block alive at a time, whose peak no plan changes,
  ``f·A`` of its bytes.  Below what full recompute holds (two layers hold about half) nothing
  but what costs no byte is kept.  Where Paddle keeps no allocator statistics, ``O`` is 0; in
  a first step, gradient buffers allocated as its backward runs count as ``O`` (later steps
  hold them before they start): the plan errs toward memory.
* **Choice**: the candidates that spare the most replay time together within the budget
  (bytes as the budget counts them), exactly (:func:`_spare_most`, a knapsack): a sublayer is
  kept whole or any of its linears are -- whole, it spares its linears' outputs and its other
  ops' replay for its other activations' bytes.  So a plan spares at least as much as any
  fixed policy that fits the same budget (``gemm``, ``save:`` of one sublayer); taking
  candidates by time per byte, one at a time, does not promise that (it can fill the budget
  with small candidates and leave no room for the one large one that spares more).  A
  candidate that costs no byte is always taken.  The plan is made at the start of the kind's
  first call once it was measured and a backward seen (every rank of a group at the same
  call); from then on the kind runs the chosen sublayers as ``save:`` and the chosen linears
  as ``gemm`` (in a tensor-parallel group, the plan of the group's first rank: every rank must
  replay the same collectives); the plan is in ``paddle_mgrad.stats.plans`` (per policy, per
  kind: chosen, measured seconds and bytes).

* **The step's last block** (``stats.plans``: ``last_block``): its backward comes right after
  the loss head's, so its recomputation would be made only to be read at once
  (``torch.utils.checkpoint.checkpoint_sequential`` runs its last segment without checkpoint for
  that reason).  A plan may keep it whole: every block call of the kind keeps what it saved
  until its thread starts another block call, and the step's last one is read by its backward,
  not recomputed (:meth:`.non_reentrant._Frame.keep_whole`).  It spares one block's replay per
  step (``1/L`` of the replay time: a quarter with 4 layers, 3 % with 32) for its activations
  ``A`` held through the loss head's forward and backward.  What that adds to the step's peak
  is measured: the measuring calls keep their blocks whole too, so a measured step runs its
  loss head with its last block held, and the planner reads how far the head raised the
  allocator's peak above the forward's (:meth:`Planner.replay_starts`) -- nothing where the
  forward's peak (a block's activations made, the others' inputs held) stays the higher, up to
  ``A`` where the head's is (a large vocabulary's logits and their gradient).  Where no measured
  step raised the allocator's peak (an earlier one, not reset since, hides the head's) it
  counts ``A``.  The plan takes it for a kind whose call, kept whole in a measured step, was
  read by its backward before any recomputation (a decoder layer followed by a recomputed loss
  block never is: the loss block's call lets go of it; nor is a pipeline's first stage under
  1F1B: an earlier micro-batch's recomputation does) where it spares more than the
  candidates it displaces: the best plan without it against the block's measured forward time
  plus the best plan within what is left, spared in the other ``L - 1`` blocks
  (:meth:`Planner._choose`); its cost adds to the others' (the two peaks lie at different
  times: the count errs high).  A measured step so holds up to one block's activations more
  than full recompute while its loss head runs, and counts them in ``O`` (up to ``A`` too high
  where the head holds the step's peak: the budget errs toward memory).

``budget:0`` keeps only what costs nothing (full recompute otherwise); ``budget:1`` may keep up
to what no recompute keeps.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import NamedTuple, Optional

from .. import stats
from ..autograd.recomputing import KeptOutputs
from .memory import allocated_on
from .saved_sublayers import Sublayers, block_layers
from .tensors import iter_tensors

__all__ = ["MEASURED_CALLS", "BlockSaved", "Plan", "Planner"]

#: block calls of a kind measured (at least) before its plan is made
MEASURED_CALLS = 3
#: a candidate's name for the output of the linears whose weight is the parameter at ``path``
GEMM = "gemm:"
#: what the plan's agreement between ranks calls keeping the step's last block whole
LAST = "last block"
#: :attr:`Planner.memory` before the blocks' place is known
_UNSET = object()


class Plan(NamedTuple):
    """What a policy keeps of one block call: the GEMM outputs (``KeptOutputs`` or None:
    none), the sublayers it does not recompute (``Sublayers`` or None: none), and ``whole``:
    whether the call keeps everything it saved while it is the last block its thread ran
    (:meth:`.non_reentrant._Frame.keep_whole`)."""

    kept: object = None
    sublayers: object = None
    whole: bool = False


#: the plan of a block that keeps nothing (full recompute, or no Layer found)
NOTHING = Plan()


# root Layer -> its kind's key; a model's structure is fixed once built
_keys: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _kind(root):
    """A plan's key: the Layer's class, its direct sublayers' names, its parameters' paths."""
    key = _keys.get(root)
    if key is None:
        key = _keys[root] = (
            type(root).__qualname__,
            tuple(name for name, _ in root.named_children()),
            tuple(name for name, _ in root.named_parameters()),
        )
    return key


class _Kind:
    """What was measured of one kind of block, and its plan once made.  ``label``: its name in
    ``stats.plans``; ``names``: every candidate's (sublayers, then one ``gemm:`` per
    parameter); ``owner``: a ``gemm:`` candidate's sublayer (None: a parameter of the Layer
    itself)."""

    __slots__ = (
        "label",
        "names",
        "owner",
        "seconds",
        "bytes",
        "block_bytes",
        "input_bytes",
        "calls",
        "block_seconds",
        "chosen",
        "last",
        "ends_step",
    )

    def __init__(self, label, names, params=()):
        self.label = label
        self.names = tuple(names) + tuple(GEMM + p for p in params)
        self.owner = {GEMM + p: p.split(".")[0] if "." in p else None for p in params}
        self.seconds = {n: None for n in self.names}  # min over calls of the per-call sum
        self.bytes = {n: 0 for n in self.names}  # summed over calls
        self.block_bytes = 0  # summed over calls
        self.input_bytes = 0  # summed over calls
        self.calls = 0
        self.block_seconds = None  # the block's forward: min over calls (None: not timed)
        self.chosen = None  # tuple of names once planned
        self.last = False  # whether the plan keeps the step's last block whole
        self.ends_step = False  # a call of it, kept whole, was read before any recomputation


class BlockSaved(NamedTuple):
    """What a measuring call's block saved for backward when its forward ended."""

    activation_bytes: int  # its activations (``A``), each buffer once
    input_bytes: int  # its tensor arguments that need a gradient (``I``)
    seconds: Optional[float] = None  # its forward's time


class _Measurement:
    """What a measuring :class:`Sublayers` reports to: its planner, its kind, the candidates'
    names by layer id and by weight id."""

    __slots__ = ("planner", "key", "names", "weights")

    def __init__(self, planner, key, names, weights):
        self.planner, self.key, self.names, self.weights = planner, key, names, weights

    def done(self, sublayers, kept, block: BlockSaved):
        """The measured call's forward ended: its figures by candidate name, and what the
        ``block`` saved."""
        seconds, costs = dict(sublayers.times), dict(sublayers.costs)
        for weight, (s, nbytes) in kept.keepable_timings().items():
            name = self.weights.get(weight)  # (one name per weight: summed by weight already)
            if name is not None:
                seconds[name], costs[name] = s, nbytes
        kept.timings.clear()  # (it holds the linears' outputs: not until backward)
        self.planner.measured(
            self.key, seconds, costs, block.activation_bytes, block.input_bytes, block.seconds
        )


def _never(x, weight, y) -> bool:
    return False


def _chosen_weight(ids, x, weight, y) -> bool:
    return id(weight) in ids


class Planner:
    """The plans of one ``budget:`` policy (module docstring)."""

    def __init__(self, name: str, fraction: float, live_blocks: int = None):
        """``live_blocks``: plan for that many block calls alive at once (from the first
        backward on, as counted ones are) instead of the counted number."""
        self.name = name
        self.fraction = fraction
        self.live_blocks = live_blocks
        self.kinds: dict = {}
        self.lock = threading.Lock()
        self.forwards = 0  # block calls since the last replay
        self.live = 0  # the most block calls seen alive at once (at a replay): 0 before one
        # the allocator statistics of the blocks' place (:mod:`.memory`; None: none kept),
        # read while a step is measured
        self.memory = _UNSET
        self._step = None  # (allocated, peak) at the measured step's first block call
        self.step_bytes = 0  # the most a measured step held above that
        self.forward_bytes = 0  # the most the measured step held at a block call's return
        # the most the loss head, run with the step's last block kept whole, raised a measured
        # step's peak above its forward's (None: no step read it, its peak hidden)
        self.head_raise = None
        self.last_key = None  # the kind of the last block call (None: no Layer found)
        # root Layer -> what its plan keeps: (sublayers, weight ids)
        self._planned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def plan(self, function, args, kwargs) -> Plan:
        """The :class:`Plan` of one call of the block: measuring ``KeptOutputs`` and
        ``Sublayers`` while its kind is measured, then the planned ones (None: nothing of that
        sort kept, or no Layer found)."""
        roots = block_layers(function, args, kwargs)
        if not roots:
            with self.lock:
                self.forwards += 1  # (alive until its backward all the same)
                self.last_key = None
            return NOTHING
        root = roots[0]
        key = _kind(root)
        with self.lock:
            first = not self.forwards  # (the first call since a replay: a step's first)
            self.forwards += 1
            self.last_key = key
            if key not in self.kinds:
                same = sum(k[0] == key[0] for k in self.kinds)
                label = key[0] if not same else f"{key[0]}#{same + 1}"
                self.kinds[key] = _Kind(label, key[1], key[2])
        chosen = self.choose(key)
        if first:
            self._step_starts(chosen is None, args, kwargs)
        if chosen is None:
            children = dict(root.named_children())
            weights = {id(p): GEMM + name for name, p in root.named_parameters()}
            if not children and not weights:
                return NOTHING
            names = {id(layer): name for name, layer in children.items()}
            measurement = _Measurement(self, key, names, weights)
            return Plan(
                KeptOutputs(_never, timings={}),
                Sublayers(tuple(children.values()), measurement),
                whole=True,  # (what that costs is measured so: :meth:`replay_starts`)
            )
        layers, ids = self._planned_parts(root, chosen)
        kept = KeptOutputs(functools.partial(_chosen_weight, ids)) if ids else None
        return Plan(kept, Sublayers(layers) if layers else None, self.kinds[key].last)

    def _planned_parts(self, root, chosen):
        """The sublayers of ``root`` its plan keeps whole, and the ids of the weights whose
        linears' outputs it keeps (looked up once per Layer: a model's structure is fixed)."""
        with self.lock:
            parts = self._planned.get(root)
            if parts is None:
                children = dict(root.named_children())
                parts = self._planned[root] = (
                    tuple(children[n] for n in chosen if n in children),
                    frozenset(
                        id(p) for name, p in root.named_parameters() if GEMM + name in chosen
                    ),
                )
        return parts

    def measured(
        self,
        key,
        seconds: dict,
        costs: dict,
        block_bytes: int,
        input_bytes: int,
        block_seconds: Optional[float] = None,
    ):
        """One measured block call is done (its forward): add its figures (seconds and bytes
        by candidate name; the block's activation and input bytes, its forward's time)."""
        with self.lock:
            kind = self.kinds[key]
            if kind.chosen is not None:
                return
            if not seconds:
                return  # the call ran none of the candidates (a branch around them): no measure
            for name in kind.names:
                s = seconds.get(name)
                if s is not None:  # the minimum over the calls that ran it
                    best = kind.seconds[name]
                    kind.seconds[name] = s if best is None else min(best, s)
                kind.bytes[name] += costs.get(name, 0)
            kind.block_bytes += block_bytes
            kind.input_bytes += input_bytes
            if block_seconds is not None:
                best = kind.block_seconds
                kind.block_seconds = block_seconds if best is None else min(best, block_seconds)
            kind.calls += 1

    def _step_starts(self, measured, args, kwargs):
        """The first block call of a step (since a replay): while it is ``measured``, what
        the allocator holds now and its peak so far, to tell what the step adds."""
        with self.lock:
            if self.memory is _UNSET:
                t = next(iter_tensors((args, kwargs)), None)
                self.memory = None if t is None else allocated_on(t)
            memory = self.memory
            self._step = (memory.now(), memory.peak()) if measured and memory else None
            self.forward_bytes = 0

    def forward_returned(self):
        """A block call of this policy returned from its forward: in a measured step, the
        most the step held so far (its forward's peak, each block's activations held in it)."""
        with self.lock:
            if self._step is not None:
                self.forward_bytes = max(self.forward_bytes, self._step_held())

    def replay_starts(self, whole=False):
        """A block of this policy is about to be recomputed, or (``whole``) backward reads one
        kept whole.  The first of a measured step: how far the loss head's forward and backward
        raised the step's peak above its forward's, run with the step's last block kept whole
        (a measuring call keeps it, :meth:`plan`) -- what keeping it costs
        (:meth:`last_block_bytes`).  Read where the step raised the allocator's peak
        (:meth:`_step_peak`); below an earlier peak the head's is hidden, and the step tells
        nothing.  A read of a block
        kept whole before any recomputation of its step: keeping the kind whole spares its
        replay (a decoder layer followed by a recomputed loss block is let go of by the loss
        block's call, a pipeline's first stage's by an earlier micro-batch's recomputation:
        kept whole, they would be recomputed all the same)."""
        with self.lock:
            if whole and self.forwards and self.last_key in self.kinds:
                self.kinds[self.last_key].ends_step = True
            peak = self._step_peak() if self.forwards and self._step is not None else None
            if peak is not None:
                # (forward_bytes, read below an earlier peak, is what the step held then:
                # lower than its forward's peak, so the raise is counted high, never low)
                raised = max(0, peak - self.forward_bytes)
                self.head_raise = max(self.head_raise or 0, raised)

    def _step_peak(self) -> Optional[int]:
        """In a measured step (under the lock): the allocator's peak above what was allocated
        at the step's first block call, where the step raised it (then the step's own); None
        where an earlier peak, not reset since, hides the step's."""
        before, peak_before = self._step
        peak = self.memory.peak()
        return peak - before if peak > peak_before else None

    def _step_held(self) -> int:
        """In a measured step (under the lock): the most it held so far above what was
        allocated at its first block call -- :meth:`_step_peak`, else what it holds now (a
        lower bound)."""
        peak = self._step_peak()
        return self.memory.now() - self._step[0] if peak is None else peak

    def replayed(self):
        """A block of this policy was recomputed (in backward): the block calls since the last
        recomputation were alive at once -- every one holds its arguments and what its plan
        keeps until its own backward.  In a measured step, the most the step held so far
        (:meth:`_step_held`)."""
        with self.lock:
            if self.forwards:
                self.live = self.live_blocks or max(self.live, self.forwards)
                self.forwards = 0
            if self._step is not None:
                self.step_bytes = max(self.step_bytes, self._step_held())

    def choose(self, key):
        """The plan of the kind ``key`` (the names it keeps), made now if it is due: measured
        in :data:`MEASURED_CALLS` calls and a backward seen (which tells how many blocks are
        alive at once); None while it is measured.  Asked at the start of each call, so that
        every rank of a tensor-parallel group plans at the same call and agrees there."""
        with self.lock:
            kind = self.kinds[key]
            if kind.chosen is not None or kind.calls < MEASURED_CALLS or not self.live:
                return kind.chosen
            group = _lockstep_group()
            chosen, last = self._choose(kind)
            if group is not None:
                agreed = _agreed(kind.names + (LAST,), chosen + ((LAST,) if last else ()), group)
                chosen, last = tuple(n for n in agreed if n != LAST), LAST in agreed
            kind.chosen, kind.last = chosen, last
            report = self._report(kind)
        stats.set_plan(self.name, kind.label, report)
        return kind.chosen

    def accounting(self, kind):
        """``(budget, costs)`` of ``kind`` (module docstring): what its plan may add to a
        step's memory over full recompute, ``f·(O + L·(A + I)) - O - L·I - A`` with ``L``
        blocks alive at once and ``O`` held outside them (never below 0); and what keeping
        each measured candidate adds, its bytes in every block alive (the one being recomputed
        included).  With one block alive at a time, whose peak no plan changes: ``f·A``, and
        each candidate's bytes."""
        calls, n = kind.calls, max(self.live, 1)
        a, i = kind.block_bytes / calls, kind.input_bytes / calls
        costs = {name: n * kind.bytes[name] / calls for name in kind.names if kind.seconds[name]}
        if n == 1:
            return self.fraction * a, costs
        o = self.outside_bytes(kind)
        return max(0.0, self.fraction * (o + n * (a + i)) - o - n * i - a), costs

    def outside_bytes(self, kind) -> float:
        """What a measured step held at its peak outside the blocks of ``kind`` (``O``:
        logits, the loss, gradients, backward's temporaries): the most it held above what was
        allocated at its first block call, less what full recompute's blocks hold then (the
        inputs of the other blocks alive, the activations of the one recomputed); 0 where
        the allocator is not read."""
        calls = kind.calls
        a, i = kind.block_bytes / calls, kind.input_bytes / calls
        return max(0.0, self.step_bytes - (self.live - 1) * i - a)

    def last_block_bytes(self, kind) -> float:
        """What keeping a step's last block whole adds to the step's peak (module docstring):
        its activations ``A``, held from its forward through the loss head's forward and
        backward to its own backward -- no more than the head, run so in a measured step,
        raised the step's peak above its forward's; ``A`` where no step read it."""
        a = kind.block_bytes / kind.calls
        return a if self.head_raise is None else min(a, self.head_raise)

    def _choose(self, kind):
        """``(names, last)``: the candidates kept, and whether the step's last block is kept
        whole (module docstring)."""
        budget, nbytes = self.accounting(kind)  # (a candidate never called costs: none)
        seconds = {n: kind.seconds[n] for n in nbytes}
        owner = {n: kind.owner.get(n) for n in nbytes}
        chosen = _spare_most(budget, seconds, nbytes, owner)
        last, live = False, max(self.live, 1)
        whole = self.last_block_bytes(kind)
        if kind.block_seconds and kind.ends_step and whole <= budget:
            # the last block not replayed spares its replay once per step; what else is kept
            # is spared in the other live - 1 blocks (per step: live times a block's figures)
            others = _spare_most(budget - whole, seconds, nbytes, owner)
            spared = live * sum(seconds[c] for c in chosen)
            spared_last = kind.block_seconds + (live - 1) * sum(seconds[c] for c in others)
            if spared_last > spared:
                chosen, last = others, True
        return tuple(n for n in kind.names if n in chosen), last

    def _report(self, kind):
        calls = kind.calls
        return {
            "chosen": list(kind.chosen),
            "last_block": kind.last,
            "last_block_bytes": int(self.last_block_bytes(kind)),
            "block_seconds": kind.block_seconds or 0.0,
            "budget_bytes": int(self.accounting(kind)[0]),
            "block_bytes": kind.block_bytes // calls,
            "input_bytes": kind.input_bytes // calls,
            "outside_bytes": int(self.outside_bytes(kind)),
            "live_blocks": self.live,
            "measured_calls": calls,
            "measured": {
                n: {
                    "seconds": kind.seconds[n] or 0.0,
                    "bytes": kind.bytes[n] // calls,
                }
                for n in kind.names
                if n not in kind.owner or kind.seconds[n] is not None
            },
        }


def _lockstep_group():
    """The ranks that must keep the same sublayers and GEMM outputs, or None: the
    tensor-parallel group.

    Its ranks run each sublayer's collectives (a row-parallel linear's all-reduce) together;
    a sublayer kept on one rank is not replayed there while another rank's replay waits in
    its all-reduce.  Measured times differ between ranks (noise, a slower core), so plans
    made on each rank alone can differ: they are agreed on (:func:`_agreed`)."""
    try:
        from paddle.distributed import fleet

        group = fleet.get_hybrid_communicate_group().get_model_parallel_group()
    except AttributeError:  # fleet not initialised: no hybrid group
        return None
    return group if group is not None and group.nranks > 1 else None


def _agreed(names, chosen, group):
    """The plan of the group's first rank, on every rank of ``group``: the chosen names as a
    mask over ``names`` (the same on every rank: one kind, one class), broadcast from it."""
    import paddle
    import paddle.distributed as dist

    mask = paddle.to_tensor([int(n in chosen) for n in names], dtype="int32")
    dist.broadcast(mask, src=group.ranks[0], group=group)
    return tuple(n for n, keep in zip(names, mask.numpy().tolist()) if keep)


#: the most partial plans :func:`_spare_most` carries from one candidate to the next; past it,
#: plans within ``budget / _MAX_PLANS`` bytes of each other are merged into the one that spares
#: the most (a decoder layer's dozen candidates never come near it; a mixture of experts' can)
_MAX_PLANS = 2048


def _spare_most(budget, seconds, nbytes, owner) -> frozenset:
    """The candidates that spare the most replay time (``seconds``, by name) within ``budget``
    bytes (``nbytes``, as the budget counts them), where a sublayer is kept whole or any subset
    of its linears (``owner``: a linear's sublayer, or None) is -- not both.

    Exact, a multiple-choice knapsack solved over its Pareto front: the partial plans, each
    (bytes, seconds, names), from which every plan that costs as many bytes or more and spares
    no more time is dropped; each candidate (a sublayer with its linears: once as its linears
    added one by one, once whole) extends every plan that still fits.  So the plan spares at
    least as much as any fixed policy that fits (every linear, one sublayer whole), which
    taking candidates by time per byte does not promise.  Of plans that spare the same time,
    the one of fewest bytes, and then of the earliest candidates (the Layer's order: the same
    on every rank) is kept; a candidate that spares no time is never kept."""
    front = [(0.0, 0.0, ())]

    def fits(plans):
        """``plans`` less those over the budget or no better than a cheaper one (and thinned)."""
        plans = sorted((p for p in plans if p[0] <= budget), key=lambda p: (p[0], -p[1]))
        kept, best = [], 0.0
        for p in plans:  # (sorted is stable: of equal plans, the one listed first)
            if p[1] > best or not kept:
                kept.append(p)
                best = p[1]
        if len(kept) > _MAX_PLANS:  # (the last of each slice of bytes spares the most in it)
            width = budget / _MAX_PLANS
            thinned = {int(p[0] / width): p for p in kept}
            kept = sorted(thinned.values())
        return kept

    def adding(plans, name):
        return [(b + nbytes[name], s + seconds[name], n + (name,)) for b, s, n in plans]

    linears = {n for n in seconds if owner.get(n) in seconds}  # (of a sublayer measured)
    for name in seconds:
        if name in linears:
            continue  # (with its sublayer)
        inner = [n for n in seconds if n in linears and owner[n] == name]
        if not inner:
            front = fits(front + adding(front, name))
            continue
        parts = front
        for n in inner:
            parts = fits(parts + adding(parts, n))
        front = fits(parts + adding(front, name))  # (its linears, or it whole)
    return frozenset(front[-1][2])
