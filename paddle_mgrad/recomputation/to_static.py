"""``paddle.jit.to_static`` of a model that calls recompute: run it as dygraph code.

``to_static``'s default mode (SOT) translates Python bytecode: it *simulates*
each function the model calls and, at the first thing it cannot put in a static
graph, "breaks the graph" -- runs that call as ordinary dygraph code.  Paddle's
own recompute gets there at its PyLayer, and SOT never translates Paddle's files
(a list of skipped path prefixes), so the whole recompute runs as dygraph.
Ours is paddle_mgrad code: on Paddle 2.6 SOT simulated it (registry installs,
RNG snapshots) and failed (``AttributeError: type object 'module' has no
attribute 'get_state'``).  Three steps make it behave as Paddle's:

* :func:`skip_our_files` adds paddle_mgrad's directory to SOT's skipped
  prefixes (done once, when this module is imported), so frames of our code run
  untranslated;
* :func:`break_graph` (first statement of ``recompute``) stops a simulation that
  has already entered our code: SOT runs the call as dygraph;
* :func:`untraced` switches SOT's frame hook off while the recompute runs, so the
  user's block (not in a skipped file) runs as dygraph too, as under Paddle's
  recompute on 3.x.

``full_graph=True`` (the AST translator) is unaffected: there ``recompute``
sees static mode and hands the block to Paddle's static recompute, as before.
All three are no-ops when nothing is being translated.
"""
from __future__ import annotations

import contextlib
import os

from .._compat import core

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

try:
    from paddle.jit.sot.psdb import breakgraph as _psdb_breakgraph
except ImportError:  # pragma: no cover - a Paddle without SOT
    _psdb_breakgraph = None
_set_eval_frame = getattr(core, "set_eval_frame", None)


def skip_our_files() -> bool:
    """Add paddle_mgrad's directory to SOT's skipped file prefixes; True if done."""
    try:
        from paddle.jit.sot.opcode_translator import skip_files
    except ImportError:  # pragma: no cover - a Paddle without SOT
        return False
    names = getattr(skip_files, "skip_file_names", None)
    setup = getattr(skip_files, "setup_skip_files", None)
    if names is None or setup is None:  # pragma: no cover - another SOT layout
        return False
    if _PACKAGE_DIR not in names:
        names.add(_PACKAGE_DIR)
        setup()  # hands the prefixes to the C frame hook
    return True


def break_graph():
    """Under SOT's simulation: stop here and run this call as dygraph; else nothing."""
    if _psdb_breakgraph is not None:
        _psdb_breakgraph()


@contextlib.contextmanager
def untraced():
    """Run the body with SOT's frame hook off (the user's block runs as dygraph)."""
    if _set_eval_frame is None:  # pragma: no cover
        yield
        return
    previous = _set_eval_frame(None)
    try:
        yield
    finally:
        _set_eval_frame(previous)


skip_our_files()
