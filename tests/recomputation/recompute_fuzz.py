"""Helpers of the differential recompute fuzzer (tests/recomputation/test_recompute_fuzz.py).

A :class:`Case` (drawn by hypothesis from :func:`cases`) describes a small model and how
a training loop calls it: which block inputs need a gradient, which parameters are frozen
at each micro-step, tied weights, a layer used twice, ``paddle.no_grad()`` regions,
non-tensor positional/keyword arguments, the block's output structure (tensor, tuple with
None, dict, its own input, views of it), a nested recompute of another mode, dropout, in-place
ops (:data:`in_place_ops.IN_PLACE`, one kind per case) on a linear's output -- fleet's in-place
all-reduce after its row-parallel linear among them -- on an intermediate value and on the
block's own input, and ``MixPrecisionLayer`` on none / part / all of the model.  :func:`run_case` trains it for
the drawn micro-steps, accumulating ``.grad`` / ``main_grad``, with recompute ``"none"``,
``"reentrant"``, ``"non_reentrant"`` (ours) or ``"native_*"`` (Paddle's own, unpatched),
and returns every output and every gradient, so that the test can compare a recomputed
run with the same model run without recompute.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np
import paddle
import paddle.nn.functional as F
from hypothesis import strategies as st
from in_place_ops import IN_PLACE
from paddle.distributed.fleet.utils import recompute as native_recompute
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from helpers import nonzero_biases
from paddle_mgrad.recomputation import budget, policy as policy_mod

D = 4  # feature width: tiny, the point is the graph, not the numbers

#: block body operations (see Net.body)
OPS = (
    "lin_a",
    "lin_b",
    "twice",
    "tanh",
    "no_grad",
    "add_x1",
    "pair",
    "scale",
    "dropout",
    "nested",
    "param_arg",
    "ip_linear",
    "ip_mid",
)
#: output structures of the block (see Net.outputs)
OUTS = ("tensor", "tuple_none", "dict", "input", "view", "input_only")
#: the recompute policies drawn: ``save:`` keeps ``lin_a`` (twice under "twice"), or every
#: Linear of the block by class name (``lin_b`` of the nested block too; ``pre`` runs outside);
#: ``budget:`` measures the first calls of each kind of block (one process: the examples
#: share the plans), then keeps what its plan chose among the block's direct sublayers
POLICIES = ("full", "gemm", "save:lin_a", "save:Linear", "budget:0.5", "budget:1")
#: the budget policy the fuzzer plans as if one block were alive at a time (:func:`run_case`)
ONE_BLOCK = "budget:1"
PARAMS = (
    "pre.weight",
    "pre.bias",
    "lin_a.weight",
    "lin_a.bias",
    "lin_b.weight",
    "lin_b.bias",
    "extra",
)


@dataclasses.dataclass(frozen=True)
class Case:
    mode: str  # "reentrant" / "non_reentrant"
    fused: bool  # paddle_mgrad's fused linear on
    preserve_rng: bool
    x0_source: str  # "data" (leaf) / "pre" (through a linear outside) / "leaf_grad"
    x1_grad: Optional[bool]  # None: no second input
    pair_grad: Optional[Tuple[bool, bool]]  # None: no tuple argument
    ops: Tuple[str, ...]
    out: str
    tied: bool  # lin_b.weight is lin_a.weight
    mix: str  # MixPrecisionLayer on "none" / "lin_a" / "all"
    frozen: Tuple[Tuple[bool, ...], ...]  # per micro-step, per PARAMS entry
    nested_mode: str  # mode of the nested recompute ("reentrant"/"non_reentrant")
    scale: float  # non-tensor positional argument
    shift_kw: float  # non-tensor keyword argument
    seed: int
    in_place: str = "add_"  # the kind of the in-place ops (IN_PLACE key)
    ip_input: bool = False  # the block starts with that op on its input x0
    policy: str = "full"  # the recompute policy of ours (nested blocks too)

    @property
    def changes_input(self):
        """Whether the block changes its input in place (not on a leaf that needs a gradient:
        Paddle refuses that without recompute too)."""
        return self.ip_input and self.x0_source != "leaf_grad"

    @property
    def micro(self):
        return len(self.frozen)


@st.composite
def cases(draw, policies=POLICIES, ops_with=()):
    """A drawn case; ``ops_with``: ops every drawn block contains (at drawn places), for the
    fuzzer's self-checks, which need a block with the pattern their mutation breaks."""
    micro = draw(st.integers(1, 3))
    ops = list(draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=5)))
    for op in ops_with:
        ops.insert(draw(st.integers(0, len(ops))), op)
    ops = tuple(ops)
    case = Case(
        mode=draw(st.sampled_from(("reentrant", "non_reentrant"))),
        fused=draw(st.booleans()),
        preserve_rng=draw(st.booleans()),
        x0_source=draw(st.sampled_from(("data", "pre", "leaf_grad"))),
        x1_grad=draw(st.none() | st.booleans()),
        pair_grad=draw(st.none() | st.tuples(st.booleans(), st.booleans())),
        ops=ops,
        out=draw(st.sampled_from(OUTS)),
        tied=draw(st.booleans()),
        mix=draw(st.sampled_from(("none", "lin_a", "all"))),
        frozen=tuple(
            tuple(draw(st.lists(st.booleans(), min_size=len(PARAMS), max_size=len(PARAMS))))
            for _ in range(micro)
        ),
        nested_mode=draw(st.sampled_from(("reentrant", "non_reentrant"))),
        scale=draw(st.sampled_from((0.5, 1.0, 2.0))),
        shift_kw=draw(st.sampled_from((0.0, 0.25))),
        seed=draw(st.integers(0, 2**16)),
        in_place=draw(st.sampled_from(sorted(IN_PLACE))),
        ip_input=draw(st.sampled_from((False,) * 5 + (True,))),
        policy=draw(st.sampled_from(policies)),
    )
    keeps_sublayers = case.policy.startswith(("save:", "budget:"))
    if keeps_sublayers and not case.preserve_rng and "dropout" in ops:
        # Without preserve_rng_state a replay draws the dropout masks anew and advances the
        # generator (Paddle's documented behaviour): the oracle expects the values check to
        # see other masks in the recomputed tensors.  A kept sublayer after the dropout holds
        # the forward's values, so nothing recomputed may differ while later micro-steps still
        # draw other masks than the run without recompute: no oracle there.
        case = dataclasses.replace(case, preserve_rng=True)
    return case


