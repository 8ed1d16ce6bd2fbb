"""Switch paddle_mgrad on from the environment: ``PADDLE_MGRAD=recompute,fused_linear`` (or ``all``).

How it gets here: ``pip install`` puts ``paddle_mgrad_autoload.pth`` into
site-packages; Python runs its one line (``import paddle_mgrad_autoload``) at
every interpreter start.  That top-level module imports nothing but ``os`` and
returns at once when ``PADDLE_MGRAD`` is unset, empty or ``0``.  Otherwise it
installs a one-shot import hook: the first ``import paddle`` of the process
(the script's own, PaddleNLP's, or each rank's under
``python -m paddle.distributed.launch``) imports ``zlib`` first (Paddle 2.6),
lets Paddle import, then calls :func:`activate` here -- before the script's
next line, so modelling code imported afterwards is covered as with
:func:`paddle_mgrad.enable`.

:func:`activate` parses the value (:func:`paddle_mgrad.env.parse_activation`),
enables the features, loads the op when ``fused_linear`` is on and logs one
line to stderr (each rank of a launch, prefixed with its rank)::

    paddle_mgrad: recompute, fused_linear on (op: cpp-onednn) via PADDLE_MGRAD

A bad value stops the process at that first ``import paddle``: one line on
stderr naming the allowed values, exit code 2.

``PADDLE_MGRAD_REPORT=<directory>`` additionally writes, at exit, one JSON file
per process (``paddle_mgrad_report.<rank>.<pid>.json``) with what was on and
:mod:`paddle_mgrad.stats`: evidence that a script you did not edit ran through
paddle_mgrad.
"""

from __future__ import annotations

import atexit
import json
import os
import sys

from . import env, stats
from .env import parse_activation
from .errors import FlagError
from .switch import enable, enabled

__all__ = ["activate", "ENV", "REPORT_ENV"]

ENV = "PADDLE_MGRAD"
REPORT_ENV = "PADDLE_MGRAD_REPORT"

_state = {"active": None}


def _rank():
    return os.environ.get("PADDLE_TRAINER_ID")


def _load_op() -> str:
    """Load (or JIT-build) the op with PADDLE_MGRAD hidden from the environment: the build
    runs Python subprocesses that import paddle, and must not activate (and wait on the
    build lock held here) themselves."""
    from . import ops

    saved = os.environ.pop(ENV, None)
    try:
        return ops.backend()
    finally:
        if saved is not None:
            os.environ[ENV] = saved


def activate(value=None, log=True) -> dict:
    """Enable what ``value`` (default: ``$PADDLE_MGRAD``) asks for; returns
    ``{"recompute": bool, "fused_linear": bool, "op_backend": str|None}``.

    Raises :class:`~paddle_mgrad.FlagError` for a bad value.
    """
    if value is None:
        value, want = env.raw(ENV), env.get(ENV)  # EnvError (a FlagError) for a bad value
    else:
        want = parse_activation(value)
    if not any(want.values()):
        return dict(want, op_backend=None)
    enable(recompute=want["recompute"], fused_linear=want["fused_linear"])
    info = dict(enabled(), op_backend=_load_op() if want["fused_linear"] else None)
    _state["active"] = info
    if log:
        on = ", ".join(k for k in ("recompute", "fused_linear") if info[k])
        op = f" (op: {info['op_backend']})" if info["op_backend"] else ""
        rank = _rank()
        prefix = f"[rank {rank}] " if rank is not None else ""
        print(f"{prefix}paddle_mgrad: {on} on{op} via {ENV}", file=sys.stderr, flush=True)
    report_dir = env.get(REPORT_ENV)
    if report_dir:
        atexit.register(_write_report, report_dir, value)
    return info


def _write_report(directory, value):
    """Write this process's report into ``directory`` (created 0700 if missing).

    Never a traceback at exit: a path that is not a usable directory gives one line on stderr.
    The file is created under a fresh temporary name (``O_EXCL | O_NOFOLLOW``) and renamed into
    place, so a symbolic link planted at the report's name is replaced, never written through.
    """
    name = f"paddle_mgrad_report.{_rank() or 'main'}.{os.getpid()}.json"
    tmp = None
    try:
        snap = stats.snapshot()
        report = {
            "pid": os.getpid(),
            "rank": _rank(),
            "argv": sys.argv,
            ENV: value,
            "active": _state["active"],
            "enabled_at_exit": enabled(),
            "recompute": snap["recompute"],
            "linear": snap["linear"],
            "paddle_c_ops": snap["paddle_c_ops"],
            "fused_params": sorted(snap["fused_params"]),
        }
        if os.path.lexists(directory) and not os.path.isdir(directory):
            raise NotADirectoryError(f"{directory} exists and is not a directory")
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o700, exist_ok=True)  # ranks race here
        tmp = os.path.join(directory, f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
            0o644,
        )
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, os.path.join(directory, name))  # replaces a link, never follows it
        tmp = None
    except Exception as e:  # at exit: one line, never a traceback
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(
            f"paddle_mgrad: warning: {REPORT_ENV}={directory}: no report written ({reason}); "
            "point it at a directory you can write",
            file=sys.stderr,
            flush=True,
        )
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _activate_from_hook():
    """Called by ``paddle_mgrad_autoload`` right after Paddle is imported."""
    try:
        activate()
    except FlagError as e:  # EnvError too
        print(f"paddle_mgrad: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
