"""``python -m paddle_mgrad doctor``: what runs where, why, and whether it works -- one screen.

Sections: versions (Python, Paddle and its CUDA build, paddle_mgrad, PaddleNLP / PaddleFormers
and the pins they need); switching on (the autoload ``.pth`` in this environment, every
``PADDLE_MGRAD*`` variable that is set and whether :mod:`paddle_mgrad.env` accepts it); the op
(backend per device and why: the C++ compiler, the CUDA toolkit's nvcc / cuBLASLt / runtime and
what to install when one is missing; the CPU's ISA and the bf16 / fp16 / fp64 paths); the op cache
(each build: complete, verified, size, Paddle version); a self-test of the seed case (a PyLayer
linear saving its weight with ``ctx.save_for_backward`` under ``MixPrecisionLayer``'s fp32
``main_grad`` and non-reentrant recompute: on Paddle's own recompute -- does this Paddle lose
``main_grad``, do you need paddle_mgrad at all? -- and through paddle_mgrad, against float64);
a verdict.  Exit code 0 when healthy, 1 when something is wrong, each problem on one line with
its fix.  ``--json`` prints the same as one JSON object (CI, bug reports).

How it stays alive whatever is broken: this process imports no Paddle and nothing that does
(the package's ``__init__`` skips its imports for the command line, :mod:`paddle_mgrad._cli`;
the build configuration is loaded by path).  Everything that needs Paddle runs in two
subprocesses (:mod:`paddle_mgrad.diagnostics._doctor_probe`) with ``PADDLE_MGRAD`` and invalid variables
removed: the first imports Paddle, lists the cache (no library is loaded) and runs the seed case
on plain Paddle; the second loads -- or builds -- the op the way training would, so a corrupt
cached library kills that subprocess (SIGBUS, reported with the directory to delete), not the
doctor.  Every section catches its own errors: the doctor reports its own failure as a problem.

Three steps, one module each: :mod:`.collect` gathers the facts, :mod:`.judge` turns them into
problems with fixes and a verdict, :mod:`.render` prints them; this module is the command.
"""

from __future__ import annotations

import argparse
import json
import sys

from .collect import PROBE_TIMEOUT, _error, collect
from .judge import _needs_line, diagnose, rebuilt, verdict
from .render import render

__all__ = ["main", "collect", "diagnose", "render"]


def _drop_autoload_hook():
    """This process never switches paddle_mgrad on (it must not load the op): remove the
    ``.pth``'s pending import hook, if any."""
    hook = sys.modules.get("paddle_mgrad_autoload")
    cls = getattr(hook, "_PaddleImportHook", None)
    if cls is not None:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, cls)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m paddle_mgrad doctor",
        description="What paddle_mgrad runs where, why, and whether it works. Exit code 0 when "
        "healthy, 1 when something is wrong (each problem with its fix).",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (CI, bug reports)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=PROBE_TIMEOUT["op"],
        help="seconds allowed to load or build the op (default %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        _drop_autoload_hook()
        progress = (
            None
            if args.json
            else (lambda msg: print(f"paddle_mgrad doctor: {msg} ...", file=sys.stderr, flush=True))
        )
        facts = collect(timeout=args.timeout, progress=progress)
        problems = diagnose(facts)
        code = 1 if problems else 0
        if args.json:
            print(
                json.dumps(
                    {
                        "exit_code": code,
                        "verdict": verdict(facts, problems),
                        "needs_paddle_mgrad": _needs_line(facts),
                        "rebuilt": [{"directory": d, "was": p} for d, p in rebuilt(facts)],
                        "problems": problems,
                        "facts": facts,
                    },
                    indent=1,
                    default=str,
                )
            )
        else:
            print(render(facts, problems))
        return code
    except Exception as e:  # noqa: BLE001  (never a traceback: one line, exit 1)
        print(
            f"paddle_mgrad doctor: internal error {_error(e)}; fix: report it "
            "(python -m paddle_mgrad doctor --json)",
            file=sys.stdout,
        )
        return 1
