"""Train one tiny PaddleFormers 1.2.0 causal-LM family (tests/formers/families.py) with
paddle_mgrad switched on, in one process, without and with full recompute, and write what
test_families.py compares:

    python train_family.py FAMILY OUT_DIR
    python train_family.py gaps OUT_DIR       (what cannot run on CPU, and why: see main_gaps)

Modes (each on a fresh model with the same initial parameters and the same 2 micro-batches,
both micro-steps accumulated into fp32 ``main_grad`` by ``MixPrecisionLayer`` and our fused
linear; no optimizer step, so what is compared is the accumulated gradient itself):

* ``none``: ``recompute_granularity=None`` (the reference);
* ``reentrant`` / ``non_reentrant``: ``recompute_granularity="full"`` (every decoder layer and
  the loss recomputed), ``recompute_use_reentrant`` True / False;
* ``non_reentrant_gemm``: as ``non_reentrant``, with ``PADDLE_MGRAD_RECOMPUTE_POLICY=gemm``
  (every fused linear's output kept from the forward, no GEMM recomputed);
* ``non_reentrant_save``: as ``non_reentrant``, with the ``save:`` policy :data:`SAVE`
  (each decoder layer's attention kept whole from the forward, not recomputed);
* ``non_reentrant_budget``: as ``non_reentrant``, with the ``budget:`` policy :data:`BUDGET`
  (the decoder layers' first calls measured, then the planned sublayers kept);
* ``<mode>_after_error``: as ``<mode>``, after a first micro-step whose first recomputed block
  (decoder layer 0; the loss for qwen3_next) raised in backward, in its recomputation -- an
  injected error, caught here as a training loop would: grad mode must be back on and the
  training that follows must equal ``none``.

Most families call Paddle's ``recompute`` without ``use_reentrant`` (always reentrant, see
families.py).  TEST-ONLY: to run them non-reentrant -- the mode where a replayed linear
must give back a non-leaf -- this driver rebinds the ``recompute`` name of every PaddleFormers module that imported
it to a wrapper that passes the mode when the caller does not.  A caller that passes its own
mode keeps it; the wrapper counts both kinds of call per module.

OUT_DIR gets ``result.json`` (losses, counters, errors per mode) and ``<mode>.npz`` (every
trainable parameter's ``main_grad``, by structured name).  Exit code 0 even when a mode
failed: the test reads the errors.
"""

import argparse
import importlib
import json
import os
import sys
import time
import traceback
import zlib  # noqa: F401  (harmless on 3.x; Paddle 2.6 needs it before paddle)

import numpy as np
import paddle
from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer

import paddle_mgrad
from paddle_mgrad import stats

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from families import CANNOT, COMMON, FAMILIES  # noqa: E402  (next to this file)
from family_standins import paddlefleet_import_standins  # noqa: E402

SEED, BATCH, SEQ, MICRO = 42, 2, 16, 2
RECOMPUTE_MODES = ("reentrant", "non_reentrant")
MODES = (
    "none",
    *RECOMPUTE_MODES,
    *(m + "_after_error" for m in RECOMPUTE_MODES),
    "non_reentrant_gemm",
    "non_reentrant_save",
    "non_reentrant_budget",
)
POLICY_ENV = "PADDLE_MGRAD_RECOMPUTE_POLICY"
#: the policy of ``non_reentrant_save``: the attention sublayer by attribute path or class name
SAVE = "save:self_attn,*Attention"
#: the policy of ``non_reentrant_budget``: the planner's choice within three quarters of the
#: bytes (2 decoder layers and the loss hold about 40 % under full recompute already), each kind
#: of decoder layer planned after the first micro-step (the first backward tells how many blocks
#: are alive at once; :data:`BUDGET_MEASURED_CALLS`: the families whose first layers are dense
#: and the others mixture-of-experts run one call of each kind per micro-step)
BUDGET = "budget:0.75"
BUDGET_MEASURED_CALLS = 1
POLICY_OF = {"_gemm": "gemm", "_save": SAVE, "_budget": BUDGET}
INJECTED = "injected error in a recomputation (tests/formers/train_family.py)"


