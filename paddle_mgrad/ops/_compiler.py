"""The compiler invocation: Paddle's setup script for the op, run without a shell.

Split out of :mod:`._build`, which decides *what* to build (sources, flags, the CUDA toolkit, the
key) and where; this module only runs the compiler into a directory it is given and reports its
failure in a few lines.  Knows nothing of the cache.
"""

from __future__ import annotations

import os
import subprocess
import sys

_PARALLEL_SETUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_parallel_setup.py")


def compile_into(build_dir, name, config, src, toolkit=None, verbose=False):
    """Compile the op module ``name`` into ``build_dir``: Paddle's setup script
    (``_write_setup_file``, the same one ``cpp_extension.load`` writes) run by
    ``python _parallel_setup.py setup.py build`` (sources compiled concurrently) WITHOUT a shell
    (Paddle's ``load`` runs ``cd <dir> && ...`` unquoted, which breaks on a space).

    ``config`` is ``(sources, cxx flags, ld flags, nvcc flags)`` with sources relative to the
    source directory ``src``; ``toolkit`` the CUDA toolkit for a CUDA build (None without).
    Raises RuntimeError with the compiler output's tail when the build fails."""
    from paddle.utils.cpp_extension import extension_utils as eu

    if any(c in build_dir for c in "'\\\n"):
        raise RuntimeError(
            f"the build directory {build_dir!r} contains a quote, backslash or "
            "newline, which Paddle's setup script cannot hold. Fix: set "
            "PADDLE_MGRAD_CACHE to a path without them"
        )
    sources, cflags, ldflags, nvcc = config
    env = dict(os.environ)
    if toolkit is not None:
        # e.g. libcudart.so for Paddle's -lcudart when only .so.12 exists
        shims = toolkit.link_shims()
        if shims:
            link_dir = os.path.join(build_dir, "cuda-link")
            os.makedirs(link_dir, exist_ok=True)
            for shim, target in shims.items():
                path = os.path.join(link_dir, shim)
                if not os.path.lexists(path):
                    os.symlink(target, path)
            ldflags = [f"-L{link_dir}"] + ldflags
        # Paddle's setup takes nvcc (and the include/lib dirs it adds itself, and the -lcudart
        # it links) from $CUDA_HOME, else from `which nvcc`: point it at our toolkit.
        env["CUDA_HOME"] = toolkit.home
    setup_file = os.path.join(build_dir, f"{name}_setup.py")
    eu._write_setup_file(
        name,
        [os.path.join(src, s) for s in sources],
        setup_file,
        os.path.join(build_dir, name),
        None,
        None,
        cflags + [f"-I{src}"],
        (nvcc + [f"-I{src}"]) if nvcc else [],
        ldflags,
        verbose,
    )
    # through _parallel_setup.py: the sources compile concurrently on Paddle 2.6 as on 3.x
    cmd = [sys.executable, _PARALLEL_SETUP, setup_file, "build"]
    if verbose:
        r = subprocess.run(cmd, cwd=build_dir, env=env)
        out = ""
    else:
        r = subprocess.run(
            cmd,
            cwd=build_dir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        out = r.stdout
    if r.returncode != 0:
        tail = "\n".join(
            ln for ln in out.strip().splitlines()[-15:] if not ln.startswith("running ")
        )
        raise RuntimeError(
            f"the compiler failed (exit {r.returncode})"
            + (f":\n{tail}" if tail else " (output above)")
        )