class Net(paddle.nn.Layer):
    """``pre`` (outside the block) feeds ``lin_a``/``lin_b`` inside it; ``extra`` is a
    parameter passed to the block as an argument."""

    def __init__(self, case):
        super().__init__()
        self.case = case
        self.pre = paddle.nn.Linear(D, D)
        self.lin_a = paddle.nn.Linear(D, D)
        self.lin_b = paddle.nn.Linear(D, D)
        if case.tied:
            self.lin_b.weight = self.lin_a.weight
        self.extra = self.create_parameter([D, D])
        nonzero_biases(self)
        self.rc = None  # how the nested recompute is called (set by run_case)

    def named(self):
        """PARAMS name -> parameter (a tied weight appears under both names)."""
        return {
            "pre.weight": self.pre.weight,
            "pre.bias": self.pre.bias,
            "lin_a.weight": self.lin_a.weight,
            "lin_a.bias": self.lin_a.bias,
            "lin_b.weight": self.lin_b.weight,
            "lin_b.bias": self.lin_b.bias,
            "extra": self.extra,
        }

    def inner(self, h, k):
        return paddle.tanh(self.lin_b(h)) * k

    def body(self, x0, scale, x1, pair, extra, shift=0.0):
        in_place = IN_PLACE[self.case.in_place]
        if self.case.changes_input:
            x0 = in_place(x0)
        h = x0
        for op in self.case.ops:
            if op == "lin_a":
                h = self.lin_a(h)
            elif op == "lin_b":
                h = self.lin_b(h)
            elif op == "twice":  # a layer used twice
                h = self.lin_a(paddle.tanh(self.lin_a(h)))
            elif op == "tanh":
                h = paddle.tanh(h)
            elif op == "no_grad":  # a region whose result is a constant
                with paddle.no_grad():
                    c = self.lin_b(h).mean()
                h = h * (1.0 + 0.1 * paddle.tanh(c))
            elif op == "add_x1" and x1 is not None:
                h = h + x1 * scale
            elif op == "pair" and pair is not None:
                h = h * pair[0] + pair[1]
            elif op == "scale":
                h = h * scale + shift
            elif op == "dropout":
                h = F.dropout(h, p=0.3, training=True)
            elif op == "nested":
                h = self.rc(self.inner, h, 0.5, use_reentrant=self.case.nested_mode == "reentrant")
            elif op == "param_arg":
                h = paddle.matmul(h, extra)
            elif op == "ip_linear":  # an in-place op on a linear's output
                h = in_place(self.lin_b(h))
            elif op == "ip_mid":  # ... on an intermediate value (a scale saves nothing)
                h = in_place(h * 1.25)
        return self.outputs(h, x0)

    def outputs(self, h, x0):
        out = self.case.out
        if out == "tensor":
            return h
        if out == "tuple_none":
            return h, None, h * 2.0
        if out == "dict":
            return {"h": h, "x": x0}
        if out == "input":
            return h, x0
        if out == "view":
            return h, x0[:, :2], x0.reshape([-1])
        return x0  # "input_only": the block hands back its input unchanged


