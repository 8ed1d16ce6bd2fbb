"""Run a training script as a user does (its own process, one or more ranks through
``paddle.distributed.launch``), for tests/nlp and tests/formers.  Test-only; never part of the
package.  Each test file builds its own command line and modes from these pieces."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH = os.path.join(ROOT, "paddle_mgrad_autoload.pth")


def trainer_args(max_steps, accum, learning_rate="1e-3", **more):
    """The Trainer arguments of every script run (PaddleNLP's and PaddleFormers' llm scripts):
    ``max_steps`` optimizer steps of ``accum`` micro-steps each, no warm-up, a log line per
    step, no checkpoint, no reporting, seed 42, no dataloader workers; ``more``: further
    ``--name value`` pairs (``per_device_train_batch_size=2``)."""
    args = {
        "max_steps": max_steps,
        "gradient_accumulation_steps": accum,
        "learning_rate": learning_rate,
        "warmup_steps": 0,
        "logging_steps": 1,
        "save_steps": 1000,
        "report_to": "none",
        "seed": 42,
        "dataloader_num_workers": 0,
        **more,
    }
    return [part for name, value in args.items() for part in (f"--{name}", str(value))]


#: ports a launch may give its ranks and rendezvous, when the kernel's ephemeral range cannot be
#: read: Linux's default ephemeral range is 32768-60999
_EPHEMERAL_DEFAULT = (32768, 60999)
#: how many ports each pytest-xdist worker's launches draw from
_PORTS_PER_WORKER = 1000


def _ephemeral_ports():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def launch_ports(env, worker=None):
    """Give ``paddle.distributed.launch`` (``env``) a ``PORT_RANGE`` of its own: outside the
    kernel's ephemeral port range and disjoint per pytest-xdist worker (``worker``, default
    ``PYTEST_XDIST_WORKER``: ``gw0``, ``gw1``, ...).  Returns ``env``.

    The launcher (Paddle 2.6.2 and 3.3.1, ``launch/context/node.py``) picks each rank's endpoint
    and the rendezvous (TCPStore) port by probing a port inside ``PORT_RANGE`` (default
    35100-64000), closing it and handing it on.  Two launches at once (``pytest -n 2``) can pick
    the same port, and the kernel can hand a port of that range to another process's outgoing
    or gloo connection in between: CI lost 2-rank runs that way on both versions (a refused gloo
    rendezvous; Paddle 3.3.1's TCPStore server aborting in libuv when its port was taken).  Every
    launch of one worker runs after the last one ended, so a range per worker outside the
    ephemeral range leaves no other launch and no kernel-chosen port to race with.  With no gap
    of :data:`_PORTS_PER_WORKER` ports per worker beside the ephemeral range, ``env`` is left
    as is (the launcher's default, and :func:`launch`'s one retry)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0") if worker is None else worker
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    low, high = _ephemeral_ports()
    for start, end in ((max(low - 16 * _PORTS_PER_WORKER, 1024), low - 1), (high + 1, 65535)):
        slots = (end - start + 1) // _PORTS_PER_WORKER
        if slots > 0:
            first = start + (index % slots) * _PORTS_PER_WORKER
            env["PORT_RANGE"] = f"{first}:{first + _PORTS_PER_WORKER - 1}"
            return env
    return env


def script_env():
    """This environment without paddle_mgrad's, the test evidence's or a launcher's variables;
    one thread per rank; faulthandler and glibc's fatal messages on stderr (a rank sometimes
    dies of SIGABRT at exit with nothing in its log even so: :func:`launch`)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PADDLE_MGRAD", "PMG_TEST_", "PADDLE_TRAINER"))
    }
    env.update(
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", LIBC_FATAL_STDERR_="1"
    )
    return launch_ports(env)


def with_evidence(env, audit_dir, evidence_dir):
    """The test's sitecustomize (``evidence_dir``) writes ``audit.<rank>.json`` to
    ``audit_dir``; the repository's paddle_mgrad is importable."""
    env.update(
        PMG_TEST_AUDIT_DIR=str(audit_dir), PYTHONPATH=os.pathsep.join([str(evidence_dir), ROOT])
    )


def switch_on(env, tmp_path):
    """``PADDLE_MGRAD=all`` through a copy of the autoload ``.pth`` (processed at interpreter
    start, as site-packages' would be; needs :func:`with_evidence`'s sitecustomize)."""
    pth_dir = tmp_path / "pth"
    pth_dir.mkdir(exist_ok=True)
    shutil.copy(PTH, pth_dir)
    env.update(PADDLE_MGRAD="all", PMG_TEST_PTH_DIR=str(pth_dir))
    if os.environ.get("PADDLE_MGRAD_CACHE"):
        env["PADDLE_MGRAD_CACHE"] = os.environ["PADDLE_MGRAD_CACHE"]


#: what the launcher prints for a rank killed by SIGABRT
ABORT = "Exit code -6"
#: what PaddleNLP's/PaddleFormers' Trainer logs when train() returned
COMPLETED = "Training completed."
#: what a rank's log shows when the rendezvous failed while the process group was created, each
#: a set of strings found together: a refused gloo connection (Paddle 2.6.2 and 3.3.1:
#: ``ProcessGroupGloo.create`` ... ``Connection refused``); Paddle 3.3.1's TCPStore server
#: aborting in libuv when it could not take its port (``create libuv server at port`` then
#: libuv's assertion in ``uv__finish_close``); gloo's pair connection timing out inside
#: ``ProcessGroupGloo.create`` (Paddle 2.6.2, ``pair.cc:917] TIMEOUT`` on both ranks, in
#: ``fleet.init`` while the sharding group was created on a loaded 2-core machine)
RENDEZVOUS_FAILURES = (
    ("ProcessGroupGloo", "Connection refused"),
    ("create libuv server at port", "uv__finish_close"),
    ("ProcessGroupGloo.create", "gloo/transport/tcp/pair.cc", "] TIMEOUT"),
)


def rendezvous_failed(texts) -> bool:
    """One of the rank logs ``texts`` shows a failed rendezvous (:data:`RENDEZVOUS_FAILURES`).

    Such a failure stops a run in ``fleet.init``, before training began: a port taken between
    the launcher's probe and the rank's bind (:func:`launch_ports`) refuses the gloo connection
    (Paddle 2.6.2) or aborts the TCPStore server (3.3.1); gloo's pair connection can also time
    out there (2.6.2).  CI lost 2-rank runs to each.  Such a run is repeated once
    (:func:`launch`, ``fleet/launch/launching.run``)."""
    return any(all(s in t for s in failure) for t in texts for failure in RENDEZVOUS_FAILURES)


def launch(argv, out_dir, nproc, env, timeout, cwd):
    """``python argv`` (nproc > 1: through paddle.distributed.launch, logs in out_dir/log).
    Returns (returncode, the workers' logs then the launcher's output).

    One retry, for two failures only, that are Paddle's and not the script's:

    * Paddle 3.3.1's 2-rank gloo runs on CPU sometimes lose a rank to SIGABRT *after*
      training, at interpreter exit, with nothing in its log (no Python traceback: faulthandler
      is already off).  Seen in plain runs without paddle_mgrad as well as with it (in CI, and
      locally in 2 of 21 runs of test_unmodified_script_two_ranks).
      Repeated when the launcher reports that abort and every rank's log says training
      completed (the aborted run is kept beside it as ``<out_dir>.aborted``);
    * a failed rendezvous before training (:func:`rendezvous_failed`; kept as
      ``<out_dir>.refused``).

    The repeat is named in the output; any other failure is returned as is."""
    rc, out = _launch_once(argv, out_dir, nproc, env, timeout, cwd)
    why = None if rc == 0 or nproc < 2 else _paddles_failure(out_dir, out, nproc)
    if why is not None:
        kept = out_dir.with_name(out_dir.name + "." + why[0])
        shutil.rmtree(kept, ignore_errors=True)
        out_dir.rename(kept)
        rc, out = _launch_once(argv, out_dir, nproc, env, timeout, cwd)
        out = (
            f"--- NOTE: the first launch {why[1]}; repeated once; first run kept in {kept}\n" + out
        )
        print(out.splitlines()[0])
    return rc, out


def _paddles_failure(out_dir, out, nproc):
    """(suffix, description) of a failed run to repeat (:func:`launch`), or None."""
    logs = [out_dir / "log" / f"workerlog.{r}" for r in range(nproc)]
    texts = [log.read_text(errors="replace") for log in logs if log.is_file()]
    if (
        len(texts) == nproc
        and ABORT in out
        and all(COMPLETED in t and "Traceback (most recent call last)" not in t for t in texts)
    ):
        return (
            "aborted",
            "lost a rank to SIGABRT at exit after training completed on every "
            "rank (Paddle's teardown)",
        )
    if any(rendezvous_failed([t]) and COMPLETED not in t for t in texts):  # before training
        return (
            "refused",
            "failed a rank's rendezvous before training (Paddle's process group creation: "
            "a port taken between the launcher's choice and the rank's bind, or gloo's "
            "connection timed out)",
        )
    return None


def _launch_once(argv, out_dir, nproc, env, timeout, cwd):
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "paddle.distributed.launch",
            "--log_dir",
            str(out_dir / "log"),
            "--nproc_per_node",
            str(nproc),
            *argv,
        ]
    else:
        cmd = [sys.executable, *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(cwd))
    out = r.stdout + r.stderr
    if nproc > 1 and (out_dir / "log").is_dir():
        workers = "".join(
            f"\n--- {log.name}\n" + log.read_text(errors="replace")
            for log in sorted((out_dir / "log").iterdir())
        )
        out = workers + "\n--- launcher\n" + out
    return r.returncode, out