class ForcedMode:
    """The ``recompute`` wrappers' state (module docstring): the mode to pass, the calls per
    module, and whether the next recomputed block fails on its recomputation."""

    use_reentrant = None
    calls: dict = {}  # module name -> {"forced": n, "passed": n, "passed_other": n}
    inject = False

    @classmethod
    def wrap(cls, module, recompute):
        name = module.__name__

        def recompute_in_test_mode(function, *args, **kwargs):
            counts = cls.calls.setdefault(name, {"forced": 0, "passed": 0, "passed_other": 0})
            if "use_reentrant" in kwargs:
                counts[
                    "passed" if kwargs["use_reentrant"] == cls.use_reentrant else "passed_other"
                ] += 1
            else:
                counts["forced"] += 1
                kwargs["use_reentrant"] = cls.use_reentrant
            if cls.inject:
                cls.inject = False
                function = _failing_on_second_call(function)
            return recompute(function, *args, **kwargs)

        module.recompute = recompute_in_test_mode


def _failing_on_second_call(function):
    """The block as given, except that its second run -- its recomputation in backward, in
    both modes -- raises."""
    calls = [0]

    def block(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError(INJECTED)
        return function(*args, **kwargs)

    return block


def import_family(family):
    pkg, config_name, model_name = FAMILIES[family][:3]
    base = f"paddleformers.transformers.{pkg}"
    config_cls = getattr(importlib.import_module(base + ".configuration"), config_name)
    model_cls = getattr(importlib.import_module(base + ".modeling"), model_name)
    importlib.import_module("paddleformers.nn.criterion.sft_loss")  # the loss's recompute
    # Paddle's recompute (paddle_mgrad swapped its code) and fleet.utils' function calling it
    from paddle.distributed.fleet import utils

    paddles = (
        importlib.import_module("paddle.distributed.fleet.recompute.recompute").recompute,
        utils.recompute,
    )
    for name, module in sorted(sys.modules.items()):
        if name.startswith("paddleformers.") and getattr(module, "recompute", None) in paddles:
            ForcedMode.wrap(module, module.recompute)
    return config_cls, model_cls


def build(config_cls, model_cls, family, mode, initial):
    config = config_cls(**COMMON, **FAMILIES[family][3])
    config.recompute_granularity = None if mode == "none" else "full"
    config.recompute_method = "uniform"
    config.recompute_num_layers = 1
    config.recompute_use_reentrant = mode.startswith("reentrant")
    ForcedMode.use_reentrant = config.recompute_use_reentrant
    paddle.seed(SEED)
    model = model_cls(config)
    if initial is not None:
        model.set_state_dict(initial)
    model.train()
    return model, MixPrecisionLayer(model, dtype="bfloat16")  # fp32 params, fp32 main_grad


def batches():
    rng = np.random.default_rng(1234)
    rows = rng.integers(0, COMMON["vocab_size"], size=(MICRO, BATCH, SEQ + 1))
    return [(paddle.to_tensor(r[:, :-1]), paddle.to_tensor(r[:, 1:])) for r in rows]


def micro_step(wrapped, ids, labels):
    # training: no KV cache (with one, a recomputation appends its keys to the cache again and
    # the attention shapes no longer match -- plain Paddle's recompute too)
    out = wrapped(input_ids=ids, labels=labels, use_cache=False)
    loss = out[0] if isinstance(out, (tuple, list)) else out.loss
    loss.backward()
    return float(loss)


def run_mode(config_cls, model_cls, family, mode, initial, data, out_dir):
    """One mode's training; ``<mode>_gemm`` / ``<mode>_save``: with that recompute policy,
    switched on the way a user does it with no edits (the environment variable)."""
    from paddle_mgrad.recomputation import budget

    policy = POLICY_OF.get(mode[mode.rfind("_") :])
    if policy is not None:
        os.environ[POLICY_ENV] = policy
    measured_calls = budget.MEASURED_CALLS
    if policy == BUDGET:
        budget.MEASURED_CALLS = BUDGET_MEASURED_CALLS
    try:
        return _run_mode(config_cls, model_cls, family, mode, initial, data, out_dir)
    finally:
        os.environ.pop(POLICY_ENV, None)
        budget.MEASURED_CALLS = measured_calls


def _run_mode(config_cls, model_cls, family, mode, initial, data, out_dir):
    stats.reset()
    ForcedMode.calls = {}
    model, wrapped = build(config_cls, model_cls, family, mode, initial)
    result = {}
    if mode.endswith("_after_error"):
        ForcedMode.inject = True
        try:
            micro_step(wrapped, *data[0])
            result["injected_error"] = None  # (the test fails on this: nothing raised)
        except Exception as e:  # what a training loop that goes on would catch
            result["injected_error"] = f"{type(e).__name__}: {e}"
        ForcedMode.inject = False
        result["grad_enabled_after_error"] = paddle.is_grad_enabled()
        for p in model.parameters():  # a new accumulation: the failed step's partial sums go
            if not p.stop_gradient:
                p.main_grad = None
    result["losses"] = [micro_step(wrapped, ids, labels) for ids, labels in data]
    result["grad_enabled"] = paddle.is_grad_enabled()
    grads, result["no_main_grad"], result["grad_not_none"], dtypes = {}, [], [], set()
    for name, p in model.named_parameters():
        if p.stop_gradient:
            continue
        if p.grad is not None:
            result["grad_not_none"].append(name)
        if getattr(p, "main_grad", None) is None:
            result["no_main_grad"].append(name)
        else:
            grads[name] = p.main_grad.numpy()
            dtypes.add(str(p.main_grad.dtype))
    result["trainable"] = sum(1 for p in model.parameters() if not p.stop_gradient)
    result["main_grad_dtypes"] = sorted(dtypes)
    snap = stats.snapshot()
    result["recompute"], result["linear"] = snap["recompute"], snap["linear"]
    result["policy"], result["plans"] = snap["policy"], snap["plans"]
    np.savez(os.path.join(out_dir, f"{mode}.npz"), **grads)
    return model, result


def main_family(family, out_dir):
    paddle_mgrad.enable(recompute=True, fused_linear=True)  # before the model code imports
    report = {
        "paddle_mgrad_file": paddle_mgrad.__file__,
        "paddle": paddle.__version__,
        "standins": paddlefleet_import_standins(),
        "modes": {},
    }
    import paddleformers

    report["paddleformers"] = paddleformers.__version__
    config_cls, model_cls = import_family(family)
    initial, data = None, batches()
    for mode in MODES:
        start = time.perf_counter()
        try:
            model, result = run_mode(config_cls, model_cls, family, mode, initial, data, out_dir)
            if initial is None:
                initial = {k: v.numpy() for k, v in model.state_dict().items()}
        except Exception as e:
            result = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-6000:],
                "grad_enabled": paddle.is_grad_enabled(),
            }
            paddle.set_grad_enabled(True)  # (so that the next mode shows its own outcome)
        result["recompute_calls"] = ForcedMode.calls
        result["seconds"] = round(time.perf_counter() - start, 3)
        report["modes"][mode] = result
        print(
            f"{family} {mode} ({result['seconds']} s): {result.get('error') or result['losses']}",
            flush=True,
        )
    return report


