"""``paddle.jit.to_static`` of a model that calls recompute: recompute runs as dygraph code.

``to_static``'s default translator (SOT) translates the Python bytecode of every frame
it meets, except frames of files under a list of skipped prefixes (Paddle's own
directory, the standard library, numpy, ...).  Paddle's recompute is in Paddle's
directory, so SOT breaks its graph there and runs the whole recompute -- PyLayer,
saved-tensor hooks, the user's block -- as ordinary dygraph code.  paddle_mgrad's
recompute (reached through Paddle's ``recompute``, whose code is our trampoline, or
called directly) is not: on Paddle 2.6 SOT translated it and failed on the first
training call (``AttributeError: type object 'module' has no attribute 'get_state'``
from the RNG snapshot; a ``TypeError`` from a registry install), and on 3.x it relied
on SOT coping with it.  :func:`skip_our_files` adds paddle_mgrad's directory to that
list (once, when this module is imported), so our recompute -- and our fused linear
inside it -- runs as dygraph under SOT exactly as Paddle's does.

``full_graph=True`` (the AST translator) is unaffected: there ``recompute`` sees static
mode and hands the block to Paddle's static recompute, as before.
"""

from __future__ import annotations

import os

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


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


skip_our_files()
