"""tests/script_runs.py's one retry: only a rank lost to SIGABRT after training completed on
every rank (Paddle 3.3.1's exit-time abort of 2-rank gloo runs) is repeated, once."""
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
print("\nTraining completed. \n", flush=True)
if rank == "0" and (mode == "always" or not os.path.exists(marker)):
    open(marker, "w").close()
    time.sleep(3)  # rank 1 has finished too, as at the end of a real run
    os.abort()
"""


def _run(tmp_path, mode):
    script = tmp_path / "fake_train.py"
    script.write_text(SCRIPT)
    out_dir = tmp_path / "out"
    return launch([str(script), mode, str(tmp_path / "aborted-once")], out_dir, 2,
                  script_env(), 300, tmp_path), out_dir


def test_abort_after_training_is_repeated_once(tmp_path):
    (rc, out), out_dir = _run(tmp_path, "once")
    assert rc == 0, out[-3000:]
    assert out.startswith("--- NOTE: the first launch lost a rank to SIGABRT at exit"), out[:300]
    assert (tmp_path / "out.aborted" / "log" / "workerlog.0").is_file()


@pytest.mark.parametrize("mode", ["always", "crash_in_training", "abort_in_training"])
def test_other_failures_are_returned(tmp_path, mode):
    (rc, out), out_dir = _run(tmp_path, mode)
    assert rc != 0
    if mode == "always":  # repeated once, then the second abort is returned
        assert out.startswith("--- NOTE:") and "Exit code -6" in out, out[-3000:]
    else:  # a Python error, or an abort before training completed: never repeated
        assert "NOTE" not in out and not (tmp_path / "out.aborted").exists(), out[-3000:]