def _tensors(out):
    """The tensor outputs, in order (dict: by key)."""
    if isinstance(out, dict):
        out = [out[k] for k in sorted(out)]
    elif not isinstance(out, (tuple, list)):
        out = [out]
    return [o for o in out if isinstance(o, paddle.Tensor)]


def _to_np(t):
    return None if t is None else t.numpy().astype("float64")


def expects_value_check(case):
    """Dropout replayed without its RNG state gives other masks in recomputation: Paddle's
    documented behaviour, not a gradient to match.  There the fuzzer asks for the values
    determinism check and accepts a :class:`~paddle_mgrad.RecomputeError` or equality."""
    return not case.preserve_rng and "dropout" in case.ops


def run_case(case, how):
    """Train ``case`` for its micro-steps with recompute ``how``; return a dict of
    numpy arrays (or None) keyed by what they are: step outputs, input grads, param grads.

    Under a ``budget:`` policy each run plans anew, after its first block call and backward
    (not the first :data:`~paddle_mgrad.recomputation.budget.MEASURED_CALLS` calls): the
    micro-steps after it run the plan, so one example covers both the measuring and the
    planned calls.  Under :data:`ONE_BLOCK` the planner counts one block alive at a time (its
    budget the fraction of a block's bytes, a candidate's cost its bytes): with nested
    recompute two are, and ``budget:1`` would then refuse a linear output that no op saves
    (it costs more than no recompute holds), so few examples would keep linear outputs and
    sublayers together -- what the fuzzer is here to check is that whatever a plan keeps is
    exactly what the forward computed."""
    if not case.policy.startswith("budget:") or how == "none" or how.startswith("native"):
        return _run_case(case, how)
    measured_calls = budget.MEASURED_CALLS
    policy_mod._NAMED.pop(case.policy, None)
    budget.MEASURED_CALLS = 1
    if case.policy == ONE_BLOCK:
        planner = budget.Planner(case.policy, 1.0, live_blocks=1)
        # (nor the block whole: each step's last one, it would never be recomputed; budget:0.5
        # draws that)
        planner.last_block_bytes = lambda kind: 2.0**62
        policy_mod._NAMED[case.policy] = policy_mod.Policy(case.policy, gemm=False, planner=planner)
    try:
        return _run_case(case, how)
    finally:
        budget.MEASURED_CALLS = measured_calls
        policy_mod._NAMED.pop(case.policy, None)


