"""tests/script_runs.py's one retry: only a rank lost to SIGABRT after training completed on
every rank (Paddle 3.3.1's exit-time abort of 2-rank gloo runs), or a gloo rendezvous refused
before training (a port race between concurrent launches), is repeated, once."""

import pytest

from script_runs import launch, script_env

# rank 0 aborts at its first run after "training", like Paddle's teardown abort
SCRIPT = r"""
import os, sys, time
rank = os.environ.get("PADDLE_TRAINER_ID", "0")
mode, marker = sys.argv[1], sys.argv[2]
if mode == "crash_in_training" and rank == "0":
    raise RuntimeError("a real failure")
if mode == "abort_in_training" and rank == "0":
    time.sleep(3)
    os.abort()
REFUSED = ("Traceback (most recent call last):\n  ...\n    pg = core.ProcessGroupGloo.create("
           "store, rank, world_size, place, gid)\nOSError: [operator < gloo > error] "
           "pair.cc:784 connect [127.0.0.1]:52660: Connection refused")
if rank == "0" and (mode == "refused_always"
                    or (mode == "refused_once" and not os.path.exists(marker))):
    open(marker, "w").close()
    sys.exit(print(REFUSED, flush=True) or 1)
print("\nTraining completed. \n", flush=True)
if mode == "refused_after_training" and rank == "0":
    sys.exit(print(REFUSED, flush=True) or 1)
if rank == "0" and (mode == "always" or not os.path.exists(marker)):
    open(marker, "w").close()
    time.sleep(3)  # rank 1 has finished too, as at the end of a real run
    os.abort()
"""


def _run(tmp_path, mode):
    script = tmp_path / "fake_train.py"
    script.write_text(SCRIPT)
    out_dir = tmp_path / "out"
    return launch(
        [str(script), mode, str(tmp_path / "aborted-once")], out_dir, 2, script_env(), 300, tmp_path
    ), out_dir


def test_abort_after_training_is_repeated_once(tmp_path):
    (rc, out), out_dir = _run(tmp_path, "once")
    assert rc == 0, out[-3000:]
    assert out.startswith("--- NOTE: the first launch lost a rank to SIGABRT at exit"), out[:300]
    assert (tmp_path / "out.aborted" / "log" / "workerlog.0").is_file()


def test_a_refused_rendezvous_is_repeated_once(tmp_path):
    (rc, out), out_dir = _run(tmp_path, "refused_once")
    assert rc == 0, out[:1500] + "\n...\n" + out[-3000:]
    assert out.startswith("--- NOTE: the first launch had a rank's gloo rendezvous refused"), out[
        :300
    ]
    assert "Connection refused" in (tmp_path / "out.refused" / "log" / "workerlog.0").read_text()


@pytest.mark.parametrize(
    "mode",
    [
        "always",
        "crash_in_training",
        "abort_in_training",
        "refused_always",
        "refused_after_training",
    ],
)
def test_other_failures_are_returned(tmp_path, mode):
    (rc, out), out_dir = _run(tmp_path, mode)
    assert rc != 0
    if mode in ("always", "refused_always"):  # repeated once, the second failure returned
        assert out.startswith("--- NOTE:"), out[-3000:]
        assert ("Exit code -6" if mode == "always" else "Connection refused") in out
    else:  # a Python error, or an abort before training completed: never repeated
        assert "NOTE" not in out and not (tmp_path / "out.aborted").exists(), out[-3000:]
        assert not (tmp_path / "out.refused").exists()
