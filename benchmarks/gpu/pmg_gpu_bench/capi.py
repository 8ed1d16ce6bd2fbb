"""ctypes over the test/benchmark library: csrc/wgrad_capi.cc (the cores) and
csrc/wgrad_capi_testing.cc (the GPU path's decisions and the fakes, test-only)."""

from __future__ import annotations

import ctypes
import re

DTYPE_CODE = {"float32": 0, "bfloat16": 1, "float16": 2, "float64": 3}
ELEM = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
BIAS_MODE = {"auto": 0, "epilogue": 1, "kernel": 2}


class FakeGpuConfig(ctypes.Structure):
    """csrc/wgrad_capi_testing.cc PmgFakeGpu: what the fake GPU of pmg_fake_cuda_core /
    pmg_fake_gpu_flow_ex answers (zeros: a 132-SM sm_90 whose epilogue algorithm is the plain
    GEMM's best, enough memory, nothing pending, every pointer on the call's device)."""

    i32, u64, f32 = ctypes.c_int32, ctypes.c_uint64, ctypes.c_float
    _fields_ = [
        ("sms", i32),
        ("capability", i32),
        ("epi_missing", i32),
        ("epi_algo", i32),
        ("epi_tile", i32),
        ("epi_stages", i32),
        ("epi_waves", f32),
        ("plain_missing", i32),
        ("plain_algo", i32),
        ("plain_tile", i32),
        ("plain_stages", i32),
        ("plain_splitk", i32),
        ("plain_waves", f32),
        ("gemm_workspace", u64),
        ("zero_ws_missing", i32),
        ("alloc_limit", u64),
        ("pending_error", i32),
        ("misplaced", i32),
        ("misplaced_kind", i32),
        ("misplaced_device", i32),
        ("stream_elsewhere", i32),
        ("cuda_major", i32),
    ]
    del i32, u64, f32