def _run_case(case, how):
    paddle_mgrad.disable()
    if not how.startswith("native"):
        paddle_mgrad.enable(recompute=True, fused_linear=case.fused)
    paddle.seed(case.seed)
    net = Net(case)
    if case.mix == "all":
        MixPrecisionLayer(net, dtype="float16")
    elif case.mix == "lin_a":
        MixPrecisionLayer(net.lin_a, dtype="float16")

    def rc(function, *args, use_reentrant=True, **kwargs):
        if how == "none":
            return function(*args, **kwargs)
        if how.startswith("native"):
            # Paddle 2.6's non-reentrant recompute cannot preserve RNG state on CPU at all;
            # this run only asks whether Paddle refuses the pattern itself
            return native_recompute(
                function, *args, use_reentrant=use_reentrant, preserve_rng_state=False, **kwargs
            )
        if expects_value_check(case):
            kwargs["determinism_check"] = "values"
        return paddle_mgrad.recompute(
            function,
            *args,
            use_reentrant=use_reentrant,
            preserve_rng_state=case.preserve_rng,
            policy=case.policy,
            **kwargs,
        )

    net.rc = rc
    rs = np.random.RandomState(case.seed)
    weights = [paddle.to_tensor(rs.standard_normal([D * D]).astype("float32")) for _ in range(3)]
    result = {}
    params = net.named()
    for step, frozen in enumerate(case.frozen):
        for name, flag in zip(PARAMS, frozen):
            params[name].stop_gradient = flag
        if case.tied:  # one object: the lin_a entry decides
            net.lin_a.weight.stop_gradient = frozen[PARAMS.index("lin_a.weight")]
        data = paddle.to_tensor(rs.standard_normal([2, D]).astype("float32"))
        leaves = {}
        if case.x0_source == "pre":
            x0 = net.pre(data)
        elif case.x0_source == "leaf_grad":
            x0 = data
            x0.stop_gradient = False
            leaves["x0"] = x0
        else:
            x0 = data
        x1 = pair = None
        if case.x1_grad is not None:
            x1 = paddle.to_tensor(rs.standard_normal([2, D]).astype("float32"))
            x1.stop_gradient = not case.x1_grad
            leaves["x1"] = x1
        if case.pair_grad is not None:
            pair = tuple(
                paddle.to_tensor(rs.standard_normal([2, D]).astype("float32")) for _ in range(2)
            )
            for i, (p, g) in enumerate(zip(pair, case.pair_grad)):
                p.stop_gradient = not g
                leaves[f"pair{i}"] = p
        use_reentrant = case.mode == "reentrant"
        out = rc(
            net.body,
            x0,
            case.scale,
            x1,
            pair,
            net.extra,
            use_reentrant=use_reentrant,
            shift=case.shift_kw,
        )
        outs = _tensors(out)
        loss = None
        for k, o in enumerate(outs):
            result[f"step{step}.out{k}"] = _to_np(o)
            term = (o.reshape([-1]) * weights[k % 3][: int(np.prod(o.shape))]).sum()
            if not o.stop_gradient:
                loss = term if loss is None else loss + term
        result[f"step{step}.n_out"] = len(outs)
        if loss is not None:
            loss.backward()
        for name, t in leaves.items():
            result[f"step{step}.{name}.grad"] = _to_np(t.grad)
    seen = set()
    for name, p in params.items():
        if id(p) in seen:
            continue
        seen.add(id(p))
        result[f"{name}.grad"] = _to_np(p.grad)
        result[f"{name}.main_grad"] = _to_np(getattr(p, "main_grad", None))
    paddle_mgrad.disable()
    return result


def differences(got, ref, rtol=1e-5, atol=1e-6):
    """Human-readable list of the entries where ``got`` differs from ``ref``."""
    problems = []
    for key in sorted(set(got) | set(ref)):
        g, r = got.get(key, "missing"), ref.get(key, "missing")
        if isinstance(g, str) or isinstance(r, str):
            problems.append(
                f"{key}: {g if isinstance(g, str) else 'present'} vs "
                f"{r if isinstance(r, str) else 'present'}"
            )
        elif g is None or r is None or isinstance(g, int):
            if (g is None) != (r is None) or (isinstance(g, int) and g != r):
                problems.append(
                    f"{key}: {g if g is None or isinstance(g, int) else 'set'} vs "
                    f"reference {r if r is None or isinstance(r, int) else 'set'}"
                )
        elif g.shape != r.shape or not np.allclose(g, r, rtol=rtol, atol=atol):
            err = np.abs(g - r).max() if g.shape == r.shape else f"shape {g.shape} vs {r.shape}"
            problems.append(f"{key}: max abs diff {err}")
    return problems
