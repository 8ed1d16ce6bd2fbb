"""The half of ``python -m paddle_mgrad doctor`` that imports Paddle: runs in a subprocess.

The doctor starts this twice (see :mod:`paddle_mgrad.diagnostics.doctor`):

* ``paddle``: Paddle's version and CUDA build, the op cache (listed without loading any
  library), and the seed self-test on Paddle's own recompute -- nothing of ours is loaded;
* ``op``: loads (or builds) the op the way training would, reports what runs where and why, the
  CPU's paths, and the seed self-test through paddle_mgrad.

Each step prints one line ``@@paddle_mgrad_doctor@@ {json}`` as soon as it is done, and a
``"started"`` line before anything that may crash (loading a cached library), so a process
killed by a signal (a truncated ``.so`` gives SIGBUS in ``dlopen``) still tells the doctor what
it was doing and where.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

MARK = "@@paddle_mgrad_doctor@@ "


def emit(step, **data):
    sys.stdout.write(MARK + json.dumps(dict(step=step, **data), default=str) + "\n")
    sys.stdout.flush()


def _error(e):
    return f"{type(e).__name__}: {e}".strip()[:1500]


def _minimal_listing(root, current):
    """The cache without ``_build.inspect_cache``: directories, markers, sizes (no dlopen)."""
    out = []
    if not os.path.isdir(root):
        return out
    for key in sorted(os.listdir(root)):
        d = os.path.join(root, key)
        if not os.path.isdir(d):
            continue
        size = 0
        for base, _, files in os.walk(d):
            for f in files:
                try:
                    size += os.lstat(os.path.join(base, f)).st_size
                except OSError:
                    pass
        problem = None
        failed = os.path.join(d, ".failed")
        if os.path.exists(failed):
            try:
                with open(failed) as f:
                    problem = "failed build: " + f.read()[-300:]
            except OSError:
                problem = "failed build"
        out.append(
            {
                "directory": d,
                "key": key,
                "complete": os.path.exists(os.path.join(d, ".complete")),
                "verified": None,
                "problem": problem,
                "size": size,
                "paddle_version": None,
                "cuda": None,
                "current": key in current,
            }
        )
    return out


def step_paddle():
    import paddle  # imported (or its failure reported) by the doctor's bootstrap already

    cuda = bool(paddle.is_compiled_with_cuda())
    info = {
        "version": paddle.__version__,
        "commit": getattr(paddle.version, "commit", None),
        "cuda": cuda,
        "file": paddle.__file__,
    }
    if cuda:
        try:
            info["cuda_version"] = paddle.version.cuda()
            info["gpus"] = paddle.device.cuda.device_count()
        except Exception as e:  # noqa: BLE001
            info["cuda_error"] = _error(e)
    emit("paddle", **info)


def step_cache(name="cache"):
    emit(name, started=True)
    from paddle_mgrad.ops import _build

    root = _build.cache_root()
    current = {}
    try:
        current["cpu"] = _build.build_key(False)
        if _build.want_cuda():
            tk = _build.cuda_toolkit()
            if tk.ok:
                current["cuda"] = _build.build_key(True)
    except Exception as e:  # noqa: BLE001
        current["error"] = _error(e)
    keys = {v for k, v in current.items() if k != "error"}
    inspect = getattr(_build, "inspect_cache", None)
    if inspect is not None:
        try:
            builds = [dict(b) for b in inspect(root)]
            lister = "inspect_cache"
        except Exception as e:  # noqa: BLE001
            builds, lister = (
                _minimal_listing(root, keys),
                f"minimal (inspect_cache failed: {_error(e)})",
            )
    else:
        builds, lister = _minimal_listing(root, keys), "minimal"
    for b in builds:  # the doctor marks the current builds whatever the lister knows
        b["current"] = bool(b.get("current")) or b.get("key") in keys
    prebuilt = []
    pre = _build.prebuilt_root()
    if os.path.isdir(pre):
        prebuilt = [
            {
                "directory": os.path.join(pre, k),
                "key": k,
                "complete": os.path.exists(os.path.join(pre, k, ".complete")),
                "current": k in keys,
            }
            for k in sorted(os.listdir(pre))
        ]
    from paddle_mgrad import env

    emit(
        name,
        root=root,
        from_env=env.raw("PADDLE_MGRAD_CACHE") is not None,
        current=current,
        builds=builds,
        lister=lister,
        prebuilt_root=pre,
        prebuilt=prebuilt,
        will_load=[
            os.path.join(p, k)
            for k in sorted(keys)
            for p in (pre, root)
            if os.path.exists(os.path.join(p, k, ".complete"))
        ],
    )


def step_selftest(mode):
    emit(f"selftest_{mode}", started=True)
    from paddle_mgrad.diagnostics import selftest

    emit(f"selftest_{mode}", **selftest.run(mode))


def step_op():
    from paddle_mgrad import ops
    from paddle_mgrad.ops import _build

    emit("op", started=True)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = ops.load()
        backends = ops.backends()
    info = {
        "seconds": round(time.perf_counter() - t0, 3),
        "backend": ops.backend(),
        "backends": backends,
        "describe": ops.describe(),
        "fallback_reason": ops.fallback_reason(),
        "cuda_fallback_reason": ops.cuda_fallback_reason(),
        "warnings": [str(w.message)[:1500] for w in caught if "paddle_mgrad" in str(w.message)],
    }
    if module is not None:
        try:
            info["library"] = _build.library_path(module)
        except Exception as e:  # noqa: BLE001
            info["library_error"] = _error(e)
    emit("op", **info)


def step_cpu():
    from paddle_mgrad import ops

    emit("cpu", **ops.cpu_info())


STEPS = {
    "paddle": (
        ("paddle", step_paddle),
        ("cache", step_cache),
        ("selftest_paddle", lambda: step_selftest("paddle")),
    ),
    # the cache again once the op is loaded: what loading it did there (e.g. rebuilt a bad build)
    "op": (
        ("op", step_op),
        ("cache_after", lambda: step_cache("cache_after")),
        ("cpu", step_cpu),
        ("selftest_paddle_mgrad", lambda: step_selftest("paddle_mgrad")),
    ),
}


def main(which):
    """Run one probe's steps; a step that raises is reported and the next one still runs."""
    for name, step in STEPS[which]:
        try:
            step()
        except Exception as e:  # noqa: BLE001
            emit(name, failed=_error(e))
    return 0
