"""The user's path on paddlepaddle-gpu, checked by ``nox -s gpu_wheel`` (run from outside the
checkout so the installed package is imported).

    python gpu_wheel_check.py cuda [--installed]  # cuBLASLt wheel present: first use builds +cuda
    python gpu_wheel_check.py no-cublas # without it: CPU C++ op + exactly one warning

Both: the C++ op is correct on CPU tensors against float64.  ``cuda`` also loads the built
library's C entry point with ctypes and calls its CUDA path: without a GPU it must return a
clear error (no crash).  (Paddle itself exits the process when a GPU tensor is created on a
machine without a GPU, so the Paddle-level GPU call cannot be made here.)
"""

import ctypes
import io
import logging
import os
import sys
import warnings
import zlib  # noqa: F401  (before paddle, for Paddle 2.6)

import numpy as np

mode = sys.argv[1]
log = io.StringIO()
logging.basicConfig(level=logging.WARNING, stream=log)
import paddle  # noqa: E402

assert paddle.is_compiled_with_cuda(), "this check needs the paddlepaddle-gpu wheel"
import paddle_mgrad  # noqa: E402
from paddle_mgrad import ops  # noqa: E402

if "--installed" in sys.argv:
    assert "site-packages" in paddle_mgrad.__file__, (
        f"not the installed package: {paddle_mgrad.__file__}"
    )
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backend = ops.backend()
    ops.backend()
ours = [str(w.message) for w in caught if "paddle_mgrad" in str(w.message)]
print("BACKEND", backend)
print("DESCRIBE", ops.describe())
print("WARNINGS", len(ours), ours)
print("LOG", log.getvalue().strip().replace("\n", " | ")[:600])
assert backend.startswith("cpp-"), backend
if mode == "cuda":
    assert "+cuda" in backend, backend
    assert not ours, ours
    assert "compiling the fused weight-gradient op with CUDA" in log.getvalue(), "no JIT build?"
else:
    assert "+cuda" not in backend and ";gpu=" in backend, backend
    assert len(ours) == 1, ours
    assert "cublasLt" in ours[0] and "pip install" in ours[0], ours[0]

rs = np.random.RandomState(0)
for dtype in ("float32", "float16"):
    x = paddle.to_tensor(rs.standard_normal([300, 37]).astype("float32")).astype(dtype)
    dy = paddle.to_tensor(rs.standard_normal([300, 53]).astype("float32")).astype(dtype)
    mg, mb = paddle.ones([37, 53]), paddle.ones([53])
    ptr = mg.data_ptr()
    ops.fused_linear_param_grad_add(x, dy, mg, mb, True, True)
    assert mg.data_ptr() == ptr
    x2, y2 = x.astype("float32").numpy().astype("f8"), dy.astype("float32").numpy().astype("f8")
    np.testing.assert_allclose(mg.numpy(), 1 + x2.T @ y2, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(mb.numpy(), 1 + y2.sum(0), rtol=1e-5, atol=1e-4)
print("CPU OP OK")

if mode == "cuda":
    from paddle_mgrad.ops import _build

    lib = _build.library_path(ops.load())
    print("LIBRARY", lib)
    core = ctypes.CDLL(lib)  # loads libcublasLt via its rpath (no LD_LIBRARY_PATH)
    assert "LD_LIBRARY_PATH" not in os.environ or "nvidia" not in os.environ["LD_LIBRARY_PATH"]
    fn = core.pmg_wgrad_cuda_c
    i64, vp, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    fn.argtypes = [
        vp,
        vp,
        i32,
        i64,
        i64,
        i64,
        vp,
        i32,
        f32,
        vp,
        i32,
        f32,
        vp,
        i32,
        ctypes.c_char_p,
        i32,
    ]
    fn.restype = i32
    err = ctypes.create_string_buffer(512)
    rc = fn(None, None, 1, 0, 0, 0, None, 0, 1.0, None, 0, 1.0, None, 0, err, len(err))
    msg = err.value.decode()
    print("CUDA CALL WITHOUT GPU", rc, repr(msg))
    assert rc == 1 and "cuda" in msg.lower(), (rc, msg)
    with open("/proc/self/maps") as f:
        maps = f.read()
    print(
        "LOADED",
        sorted(
            {
                os.path.basename(m.split()[-1])
                for m in maps.splitlines()
                if "cublasLt" in m or "libcudart" in m
            }
        ),
    )
print("ALL OK", mode)
