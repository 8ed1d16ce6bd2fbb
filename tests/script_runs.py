"""Run a training script as a user does (its own process, one or more ranks through
``paddle.distributed.launch``), for tests/nlp and tests/formers.  Test-only; never part of the
package.  Each test file builds its own command line and modes from these pieces."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTH = os.path.join(ROOT, "paddle_mgrad_autoload.pth")


def script_env():
    """This environment without paddle_mgrad's, the test evidence's or a launcher's variables;
    one thread per rank; faulthandler and glibc's fatal messages on stderr (a rank once died of
    SIGABRT at exit with nothing in its log, rarely and under CPU load: if it recurs, the log
    says where)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PADDLE_MGRAD", "PMG_TEST_", "PADDLE_TRAINER"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               LIBC_FATAL_STDERR_="1")
    return env


def with_evidence(env, audit_dir, evidence_dir):
    """The test's sitecustomize (``evidence_dir``) writes ``audit.<rank>.json`` to
    ``audit_dir``; the repository's paddle_mgrad is importable."""
    env.update(PMG_TEST_AUDIT_DIR=str(audit_dir),
               PYTHONPATH=os.pathsep.join([str(evidence_dir), ROOT]))


def switch_on(env, tmp_path):
    """``PADDLE_MGRAD=all`` through a copy of the autoload ``.pth`` (processed at interpreter
    start, as site-packages' would be; needs :func:`with_evidence`'s sitecustomize)."""
    pth_dir = tmp_path / "pth"
    pth_dir.mkdir(exist_ok=True)
    shutil.copy(PTH, pth_dir)
    env.update(PADDLE_MGRAD="all", PMG_TEST_PTH_DIR=str(pth_dir))
    if os.environ.get("PADDLE_MGRAD_CACHE"):
        env["PADDLE_MGRAD_CACHE"] = os.environ["PADDLE_MGRAD_CACHE"]


def launch(argv, out_dir, nproc, env, timeout, cwd):
    """``python argv`` (nproc > 1: through paddle.distributed.launch, logs in out_dir/log).
    Returns (returncode, the workers' logs then the launcher's output)."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--log_dir",
               str(out_dir / "log"), "--nproc_per_node", str(nproc), *argv]
    else:
        cmd = [sys.executable, *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                       cwd=str(cwd))
    out = r.stdout + r.stderr
    if nproc > 1 and (out_dir / "log").is_dir():
        workers = "".join(f"\n--- {log.name}\n" + log.read_text(errors="replace")
                          for log in sorted((out_dir / "log").iterdir()))
        out = workers + "\n--- launcher\n" + out
    return r.returncode, out