def _outcome(fn):
    try:
        fn()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:2000]


def main_gaps():
    """Without family_standins.py: which runnable families need the stand-ins (importing
    their modeling module fails), and how each family of ``CANNOT`` fails (``families.py``).
    paddle_mgrad stays off: these are PaddleFormers'/Paddle's gaps, not ours."""
    import paddleformers  # noqa: F401

    report = {"paddle_mgrad_file": paddle_mgrad.__file__, "needs_standins": {}, "cannot": {}}
    for family, spec in FAMILIES.items():
        module = f"paddleformers.transformers.{spec[0]}.modeling"
        report["needs_standins"][family] = _outcome(lambda m=module: importlib.import_module(m))
    for name, (_, pkg, how, config_kwargs, _) in CANNOT.items():

        def attempt(pkg=pkg, how=how, config_kwargs=config_kwargs):
            base = f"paddleformers.transformers.{pkg}"
            modeling = importlib.import_module(base + ".modeling")
            if how == "import":
                return
            init = importlib.import_module(base)
            config_cls = getattr(init, next(n for n in init.__all__ if n.endswith("Config")))
            model_cls = getattr(
                modeling, next(n for n in init.__all__ if n.endswith("ForCausalLM"))
            )
            config = config_cls(**(COMMON if how == "train" else {}), **config_kwargs)
            model = model_cls(config)
            if how == "train":
                ids = paddle.to_tensor(np.arange(BATCH * SEQ).reshape(BATCH, SEQ) % 100)
                model(input_ids=ids, labels=ids, use_cache=False)

        report["cannot"][name] = _outcome(attempt)
    return report


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("family", choices=[*sorted(FAMILIES), "gaps"])
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    paddle.set_device("cpu")
    report = main_gaps() if args.family == "gaps" else main_family(args.family, args.out_dir)
    with open(os.path.join(args.out_dir, "result.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