class CoreError(RuntimeError):
    """A call of the C ABI failed; ``info`` says what the CUDA core did (or '')."""

    def __init__(self, msg, info=""):
        super().__init__(msg)
        self.info = info


ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class Core:
    """ctypes wrapper of the test/benchmark library (pmg_gpu_bench.build)."""

    FakeGpuConfig = FakeGpuConfig

    def __init__(self, path, cuda=True):
        self.path = path
        self.lib = lib = ctypes.CDLL(path)
        i64, vp, f32, i32, cp = (
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_char_p,
        )
        common = [vp, vp, i32, i64, i64, i64, vp, i32, f32, vp, i32, f32]
        lib.pmg_wgrad_cpu_c.argtypes = common + [cp, i32]
        lib.pmg_wgrad_cpu_c.restype = i32
        lib.pmg_cpu_gemm_backend.restype = cp
        lib.pmg_has_cuda.restype = i32
        lib.pmg_pointer_alignment.argtypes = [ctypes.c_size_t]
        lib.pmg_pointer_alignment.restype = ctypes.c_uint32
        lib.pmg_targets_cover.argtypes = [cp, i32]
        lib.pmg_parse_bias_mode.argtypes = [cp, cp, i32]
        lib.pmg_choose_bias.argtypes = [i32, i64, i64, i64, i32, i32, i32, i32, i32, cp, i32]
        lib.pmg_plan_workspace.argtypes = [
            i32,
            i64,
            i64,
            i64,
            i32,
            ctypes.c_uint64,
            i32,
            ctypes.POINTER(i64),
        ]
        lib.pmg_plan_workspace.restype = None
        lib.pmg_check_element_alignment.argtypes = [
            vp,
            vp,
            i32,
            i64,
            i64,
            i64,
            vp,
            i32,
            vp,
            i32,
            cp,
            i32,
        ]
        lib.pmg_check_places.argtypes = [ctypes.POINTER(i32), ctypes.POINTER(i32), i32, cp, i32]
        lib.pmg_fake_gpu_flow.argtypes = [
            ctypes.POINTER(i32),
            ctypes.POINTER(i32),
            i32,
            i32,
            i32,
            i32,
            cp,
            i32,
            i32,
            cp,
            i32,
            cp,
            i32,
        ]
        fake = ctypes.POINTER(FakeGpuConfig)
        lib.pmg_fake_gpu_flow_ex.argtypes = [
            ctypes.POINTER(i32),
            ctypes.POINTER(i32),
            i32,
            i32,
            i32,
            i32,
            i64,
            i64,
            i64,
            cp,
            i32,
            i32,
            fake,
            cp,
            i32,
            cp,
            i32,
            cp,
            i32,
        ]
        lib.pmg_fake_cuda_core.argtypes = common + [
            i32,
            i32,
            i32,
            i32,
            fake,
            cp,
            i32,
            cp,
            i32,
            cp,
            i32,
        ]
        lib.pmg_plan_bias_kernel.argtypes = [
            i64,
            i64,
            i32,
            ctypes.c_size_t,
            i32,
            ctypes.POINTER(i64),
        ]
        lib.pmg_plan_bias_kernel.restype = None
        lib.pmg_bias_reduce_reference.argtypes = [vp, i32, i64, i64, ctypes.c_size_t, i32, vp]
        lib.pmg_bias_reduce_reference.restype = None
        lib.pmg_heuristic_rows.argtypes = [i64]
        lib.pmg_heuristic_rows.restype = i64
        lib.pmg_algo_cache_sim.argtypes = [ctypes.POINTER(i64), i32, i32, ctypes.POINTER(i64)]
        lib.pmg_algo_cache_sim.restype = None
        self.cuda = cuda
        if cuda:
            lib.pmg_wgrad_cuda_c.argtypes = common + [vp, i32, cp, i32]
            lib.pmg_wgrad_cuda_c.restype = i32
            lib.pmg_wgrad_cuda_ex.argtypes = common + [
                i32,
                vp,
                vp,
                ctypes.c_size_t,
                ALLOC_FN,
                vp,
                i32,
                i32,
                cp,
                i32,
                cp,
                i32,
            ]
            lib.pmg_wgrad_cuda_ex.restype = i32
            lib.pmg_cuda_targets.restype = cp
            lib.pmg_cuda_stats.argtypes = [cp, i32]
            lib.pmg_cuda_stats.restype = None

    @staticmethod
    def _args(x, dy, in_dtype, M, K, N, dw, dw_dtype, dw_beta, db, db_dtype, db_beta):
        return (
            x,
            dy,
            DTYPE_CODE[in_dtype],
            M,
            K,
            N,
            dw,
            DTYPE_CODE[dw_dtype],
            dw_beta,
            db,
            DTYPE_CODE[db_dtype],
            db_beta,
        )

    def cpu(self, *a):
        err = ctypes.create_string_buffer(2048)
        if self.lib.pmg_wgrad_cpu_c(*self._args(*a), err, len(err)) != 0:
            raise CoreError(err.value.decode())
        return "cpu"

    def gpu(self, stream, device, *a):
        """The short entry point (auto bias path, stream-ordered scratch)."""
        err = ctypes.create_string_buffer(2048)
        if self.lib.pmg_wgrad_cuda_c(*self._args(*a), stream, device, err, len(err)) != 0:
            raise CoreError(err.value.decode())

    def gpu_ex(
        self,
        *a,
        device,
        stream,
        workspace=None,
        workspace_bytes=0,
        alloc=None,
        bias_mode="auto",
        sim=0,
    ):
        """The full entry point; returns the core's one-line report.  ``alloc``: a Python
        callable bytes -> device pointer (int) or 0."""
        err = ctypes.create_string_buffer(2048)
        info = ctypes.create_string_buffer(512)
        cb = ALLOC_FN(lambda n, _u: alloc(n) or None) if alloc else ALLOC_FN()
        rc = self.lib.pmg_wgrad_cuda_ex(
            *self._args(*a),
            device,
            stream,
            workspace,
            workspace_bytes,
            cb,
            None,
            BIAS_MODE[bias_mode],
            sim,
            info,
            len(info),
            err,
            len(err),
        )
        if rc != 0:
            raise CoreError(err.value.decode(), info.value.decode())
        return info.value.decode()

    def bias_reference(self, dy_ptr, in_dtype, M, N, sms, address=None):
        """The bias kernel's column sums of dy (host memory at dy_ptr) computed on the CPU in the
        kernel's exact order for a GPU of `sms` SMs and dY at `address` (default dy_ptr):
        a float64 numpy array holding the fp32 (fp64) sums."""
        import numpy as np

        out = np.zeros(N, np.float64)
        self.lib.pmg_bias_reduce_reference(
            dy_ptr,
            DTYPE_CODE[in_dtype],
            M,
            N,
            dy_ptr if address is None else address,
            sms,
            out.ctypes.data,
        )
        return out

    def targets(self):
        return self.lib.pmg_cuda_targets().decode() if self.cuda else ""

    def stats(self):
        buf = ctypes.create_string_buffer(1024)
        self.lib.pmg_cuda_stats(buf, len(buf))
        return buf.value.decode()


def info_field(info, key):
    """A field of the core's report line, e.g. info_field('cap=90 bias=epilogue ...', 'bias')."""
    m = re.search(rf"\b{key}=(\S+)", info or "")
    return m.group(1) if m else None
