"""2 gloo ranks, fleet hybrid parallel, all of paddle_mgrad on (see train_hybrid.py).

Each configuration (the llama ones in both recompute modes, ``--recompute_use_reentrant``)
is compared with a one-process plain-Paddle run of the same global batch: losses of 3 steps
(2 micro-steps each) within 1e-5, fp32 ``main_grad`` after step 0 equal to the reference
gradient (each rank's shard) within 1e-5 -- a gradient lost or added twice would not be --,
no parameter with its gradient elsewhere, and paddle_mgrad's
counters showing that our recompute / fused op / overlap linear ran as often as the model
has such calls (nothing silently bypassed).

Needs PaddleNLP 2.8.1 (``nox -s fleet``).  Paddle's missing CPU pieces are stood in for by
``cpu_fleet_standins.py`` (test-only; transport only: Paddle's own PyLayers run, fleet's
in-place all-reduce after ``RowParallelLinear``'s linear included).  The same paths through
PaddleNLP's Trainer and ``llm/run_pretrain.py``: test_llm_script_parallel.py.
"""

import json
import os
import sys

import pytest

from helpers import PADDLE2

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "train_hybrid.py")
sys.path.insert(0, HERE)
from launching import launch_two_ranks, run  # noqa: E402
from train_hybrid import ACC, STEPS  # noqa: E402

# 2-rank launches (heavy: dealt first under xdist); one worker runs the module, so that the
# module-scoped one-process reference runs once
pytestmark = [pytest.mark.heavy, pytest.mark.xdist_group("fleet_hybrid_reference")]

TIMEOUT = int(os.environ.get("PADDLE_MGRAD_DIST_TIMEOUT", "420"))
TOL = 1e-5
LAYERS = 2  # decoder layers of the tiny llama
COLUMN_LINEARS = 5  # q, k, v, gate, up per decoder layer


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(kind):
        if kind not in cache:
            out = str(tmp_path_factory.mktemp(kind))
            run([sys.executable, DRIVER, "--config", kind, "--out", out], out, kind, TIMEOUT)
            cache[kind] = out
        return cache[kind]

    return get


def launch(tmp_path, config, ref, mode):
    extra = ["--recompute_use_reentrant", "true" if mode == "reentrant" else "false"]
    return launch_two_ranks(DRIVER, config, str(tmp_path / config), ref, TIMEOUT, extra)


MICRO = ACC * STEPS

# config -> (reference, expected counters per rank: a function of the rank's result)
CASES = {
    "tp2": "ref_llama",
    "tp2_sp": "ref_llama",
    "tp2_async": "ref_llama",
    "tp2_fused_gradadd": "ref_llama",
    "tp2_sp_overlap": "ref_llama",
    "tp2_sp_overlap_fused": "ref_llama",
    "sharding1": "ref_llama",
    "pp2": "ref_llama",
    "pp2_interval": "ref_toy",
}


# Paddle 3.x only: ColumnSequenceParallelLinear's SPInnerOverlapLinear
SP_OVERLAP = ("tp2_sp_overlap", "tp2_sp_overlap_fused")


def _skip_sp_overlap_on_paddle2():
    """Paddle 2.6 has neither SPInnerOverlapLinear nor mp_configs.sp_async_reduce_scatter:
    skip there, and only there (a Paddle 3 without them fails)."""
    import zlib  # noqa: F401  (before paddle on 2.6)

    import paddle
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils import sequence_parallel_utils

    has_class = hasattr(sequence_parallel_utils, "SPInnerOverlapLinear")
    has_flag = hasattr(
        fleet.DistributedStrategy().hybrid_configs["mp_configs"], "sp_async_reduce_scatter"
    )
    if PADDLE2:
        assert not has_class and not has_flag, paddle.__version__
        pytest.skip(
            f"Paddle {paddle.__version__} has no SPInnerOverlapLinear "
            "(mp_configs.sp_async_reduce_scatter): a Paddle 3.x feature"
        )
    assert has_class and has_flag, paddle.__version__


def _assert_matches(r, where):
    """One rank's result matches the one-process reference: losses, its shard of the step-0
    gradients in fp32 ``main_grad`` (none elsewhere), and every linear weight through our op
    once per micro-step."""
    assert r["loss_diff"] <= TOL, (where, r["losses"], r["ref_losses"])
    assert r["grad_diff"] is not None and r["grad_diff"] <= TOL, where
    assert r["n_params"] > 0 and r["not_in_main_grad"] == [], where
    assert r["grad_leaks"] == [] and r["audit"]["grad_not_none"] == 0, where
    assert r["audit"]["missing"] == [], where
    assert r["linear_weights"], where
    assert set(r["linear_weights"]) <= set(r["fused_params"]), where
    n_fused = len(r["fused_params"])
    assert r["linear"]["into_main_grad"] == n_fused * MICRO, (where, r["linear"])


# the llama decoder layers' recompute mode; pp2_interval runs fleet's recompute_hybrid (a
# PyLayer without use_reentrant): one mode
RUNS = [
    (c, m)
    for c in CASES
    for m in (("non_reentrant",) if c == "pp2_interval" else ("non_reentrant", "reentrant"))
]


