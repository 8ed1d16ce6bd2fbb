"""launching.run's one retry: a 2-rank launch whose rendezvous failed before any rank wrote a
result (a port taken between the launcher's choice and the rank's bind) is repeated once; every
other failure fails the test with the rank logs.  Fake drivers, no paddle_mgrad and no PaddleNLP
needed."""

import os
import sys

import pytest
from launching import run

from script_runs import RENDEZVOUS_FAILURES

DRIVER = r"""
import os, sys
rank = os.environ.get("PADDLE_TRAINER_ID", "0")
mode, out = sys.argv[1], sys.argv[2]
marker = os.path.join(out, "refused-once")
if rank == "0" and (mode == "always" or (mode == "once" and not os.path.exists(marker))):
    open(marker, "w").close()
    print([
        "Traceback (most recent call last):\n    pg = core.ProcessGroupGloo.create(store, rank,"
        " world_size, place, gid)\nOSError: pair.cc:784 connect [127.0.0.1]:52660: "
        "Connection refused",
        "tcp_store.cc:336] create libuv server at port: 58764\npython: core.c:314: "
        "uv__finish_close: Assertion `handle->flags & UV_HANDLE_CLOSING' failed.",
        "    pg = core.ProcessGroupGloo.create(store, rank, world_size, group_id)\nRuntimeError: "
        "[/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:917] TIMEOUT self_rank = 0",
    ][int(os.environ.get("FAKE_RENDEZVOUS_FAILURE", "0"))], flush=True)
    sys.exit(1)
if rank == "0" and mode == "crash":
    raise RuntimeError("a real failure")
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    f.write("{}")
"""


def _run(tmp_path, mode):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = str(tmp_path / "out")
    os.makedirs(out)
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--log_dir",
        os.path.join(out, "log"),
        "--nproc_per_node",
        "2",
        str(driver),
        mode,
        out,
    ]
    run(cmd, out, f"fake {mode}", 300)
    return out


@pytest.mark.parametrize("failure", range(len(RENDEZVOUS_FAILURES)))
def test_a_failed_rendezvous_is_repeated_once(tmp_path, capsys, monkeypatch, failure):
    monkeypatch.setenv("FAKE_RENDEZVOUS_FAILURE", str(failure))
    out = _run(tmp_path, "once")
    assert all(os.path.exists(os.path.join(out, f"rank{r}.json")) for r in (0, 1))
    with open(os.path.join(out, "log.refused", "workerlog.0")) as f:
        first = f.read()
    assert all(s in first for s in RENDEZVOUS_FAILURES[failure])
    assert "repeated once" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["always", "crash"])
def test_other_failures_fail(tmp_path, mode):
    with pytest.raises(pytest.fail.Exception) as e:
        _run(tmp_path, mode)
    text = str(e.value)
    assert ("Connection refused" if mode == "always" else "a real failure") in text
    assert os.path.exists(tmp_path / "out" / "log.refused") == (mode == "always")
