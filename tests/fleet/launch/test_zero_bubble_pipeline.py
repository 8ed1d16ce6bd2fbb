"""2 gloo ranks, Paddle 3.x's zero-bubble DualPipeV schedule with paddle_mgrad on (see
train_dualpipev.py): the weight gradients the schedule defers to ``WeightGradStore.pop()`` go
through our op into fp32 main_grad, and the run equals a one-process plain-Paddle run of the
same global batch (losses of 2 steps and main_grad after step 0 within 1e-5), without
recompute and under our non-reentrant and reentrant recompute; a control run with
paddle_mgrad off checks the stand-ins alone.

Paddle 3.3.1's DualPipeV does not run on a CPU wheel as is (``deep_ep``, CUDA streams, gloo
p2p); ``cpu_dualpipev_standins.py`` (test-only) says where and stands in.  Paddle 2.6 has no
DualPipeV (asserted, then skipped).
"""

import json
import os
import sys

import pytest

from helpers import PADDLE2

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "train_dualpipev.py")
sys.path.insert(0, HERE)
from launching import launch_two_ranks, run  # noqa: E402
from train_dualpipev import ACC, CONFIGS, STEPS  # noqa: E402

# 2-rank launches (heavy: dealt first under xdist); one worker runs the module, so that the
# module-scoped one-process reference runs once
pytestmark = [pytest.mark.heavy, pytest.mark.xdist_group("fleet_dualpipev_reference")]


def _paddle_has_dualpipev():
    import importlib
    import zlib  # noqa: F401  (before paddle on 2.6)

    import paddle

    try:
        importlib.import_module("paddle.distributed.fleet.meta_parallel.dualpipev")
        has = True
    except ImportError:
        has = False
    if PADDLE2:
        assert not has, paddle.__version__
        pytest.skip(
            f"Paddle {paddle.__version__} has no DualPipeV / zero_bubble_utils "
            "(Paddle 3.x; asserted absent)",
            allow_module_level=True,
        )
    assert has, paddle.__version__


_paddle_has_dualpipev()

TIMEOUT = int(os.environ.get("PADDLE_MGRAD_DIST_TIMEOUT", "300"))
TOL = 1e-5
WEIGHTS_PER_RANK = 4  # 2 blocks x (fc1, fc2)
BLOCKS = {0: ["0", "3"], 1: ["1", "2"]}  # the V: rank 0 holds the first and the last block


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ref"))
    run([sys.executable, DRIVER, "--config", "ref", "--out", out], out, "ref", TIMEOUT)
    return out


@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "ref"])
def test_dualpipev_two_ranks_match_one_process(config, reference, tmp_path):
    out = str(tmp_path / config)
    results = launch_two_ranks(DRIVER, config, out, reference, TIMEOUT)
    on, use_reentrant = CONFIGS[config]
    micro = ACC * STEPS
    for rank, r in enumerate(results):
        where = f"{config} rank {rank}"
        print(
            where,
            json.dumps(
                {k: r[k] for k in ("loss_diff", "grad_diff", "deferred", "linear", "recompute")}
            ),
        )
        assert r["model"] == "DualPipeVParallel" and r["blocks"] == BLOCKS[rank], (where, r)
        assert r["loss_diff"] <= TOL, (where, r["losses"], r["ref_losses"])
        assert r["grad_diff"] is not None and r["grad_diff"] <= TOL, where
        assert r["n_params"] == 2 * WEIGHTS_PER_RANK and r["not_in_main_grad"] == [], where
        assert r["grad_leaks"] == [], where
        # the schedule's zero-bubble phases deferred some weight gradients to pop(), not all
        assert 0 < r["deferred"] < WEIGHTS_PER_RANK * micro, (where, r["deferred"])
        lin = r["linear"]
        if on:  # every weight gradient, deferred or not, went through our op
            assert lin["zero_bubble"] == lin["into_main_grad"] == WEIGHTS_PER_RANK * micro, (
                where,
                lin,
            )
            assert r["fused_params"] == r["weights"], where
        else:
            assert lin["zero_bubble"] == 0 and r["fused_params"] == [], (where, lin)
        assert lin["backward"] == 0, (where, lin)  # SplitBWMatmul's forward linear: no grad
        rc = r["recompute"]
        recomputed = sum(1 for b in BLOCKS[rank] if b != "0") * micro  # block 0 reads the data
        if use_reentrant is None:
            assert rc["recomputations"] == 0, (where, rc)
        else:
            mode = "reentrant" if use_reentrant else "non_reentrant"
            assert rc[mode] == rc["recomputations"] == recomputed, (where, rc)
