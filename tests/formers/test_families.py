"""Every PaddleFormers 1.2.0 causal-LM family that runs on a CPU, trained with paddle_mgrad
switched on (``enable(recompute=True, fused_linear=True)``) and full recompute in both modes.

Why every family: most of them apply an in-place op to a linear's output inside the
recomputed decoder layer (llama does not), and a recompute that replays the linear as a leaf
breaks exactly those ("Leaf Var () that doesn't stop gradient can't use inplace strategy" at
the first backward) -- test_paddleformers.py, which trains llama only, cannot see it.  Here each family is a
tiny model (families.py: 2 layers, hidden 32, 4 experts top-2 for MoE, fp32 on the CPU)
wrapped in ``MixPrecisionLayer``; tests/formers/train_family.py, one subprocess per family
(~5 s: Paddle and PaddleFormers import once), accumulates 2 micro-steps into fp32
``main_grad`` per mode, and the test compares each recompute mode against the same family's
run without recompute:

* losses and every parameter's ``main_grad`` **bit-identical** (measured: all 13 families, both
  modes, max difference 0.0 -- recompute replays the same ops on the same values, and our
  fused linear accumulates in the same order);
* every trainable parameter has an fp32 ``main_grad`` and ``.grad`` None; the fused linear and
  its accumulations into ``main_grad`` ran as often as without recompute;
* recompute really ran, in the mode asked (``stats.recompute``: one call and one
  recomputation per decoder layer and per loss, per micro-step);
* grad mode is on after training, and after a recomputation that raised in backward (an
  injected error, caught as a training loop would) grad mode is back on and the next 2
  micro-steps equal the reference (``<mode>_after_error``);
* with ``PADDLE_MGRAD_RECOMPUTE_POLICY=gemm`` (``non_reentrant_gemm``: the fused linears'
  outputs kept from the forward, set in the environment only) the same, bit-identical, and
  the policy's counters show GEMMs that were not recomputed; with ``save:`` (``non_reentrant_save``:
  every decoder layer's attention kept whole) the same, and no attention call recomputed;
  with ``budget:0.75`` (``non_reentrant_budget``) the same, with one plan for the decoder layers
  within the budget, followed by the calls after the measured ones.

Most families call Paddle's ``recompute`` without ``use_reentrant`` (always reentrant,
whatever ``recompute_use_reentrant`` says; families.py): the driver forces the mode through
a test-only wrapper of the name they imported, and the test asserts which families pass the
config's mode themselves (deepseek_v3, gpt_oss) -- a fix in PaddleFormers shows here.

Families, PaddleFormers 1.2.0 (``paddleformers/transformers/``):
* run here, both modes: llama, qwen2, qwen3, qwen2_moe, qwen3_moe, glm4_moe, phi3,
  gemma3_text, ernie4_5, deepseek_v3, gpt_oss; ernie4_5_moe with dense layers only (below);
  qwen3_next, whose decoder layers are never recomputed (no recompute in its modeling code):
  only its loss is.  qwen2/qwen3/qwen2_moe/qwen3_moe/glm4_moe: their ``*Deprecated`` classes
  (the plain-Paddle ones); they, deepseek_v3 and qwen3_next import only with the stand-ins of
  family_standins.py (paddlefleet, paddlefleet_ops are not on the package index).
* cannot run on a CPU (test_families_that_cannot_run_on_cpu asserts each failure):
  - ernie4_5_moe's MoE layers: Paddle's fused MoE dispatch kernels (expand_modality_expert_id,
    moe_gate_dispatch_partial_nosoftmaxtopk) have no CPU kernel;
  - deepseek_v32: built by a provider from PaddleFormers' examples/experiments/paddlefleet
    (not in the wheel) on paddlefleet (not on the package index);
  - deepseek_v4, kimi_k2, glm_moe_dsa, minimax_m2: only a paddlefleet ``GPTModel`` (no
    plain-Paddle class), paddlefleet not on the package index.
* not causal-LM families (multimodal/audio, out of scope): ernie4_5_moe_vl, glm4v_moe,
  glm_ocr, paddleocr_vl, qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe,
  qwen3_omni_moe, kimi_k25, whisper.

What a replayed linear whose output is a leaf gives here (the mutation this sweep was
checked against): non-reentrant "Leaf Var () ... can't use inplace strategy" in qwen2, qwen3,
qwen2_moe, qwen3_moe, glm4_moe, gemma3_text, ernie4_5 and ernie4_5_moe; grad mode left OFF
after an error in a non-reentrant recomputation (the next micro-steps record no graph and fill
no main_grad, silently) in gpt_oss and qwen3_next (the injected error) and gemma3_text,
qwen2_moe, qwen3_moe (after the Leaf Var error); llama, phi3 and deepseek_v3 pass.

Time (2 cores): ~3-4 s per family (Paddle + PaddleFormers import; the training itself
0.3-1.2 s); the module's 14 tests 43 s in one worker, 25 s with `-n 2`.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

if importlib.util.find_spec("paddleformers") is None:
    pytest.skip(
        "paddleformers is not installed: the family sweep needs paddleformers==1.2.0 "
        "(`nox -s formers` installs it with its pins)",
        allow_module_level=True,
    )

from families import CANNOT, FAMILIES  # tests/formers, next to this file

from script_runs import ROOT, script_env  # tests/

pytestmark = [pytest.mark.heavy]  # a subprocess each, ~5 s

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "train_family.py")
MICRO, LAYERS = 2, 2  # train_family.MICRO, families.COMMON["num_hidden_layers"]
SAVE = "save:self_attn,*Attention"  # train_family.SAVE
RECOMPUTE_MODES = ("reentrant", "non_reentrant")
AFTER_ERROR = tuple(m + "_after_error" for m in RECOMPUTE_MODES)
BUDGET = "budget:0.75"  # train_family.BUDGET
BUDGET_MEASURED_CALLS = 1  # train_family.BUDGET_MEASURED_CALLS
LOSS_BLOCK = "CriterionLayer"  # the loss block some families recompute (a kind of its own)
# train_family.py: the policies
POLICIES = ("non_reentrant_gemm", "non_reentrant_save", "non_reentrant_budget")
INJECTED = "injected error in a recomputation"
# the runnable families whose modeling modules import only with family_standins.py
NEEDS_STANDINS = {
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
    "qwen3_next",
}


def run_driver(tmp_path, what):
    """``python train_family.py what OUT``: this checkout's paddle_mgrad first on PYTHONPATH
    (asserted from inside through ``paddle_mgrad_file``), the worker's op cache, one thread."""
    out = tmp_path / what
    env = script_env()
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    if os.environ.get("PADDLE_MGRAD_CACHE"):  # (script_env drops it: conftest's private copy)
        env["PADDLE_MGRAD_CACHE"] = os.environ["PADDLE_MGRAD_CACHE"]
    r = subprocess.run(
        [sys.executable, DRIVER, what, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0 and (out / "result.json").is_file(), (r.stdout + r.stderr)[-6000:]
    with open(out / "result.json") as f:
        report = json.load(f)
    assert report["paddle_mgrad_file"].startswith(os.path.join(ROOT, "paddle_mgrad")), report
    return out, report


def short(error):
    """The lines of a Paddle error that say what failed (it nests the Python error in its own
    frames; the first line is often only ``OSError: (External)``)."""
    lines = [ln.strip() for ln in error.splitlines()]
    keep = [
        ln
        for ln in lines
        if re.search(r"\w(Error|Exception)\b", ln)
        and len(ln) > 25
        and "Error message in backward" not in ln
    ]
    node = [re.sub(r"[=\s]+", " ", ln).strip() for ln in lines if "Error message in backward" in ln]
    return " | ".join(keep[:2] + node[:1])[:500] or error[:500]


def grads(out, mode):
    with np.load(out / f"{mode}.npz") as z:
        return {k: z[k] for k in z.files}


def expected_calls(family):
    """What each PaddleFormers module's ``recompute`` saw per mode (train_family.ForcedMode):
    the decoder layers' module passes the mode itself or not (families.py), the loss
    (nn/criterion/sft_loss.py) never does."""
    how = FAMILIES[family][4]
    calls = {
        "paddleformers.nn.criterion.sft_loss": {"forced": MICRO, "passed": 0, "passed_other": 0}
    }
    if how is not None:
        module = f"paddleformers.transformers.{FAMILIES[family][0]}.modeling"
        n = MICRO * LAYERS
        calls[module] = {
            "forced": n if how == "always_reentrant" else 0,
            "passed": n if how == "config" else 0,
            "passed_other": 0,
        }
    return calls


def check_reference(ref, ref_grads):
    """The run without recompute: every trainable parameter's gradient in fp32 main_grad (none
    in .grad), through our fused linear, grad mode on, nothing recomputed."""
    problems = []
    if not (ref["trainable"] == len(ref_grads) > 0 and ref["no_main_grad"] == []):
        problems.append(f"trainable {ref['trainable']}, without main_grad {ref['no_main_grad']}")
    if ref["grad_not_none"] or ref["main_grad_dtypes"] != ["paddle.float32"]:
        problems.append(f".grad set: {ref['grad_not_none']}, dtypes {ref['main_grad_dtypes']}")
    if ref["grad_enabled"] is not True:
        problems.append("grad mode off after training")
    if any(ref["recompute"].values()):
        problems.append(f"recompute ran: {ref['recompute']}")
    lin = ref["linear"]
    if not (lin["into_main_grad"] > 0 and lin["backward"] == lin["forward"] > 0):
        problems.append(f"fused linear: {lin}")
    return [f"none: {p}" for p in problems]


def check_mode(family, mode, r, g, ref, ref_grads):
    """One recompute mode against the reference (module docstring); returns what is wrong."""
    if "error" in r:
        return [f"{mode}: {short(r['error'])}"]
    problems = []
    base = mode.replace("_after_error", "")
    for policy in ("_gemm", "_save", "_budget"):
        base = base.replace(policy, "")
    failed_step = mode.endswith("_after_error")  # one more micro-step ran first, and raised
    if failed_step:
        if INJECTED not in (r["injected_error"] or ""):
            problems.append(
                "the first micro-step did not fail with the injected error but: "
                + short(r["injected_error"] or "nothing raised")
            )
        if r["grad_enabled_after_error"] is not True:
            problems.append("grad mode OFF after the error")
    if r["grad_enabled"] is not True:
        problems.append("grad mode off after training")
    if r["no_main_grad"] or r["grad_not_none"] or r["main_grad_dtypes"] != ["paddle.float32"]:
        problems.append(
            f"without main_grad: {r['no_main_grad'][:6]}, .grad set: "
            f"{r['grad_not_none'][:6]}, dtypes {r['main_grad_dtypes']}"
        )
    if r["losses"] != ref["losses"]:
        problems.append(f"losses {r['losses']} != {ref['losses']}")
    if sorted(g) != sorted(ref_grads):
        problems.append(f"main_grad of other parameters: {sorted(set(g) ^ set(ref_grads))[:6]}")
    unequal = [k for k in g if k in ref_grads and not np.array_equal(g[k], ref_grads[k])]
    if unequal:
        dgrad = max(float(np.max(np.abs(g[k] - ref_grads[k]))) for k in unequal)
        problems.append(f"main_grad differs (max {dgrad:.3g}): {unequal[:6]}")

    # recompute ran, in this mode: each decoder layer (not in qwen3_next) and the loss, once
    # per micro-step, each recomputed once in backward
    blocks = MICRO * ((LAYERS if FAMILIES[family][4] is not None else 0) + 1)
    calls = blocks + (blocks // MICRO if failed_step else 0)
    rc = r["recompute"]
    other = "non_reentrant" if base == "reentrant" else "reentrant"
    # (a budget: plan's step's last block kept whole is not recomputed)
    whole = sum(p.get("blocks_kept_whole", 0) for p in r["policy"].values())
    recomputed = (
        rc["recomputations"] >= blocks + 1 - whole
        if failed_step
        else rc["recomputations"] == blocks - whole
    )
    if not (
        rc[base] == calls
        and rc[other] == 0
        and recomputed
        and rc.get("kept_from_forward", 0) == 0
        and rc["reentrant_as_non_reentrant"] == 0
    ):
        problems.append(f"recompute counters {rc} (expected {calls} {base} calls)")
    expected = {
        k: {n: c * calls // blocks for n, c in v.items()} for k, v in expected_calls(family).items()
    }
    if r["recompute_calls"] != expected:
        problems.append(f"recompute calls {r['recompute_calls']} != {expected}")
    if not failed_step and r["linear"] != ref["linear"]:
        problems.append(f"fused linear {r['linear']} != without recompute {ref['linear']}")
    # the gemm policy ran on every recomputed block and spared GEMMs; without it, none did
    pol = r.get("policy", {})
    if mode.endswith("_gemm"):
        g = pol.get("gemm", {})
        # (qwen3_next recomputes only its loss, whose logits GEMM is a matmul, no fused linear)
        spared = FAMILIES[family][4] is not None
        if not (
            g.get("calls") == calls
            and g.get("replays") == blocks
            and (g.get("gemms_not_recomputed", 0) > 0) == spared
            and (g.get("kept_bytes", 0) > 0) == spared
        ):
            problems.append(f"gemm policy counters {pol} (expected {calls} calls)")
    elif mode.endswith("_save"):
        s = pol.get(SAVE, {})
        # every decoder layer keeps its attention, and its replay skips it (the loss block
        # has none: it is replayed whole)
        layers = MICRO * LAYERS if FAMILIES[family][4] is not None else 0
        if not (
            s.get("calls") == calls
            and s.get("replays") == blocks
            and s.get("sublayers_not_recomputed") == layers
            and (s.get("kept_bytes", 0) > 0) == (layers > 0)
        ):
            problems.append(
                f"save policy counters {pol} (expected {calls} calls, {layers} "
                "attention calls not recomputed)"
            )
    elif mode.endswith("_budget"):
        problems += _check_budget(family, r, calls, blocks)
    elif pol:
        problems.append(f"a policy ran: {pol}")
    return [f"{mode}: {p}" for p in problems]


def _check_budget(family, r, calls, blocks):
    """``budget:``: every block call counted; each kind of decoder layer (a dense and a
    mixture-of-experts one are two) measured in its first calls, then planned within the
    budget, the planned calls skipping what was chosen: its sublayers and its linears' GEMMs
    (one linear per chosen weight here)."""
    s, plans = r["policy"].get(BUDGET, {}), r["plans"].get(BUDGET, {})
    kept_whole = s.get("blocks_kept_whole", 0)  # (not recomputed: a step's last block)
    if not (s.get("calls") == calls and s.get("replays") == blocks - kept_whole):
        return [f"budget policy counters {r['policy']} (expected {calls} calls)"]
    if FAMILIES[family][4] is None:  # (no decoder layer recomputed: nothing planned)
        extra = set(plans) - {LOSS_BLOCK}
        return [] if not extra else [f"plans without decoder layers: {plans}"]
    decoder = [label for label in plans if label != LOSS_BLOCK]
    if len(decoder) not in (1, LAYERS):
        return [f"neither one plan nor one per decoder layer: {sorted(plans)}"]
    problems, sublayers, gemms, whole = [], 0, 0, 0
    for label, plan in plans.items():
        chosen = plan["chosen"]
        taken = sum(plan["measured"][n]["bytes"] for n in chosen)
        if plan["last_block"]:
            taken += plan["last_block_bytes"]
        if not (
            (chosen or plan["last_block"] or label == LOSS_BLOCK) and taken <= plan["budget_bytes"]
        ):
            problems.append(f"plan {label} {plan} (nothing chosen, or over the budget)")
        # the calls of its kind: the loss block's one per micro-step, each decoder kind's its
        # layers' (one per layer and micro-step), less those measured: the first micro-step's
        # (planned once a backward was seen), at least BUDGET_MEASURED_CALLS
        calls = MICRO if label == LOSS_BLOCK else MICRO * LAYERS // len(decoder)
        measured = max(BUDGET_MEASURED_CALLS, calls // MICRO)
        if plan.get("measured_calls") != measured:
            problems.append(f"plan {label} {plan} (expected {measured} measured calls)")
        planned = calls - measured
        # kept whole: a kind that ends each micro-step (the loss block where it is recomputed,
        # else the decoder layers: a micro-step's last one), each measured micro-step (which
        # measures what that costs) and each planned one where the plan keeps it
        ends = label == LOSS_BLOCK or LOSS_BLOCK not in plans
        per_step = calls // MICRO
        kept = planned // per_step if plan["last_block"] and ends else 0
        if plan["last_block"] and not ends:
            problems.append(f"plan {label} {plan} keeps a block whole that never ends a step")
        whole += kept + (measured // per_step if ends else 0)
        n_gemms = sum(n.startswith("gemm:") for n in chosen)
        sublayers += (planned - kept) * (len(chosen) - n_gemms)
        gemms += (planned - kept) * n_gemms
    if (s.get("sublayers_not_recomputed"), s.get("gemms_not_recomputed"), kept_whole) != (
        sublayers,
        gemms,
        whole,
    ):
        problems.append(
            f"budget counters {s} (expected {sublayers} sublayers, {gemms} GEMMs, {whole} "
            "blocks kept whole)"
        )
    return problems


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_recompute_matches_no_recompute(tmp_path, family):
    out, report = run_driver(tmp_path, family)
    modes = report["modes"]
    assert "error" not in modes["none"], f"{family} none: {short(modes['none']['error'])}"
    ref, ref_grads = modes["none"], grads(out, "none")
    problems = check_reference(ref, ref_grads)
    measured = []
    for mode in RECOMPUTE_MODES + AFTER_ERROR + POLICIES:
        r = modes[mode]
        g = {} if "error" in r else grads(out, mode)
        problems += check_mode(family, mode, r, g, ref, ref_grads)
        if g and r["losses"] and sorted(g) == sorted(ref_grads):
            dloss = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
            dgrad = max(float(np.max(np.abs(g[k] - ref_grads[k]))) for k in g)
            measured.append(f"{mode} loss {dloss:.3g} main_grad {dgrad:.3g}")
    seconds = sum(r["seconds"] for r in modes.values())
    print(
        f"\nMEASURED {family} vs no recompute ({report['paddle']}, paddleformers "
        f"{report['paddleformers']}, {seconds:.2f} s of training): " + "; ".join(measured)
    )
    assert not problems, f"{family}:\n  " + "\n  ".join(problems)


def test_families_that_cannot_run_on_cpu(tmp_path):
    """Each family of families.CANNOT fails as its line says (module docstring), and the
    families that need family_standins.py fail to import without them -- PaddleFormers'/
    Paddle's gaps, with paddle_mgrad off.  When one of these changes (paddlefleet published,
    a CPU kernel added), this test fails: move the family into the sweep."""
    _, report = run_driver(tmp_path, "gaps")
    wrong = {
        name: report["cannot"][name]
        for name, spec in CANNOT.items()
        if spec[4] not in (report["cannot"][name] or "")
    }
    assert not wrong, wrong
    needs = {f for f, err in report["needs_standins"].items() if err is not None}
    assert needs == NEEDS_STANDINS, report["needs_standins"]
    for family in needs:
        assert "paddlefleet" in report["needs_standins"][family], report["needs_standins"]
