"""tests/script_runs.py: the one retry (only a rank lost to SIGABRT after training completed on
every rank -- Paddle 3.3.1's exit-time abort of 2-rank gloo runs -- or a rendezvous that failed
before training -- a port taken between the launcher's choice and the rank's bind -- is
repeated, once), and the launcher's port range per pytest-xdist worker."""

import json
import os

import pytest

import script_runs
from script_runs import RENDEZVOUS_FAILURES, launch, launch_ports, script_env

# rank 0 aborts at its first run after "training", like Paddle's teardown abort
SCRIPT = r"""
import json, os, sys, time
rank = os.environ.get("PADDLE_TRAINER_ID", "0")
mode, marker = sys.argv[1], sys.argv[2]
with open(marker + f".env{rank}", "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith(("PADDLE_", "PORT_"))}, f)
if mode == "crash_in_training" and rank == "0":
    raise RuntimeError("a real failure")
if mode == "abort_in_training" and rank == "0":
    time.sleep(3)
    os.abort()
REFUSED = [
    "Traceback (most recent call last):\n  ...\n    pg = core.ProcessGroupGloo.create(store, "
    "rank, world_size, place, gid)\nOSError: [operator < gloo > error] pair.cc:784 connect "
    "[127.0.0.1]:52660: Connection refused",
    "I1204 17:07:08.223276  3764 tcp_store.cc:336] create libuv server at port: 58764\npython: "
    "/paddle/third_party/libuv/src/unix/core.c:314: uv__finish_close: Assertion `handle->flags "
    "& UV_HANDLE_CLOSING' failed.",
    "Traceback (most recent call last):\n  ...\n    pg = core.ProcessGroupGloo.create(store, "
    "rank, world_size, group_id)\nRuntimeError: [/paddle/third_party/gloo/gloo/transport/tcp/"
    "pair.cc:917] TIMEOUT self_rank = 0 pair_rank = 1 peer_str = [127.0.0.1]:27528",
][int(os.environ.get("FAKE_RENDEZVOUS_FAILURE", "0"))]
if rank == "0" and (mode == "refused_always"
                    or (mode == "refused_once" and not os.path.exists(marker))):
    open(marker, "w").close()
    sys.exit(print(REFUSED, flush=True) or 1)
print("\nTraining completed. \n", flush=True)
if mode == "refused_after_training" and rank == "0":
    sys.exit(print(REFUSED, flush=True) or 1)
if rank == "0" and (mode == "always" or (mode == "once" and not os.path.exists(marker))):
    open(marker, "w").close()
    time.sleep(3)  # rank 1 has finished too, as at the end of a real run
    os.abort()
"""


def _run(tmp_path, mode, failure=0):
    script = tmp_path / "fake_train.py"
    script.write_text(SCRIPT)
    out_dir = tmp_path / "out"
    env = dict(script_env(), FAKE_RENDEZVOUS_FAILURE=str(failure))
    marker = str(tmp_path / "aborted-once")
    return launch([str(script), mode, marker], out_dir, 2, env, 300, tmp_path), out_dir


@pytest.mark.probe
def test_abort_after_training_is_repeated_once(tmp_path):
    (rc, out), out_dir = _run(tmp_path, "once")
    assert rc == 0, out[-3000:]
    assert out.startswith("--- NOTE: the first launch lost a rank to SIGABRT at exit"), out[:300]
    assert (tmp_path / "out.aborted" / "log" / "workerlog.0").is_file()


@pytest.mark.probe
@pytest.mark.parametrize("failure", range(len(RENDEZVOUS_FAILURES)))
def test_a_failed_rendezvous_is_repeated_once(tmp_path, failure):
    (rc, out), out_dir = _run(tmp_path, "refused_once", failure)
    assert rc == 0, out[:1500] + "\n...\n" + out[-3000:]
    assert out.startswith("--- NOTE: the first launch failed a rank's rendezvous"), out[:300]
    first = (tmp_path / "out.refused" / "log" / "workerlog.0").read_text()
    assert all(s in first for s in RENDEZVOUS_FAILURES[failure])


@pytest.mark.probe
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


@pytest.mark.probe
def test_a_launch_draws_its_ports_from_its_workers_range(tmp_path):
    """Paddle's launcher honours ``PORT_RANGE`` (launch_ports): every rank endpoint lies in it."""
    (rc, out), out_dir = _run(tmp_path, "clean")
    assert rc == 0 and "NOTE" not in out, out[-3000:]
    low, high = (int(v) for v in script_env()["PORT_RANGE"].split(":"))
    for rank in (0, 1):
        with open(tmp_path / f"aborted-once.env{rank}") as f:
            seen = json.load(f)
        ports = [int(e.rsplit(":", 1)[1]) for e in seen["PADDLE_TRAINER_ENDPOINTS"].split(",")]
        assert len(ports) == 2 and all(low <= p <= high for p in ports), (seen, low, high)


def test_port_ranges_are_disjoint_per_worker_and_outside_the_ephemeral_range(monkeypatch):
    monkeypatch.setattr(script_runs, "_ephemeral_ports", lambda: (32768, 60999))
    ranges = []
    for worker in ("gw0", "gw1", "gw2", "gw15", "master", "gwx"):
        low, high = (int(v) for v in launch_ports({}, worker)["PORT_RANGE"].split(":"))
        assert 1024 <= low <= high < 32768 and high - low + 1 == script_runs._PORTS_PER_WORKER
        ranges.append((low, high))
    by_index = ranges[:4]
    assert all(a[1] < b[0] for a, b in zip(by_index, by_index[1:])), by_index
    assert ranges[4] == ranges[5] == ranges[0]  # not an xdist worker: the first range


def test_port_ranges_above_the_ephemeral_range_and_none_without_a_gap(monkeypatch):
    monkeypatch.setattr(script_runs, "_ephemeral_ports", lambda: (1024, 50000))
    low, high = (int(v) for v in launch_ports({}, "gw1")["PORT_RANGE"].split(":"))
    assert 50000 < low <= high <= 65535
    monkeypatch.setattr(script_runs, "_ephemeral_ports", lambda: (1024, 65000))
    assert "PORT_RANGE" not in launch_ports({}, "gw0")


def test_the_ephemeral_range_is_read_or_linuxs_default():
    low, high = script_runs._ephemeral_ports()
    assert 1 <= low < high <= 65535
    if os.path.exists("/proc/sys/net/ipv4/ip_local_port_range"):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            assert (low, high) == tuple(int(v) for v in f.read().split())