@pytest.mark.parametrize("config,mode", RUNS, ids=[f"{c}-{m}" for c, m in RUNS])
def test_two_ranks_match_one_process(config, mode, reference, tmp_path):
    if config in SP_OVERLAP:
        _skip_sp_overlap_on_paddle2()
    results = launch(tmp_path, config, reference(CASES[config]), mode)
    print(
        "\n"
        + config
        + " "
        + mode
        + ": "
        + json.dumps(
            [
                {
                    k: r[k]
                    for k in (
                        "rank",
                        "paddle",
                        "loss_diff",
                        "grad_diff",
                        "recompute",
                        "linear",
                        "paddle_c_ops",
                    )
                }
                for r in results
            ]
        )
    )
    for r in results:
        where = f"{config} {mode} rank {r['rank']}"
        _assert_matches(r, where)
        rc = r["recompute"]
        if config == "pp2_interval":
            # recompute_interval=1: every block with parameters and a grad-needing input
            assert rc["hybrid"] > 0 and rc["recomputations"] == rc["hybrid"], (where, rc)
            assert rc["hybrid"] % MICRO == 0, (where, rc)
            assert rc["non_reentrant"] == rc["reentrant"] == 0, (where, rc)
        else:
            layers = LAYERS // 2 if config == "pp2" else LAYERS
            assert r["reentrant"] == (mode == "reentrant"), where
            assert rc[mode] == layers * MICRO, (where, rc)
            assert rc["recomputations"] == layers * MICRO, (where, rc)
        lin = r["linear"]
        if config in ("tp2_async", "tp2_fused_gradadd"):
            assert "ColumnParallelLinear" in r["layer_types"]
            assert lin["overlap_backward"] == COLUMN_LINEARS * LAYERS * MICRO, (where, lin)
        else:
            assert lin["overlap_backward"] == 0, (where, lin)
        if config in SP_OVERLAP:
            # every column linear ran our SPInnerOverlapLinear, backward once per micro-step
            assert r["sp_overlap_class"] == "SPOverlapLinearWithGradAdd", where
            assert lin["sp_overlap_backward"] == COLUMN_LINEARS * LAYERS * MICRO, (where, lin)
        else:
            assert lin["sp_overlap_backward"] == 0, (where, lin)
        if config in ("tp2_sp",) + SP_OVERLAP:
            assert "ColumnSequenceParallelLinear" in r["layer_types"], where


ROW_LINEARS = 2  # o_proj, down_proj per decoder layer


@pytest.mark.parametrize("config", ["tp2_async", "tp2_sp_overlap"])
def test_overlap_linears_under_the_gemm_policy(config, reference, tmp_path, monkeypatch):
    """fleet's overlap linears (``mp_async_allreduce``'s column linear, the sequence-parallel
    ``sp_async_reduce_scatter`` one) under ``PADDLE_MGRAD_RECOMPUTE_POLICY=gemm``: their
    outputs are kept (the row linears' too under sequence parallelism, whose reduce-scatter
    is not in place; without it fleet all-reduces them in place: recomputed), and the run
    matches the one-process reference."""
    if config in SP_OVERLAP:
        _skip_sp_overlap_on_paddle2()
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", "gemm")
    results = launch(tmp_path, config, reference(CASES[config]), "non_reentrant")
    kept = (COLUMN_LINEARS + (ROW_LINEARS if config in SP_OVERLAP else 0)) * LAYERS * MICRO
    for r in results:
        where = f"{config} gemm rank {r['rank']}"
        _assert_matches(r, where)
        g = r["policy"]["gemm"]
        assert g["calls"] == g["replays"] == LAYERS * MICRO, (where, g)
        assert g["gemms_not_recomputed"] == kept, (where, g)
        lin = r["linear"]
        backward = "sp_overlap_backward" if config in SP_OVERLAP else "overlap_backward"
        assert lin[backward] == COLUMN_LINEARS * LAYERS * MICRO, (where, lin)


BUDGET = "budget:0.7"


@pytest.mark.parametrize("config", ["tp2", "tp2_sp"])
def test_budget_plan_is_one_per_tensor_parallel_group(config, reference, tmp_path, monkeypatch):
    """The ranks of a tensor-parallel group measure different times (here a sublayer slowed
    down on each: rank 0's input norm, rank 1's MLP), so each alone would keep another
    sublayer, and one rank's replay would wait in an all-reduce the other skipped.  Both run
    the first rank's plan, and the run matches the one-process reference."""
    monkeypatch.setenv("PADDLE_MGRAD_RECOMPUTE_POLICY", BUDGET)
    out = tmp_path / config
    results = launch_two_ranks(
        DRIVER,
        config,
        str(out),
        reference(CASES[config]),
        TIMEOUT,
        ["--recompute_use_reentrant", "false", "--slow", "0:input_layernorm,1:mlp"],
    )
    plans = [r["plans"][BUDGET]["LlamaDecoderLayer"] for r in results]
    agreed = [(p["chosen"], p["last_block"]) for p in plans]
    assert agreed[0] == agreed[1], plans
    assert plans[0]["chosen"] or plans[0]["last_block"], plans  # (something fits)
    for r, plan in zip(results, plans):
        where = f"{config} {BUDGET} rank {r['rank']}"
        _assert_matches(r, where)
        g = r["policy"][BUDGET]
        # each micro-step's last block where the plan keeps it whole, and the measured
        # micro-step's (which measures what that costs)
        whole = g["blocks_kept_whole"]
        assert whole == (MICRO if plan["last_block"] else 1), (where, g)
        assert g["calls"] == LAYERS * MICRO and g["replays"] == LAYERS * MICRO - whole, (where, g)
        print(f"\n{where}: chosen {plan['chosen']}, measured {plan['measured']}")
