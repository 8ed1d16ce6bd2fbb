"""Is this process paddle_mgrad's command-line tool (``python -m paddle_mgrad ...`` or the
``paddle-mgrad`` script)?  Asked by the package's ``__init__`` before it imports anything.

Why: the tool's job (``doctor``) is to report a broken installation -- a Paddle that does not
import, an invalid ``PADDLE_MGRAD*`` variable, a corrupt cached op build -- so its own process
must not import Paddle, validate the environment or switch paddle_mgrad on the way
``import paddle_mgrad`` normally does (any of those could stop it before it says anything, or
load the corrupt library into it).  It probes all of that in subprocesses instead.

Standard library only.
"""

from __future__ import annotations

import os
import sys

SCRIPT = "paddle-mgrad"  # the console script (setup.py entry_points)
PACKAGE = "paddle_mgrad"


_TAKES_VALUE = ("-X", "-W", "--check-hash-based-pycs")


def _module_after_dash_m(argv):
    """The module named by the interpreter's ``-m`` option in ``argv`` (sys.orig_argv)."""
    skip = False
    for i, arg in enumerate(argv[1:], 1):
        if skip:
            skip = False
            continue
        if arg in _TAKES_VALUE:
            skip = True
            continue
        if arg == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if arg.startswith("-m"):
            return arg[2:]
        if arg == "-c" or not arg.startswith("-"):  # a script or -c: no -m follows
            return None
    return None


def command_line_process(argv=None, orig_argv=None) -> bool:
    """True while the package is imported to run its command-line tool."""
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", None) if orig_argv is None else orig_argv
    if not argv:
        return False
    if os.path.basename(argv[0]) == SCRIPT:
        return True
    if argv[0] != "-m":  # runpy sets "-m" only while it imports the package of `python -m X`
        return False
    if orig_argv:  # Python >= 3.10
        return _module_after_dash_m(list(orig_argv)) == PACKAGE
    return argv[1:2] == ["doctor"]  # Python < 3.10: the subcommand is all we can see
