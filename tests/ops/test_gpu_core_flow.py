"""The CUDA core's steps (csrc/wgrad_cuda_flow.h) and decisions (csrc/wgrad_gpu_plan.cc) on a fake
GPU, through the shipped module's C ABI, without a GPU: the epilogue against the plain
GEMM's best algorithm, the bias kernel's grid and its exact order of additions (a CPU reference),
re-planning without cuBLASLt workspace under memory pressure, the C ABI's own checks (M = 0
betas, someone else's pending CUDA error, pointers and stream on the call's device), the
heuristic's row buckets and the bounded algorithm cache."""

import ctypes

import numpy as np
import pytest

DT = {"float32": 0, "bfloat16": 1, "float16": 2, "float64": 3}
MODE = {"auto": 0, "epilogue": 1, "kernel": 2}


# what cuBLASLt answers for a LoRA-like weight gradient (K*N small, M large): the plain GEMM's
# best splits K 4 ways; the split-K-free epilogue algorithm fills a third of the SMs
SPLITK = dict(
    plain_algo=21,
    plain_tile=18,
    plain_stages=8,
    plain_splitk=4,
    plain_waves=0.9,
    epi_algo=21,
    epi_tile=18,
    epi_stages=8,
    epi_waves=0.3,
)
BASE = 0x7F0000001000  # a 256-byte aligned fake device address (never dereferenced)


def core(
    capi,
    M=4096,
    K=64,
    N=64,
    in_dtype="bfloat16",
    dw="float32",
    db="float32",
    beta=1.0,
    db_beta=1.0,
    has_db=True,
    has_dw=True,
    mode="auto",
    device=0,
    sim=0,
    fail=0,
    **gpu,
):
    """One call of the core's flow on the fake GPU -> (rc, steps, report fields, error)."""
    cfg = type(capi).FakeGpuConfig(**gpu)
    trace, report, err = (ctypes.create_string_buffer(2048) for _ in range(3))
    rc = capi.lib.pmg_fake_cuda_core(
        BASE,
        BASE + (1 << 24),
        DT[in_dtype],
        M,
        K,
        N,
        BASE + (2 << 24) if has_dw else None,
        DT[dw],
        beta,
        BASE + (3 << 24) if has_db else None,
        DT[db],
        db_beta,
        device,
        MODE[mode],
        sim,
        fail,
        ctypes.byref(cfg),
        trace,
        len(trace),
        report,
        len(report),
        err,
        len(err),
    )
    line = report.value.decode()
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    fields["line"] = line
    return rc, trace.value.decode().split(), fields, err.value.decode()


def workspace(capi, path, M, K, N, gemm_ws, sms=132, in_dtype="bfloat16"):
    out = (ctypes.c_int64 * 8)()
    capi.lib.pmg_plan_workspace(DT[in_dtype], M, K, N, path, gemm_ws, sms, out)
    return out[7]  # request


def launch(steps):
    return [s for s in steps if s.startswith("launch(")]


# ------------------------------------------------------------------ epilogue or not
def test_epilogue_when_its_algorithm_is_the_plain_gemms_best(capi):
    rc, steps, rep, err = core(capi, gemm_workspace=4096)
    assert rc == 0, err
    assert steps == [
        "heuristic(epilogue,M=4096,ws<=33554432)",
        "heuristic(plain,M=4096,ws<=33554432)",
        f"alloc({workspace(capi, 1, 4096, 64, 64, 4096)})",
        "launch(bias=epilogue,gemm_ws=4096,splitk=1,splits=0)",
    ]
    assert rep["bias"] == "epilogue" and rep["ws_retry"] == "0"


def test_split_k_plain_gemm_plus_bias_kernel_when_the_epilogue_would_lose_it(capi):
    """LoRA / MoE-expert shapes: the heuristic splits K for the plain GEMM; the epilogue has no
    split-K and fills a third of the GPU -> plain GEMM (split-K) + our kernel, scratch sized for
    the kernel's partial sums (the switch happens after the heuristic)."""
    rc, steps, rep, err = core(capi, gemm_workspace=8192, **SPLITK)
    assert rc == 0, err
    want = workspace(capi, 2, 4096, 64, 64, 8192)
    assert want != workspace(capi, 1, 4096, 64, 64, 8192)  # not the epilogue's size
    assert steps[2] == f"alloc({want})"
    (ran,) = launch(steps)
    assert ran.startswith("launch(bias=kernel,gemm_ws=8192,splitk=4,splits=") and not ran.endswith(
        "splits=0)"
    )
    assert rep["bias"] == "kernel"
    assert (
        "(the epilogue's algorithm (0.30 waves) is not the plain GEMM's best (algorithm 21, "
        "split-K 4, 0.90 waves): plain GEMM + bias kernel)" in rep["line"]
    )
    rc, steps, rep, err = core(capi, **dict(SPLITK, epi_waves=1.0))  # the epilogue fills the GPU
    assert rc == 0 and rep["bias"] == "epilogue"
    rc, steps, rep, err = core(capi, **dict(SPLITK, plain_splitk=1, epi_tile=7))  # other tile
    assert rc == 0 and rep["bias"] == "kernel"
    rc, steps, rep, err = core(capi, **dict(SPLITK, plain_splitk=1, epi_stages=3))  # other stages
    assert rc == 0 and rep["bias"] == "kernel"


def test_forced_and_missing_epilogue(capi):
    rc, steps, rep, err = core(capi, mode="epilogue", **SPLITK)  # forced: no plain query at all
    assert rc == 0 and rep["bias"] == "epilogue" and not [s for s in steps if "plain" in s]
    rc, steps, rep, err = core(capi, epi_missing=1)
    assert rc == 0 and rep["bias"] == "kernel"
    rc, steps, rep, err = core(capi, epi_missing=1, mode="epilogue")
    assert rc == 1 and err.startswith("PADDLE_MGRAD_CUDA_BIAS=epilogue, but it cannot apply: ")
    assert "split-K-free BGRADA-epilogue" in err and not launch(steps)
    rc, steps, rep, err = core(capi, epi_missing=1, plain_missing=1)
    assert rc == 1 and "cuBLASLt offers no algorithm" in err and not launch(steps)
    rc, steps, rep, err = core(capi, mode="kernel", **SPLITK)  # forced kernel: plain query only
    assert (
        rc == 0
        and rep["bias"] == "kernel"
        and [s for s in steps if s.startswith("heuristic")]
        == ["heuristic(plain,M=4096,ws<=33554432)"]
    )


def test_bias_free_and_rowless_calls_ask_only_what_they_need(capi):
    rc, steps, rep, err = core(capi, has_db=False, **SPLITK)
    assert rc == 0 and steps[0].startswith("heuristic(plain") and rep["bias"] == "none"
    assert launch(steps) == ["launch(bias=none,gemm_ws=0,splitk=4,splits=0)"]
    rc, steps, rep, err = core(capi, M=0, beta=0.0)  # no rows: no GEMM, no heuristic
    assert rc == 0 and not [s for s in steps if s.startswith("heuristic")]
    assert launch(steps) == ["launch(bias=kernel,gemm_ws=0,splitk=0,splits=0)"]


# ------------------------------------------------------------------ memory pressure
def test_memory_pressure_replans_without_gemm_workspace(capi):
    big = workspace(capi, 1, 4096, 64, 64, 1 << 20)
    small = workspace(capi, 1, 4096, 64, 64, 0)
    rc, steps, rep, err = core(capi, gemm_workspace=1 << 20, alloc_limit=small)
    assert rc == 0, err
    assert steps == [
        "heuristic(epilogue,M=4096,ws<=33554432)",
        "heuristic(plain,M=4096,ws<=33554432)",
        f"alloc-failed({big})",
        "heuristic(epilogue,M=4096,ws<=0)",
        "heuristic(plain,M=4096,ws<=0)",
        f"alloc({small})",
        "launch(bias=epilogue,gemm_ws=0,splitk=1,splits=0)",
    ]
    assert rep["ws_retry"] == "1" and rep["workspace"].startswith(f"{small}@")


def test_memory_pressure_failures_name_both_attempts_and_touch_nothing(capi):
    small = workspace(capi, 1, 4096, 64, 64, 0)
    rc, steps, rep, err = core(capi, gemm_workspace=1 << 20, alloc_limit=small - 1)
    assert rc == 1 and not launch(steps) and rep["ws_retry"] == "1"
    assert f"nor {small} without cuBLASLt workspace" in err and "out of memory (fake limit" in err
    assert err.endswith("dweight and dbias were not touched")
    rc, steps, rep, err = core(capi, gemm_workspace=1 << 20, alloc_limit=small, zero_ws_missing=1)
    assert rc == 1 and "and without cuBLASLt workspace: cuBLASLt offers no" in err
    rc, steps, rep, err = core(capi, gemm_workspace=0, alloc_limit=16)  # nothing to give back
    assert rc == 1 and rep["ws_retry"] == "0" and "without cuBLASLt" not in err
    assert err.startswith("could not allocate") and len([s for s in steps if "alloc" in s]) == 1


# ------------------------------------------------------------------ the C ABI's checks
def test_rowless_call_accepts_only_beta_0_or_1(capi):
    for beta in (0.0, 1.0):
        rc, steps, _, err = core(capi, M=0, beta=beta)
        assert rc == 0, err
    rc, steps, _, err = core(capi, M=0, beta=0.5)
    assert rc == 1 and steps == [] and "M = 0 (no rows) with dweight beta 0.5" in err
    rc, _, _, err = core(capi, M=3, beta=0.5)  # with rows cuBLASLt scales dW: fine
    assert rc == 0, err


def test_pending_cuda_error_is_reported_as_not_ours_before_anything(capi):
    rc, steps, _, err = core(capi, pending_error=1)
    assert rc == 1 and steps == ["pending-error"]
    assert err.startswith("a CUDA error was already pending before paddle_mgrad's call")
    assert "cudaErrorIllegalAddress" in err and "not from this op" in err
    assert "dweight was updated" not in err and err.endswith("dweight and dbias were not touched")


@pytest.mark.parametrize("which,name", [(1, "x"), (2, "dy"), (3, "dweight"), (4, "dbias")])
def test_every_pointer_must_be_device_memory_on_the_calls_device(capi, which, name):
    rc, steps, _, err = core(capi, device=1, misplaced=which, misplaced_kind=2, misplaced_device=0)
    assert (
        rc == 1 and steps == [] and err.startswith(f"{name} is on gpu:0 but the call runs on gpu:1")
    )
    rc, steps, _, err = core(capi, device=1, misplaced=which, misplaced_kind=0)
    assert rc == 1 and err.startswith(f"{name} is host memory, not device memory on gpu:1")
    rc, steps, _, err = core(capi, device=1, misplaced=which, misplaced_kind=1)
    assert rc == 1 and err.startswith(f"{name} is pinned host memory")
    rc, _, _, err = core(capi, device=1, misplaced=which, misplaced_kind=3, misplaced_device=0)
    assert rc == 0, err  # managed memory: reachable from every device


def test_unread_pointers_are_not_checked_and_the_stream_is(capi):
    rc, _, _, err = core(capi, M=0, beta=1.0, misplaced=1, misplaced_kind=0)  # x unread at M = 0
    assert rc == 0, err
    rc, steps, _, err = core(capi, device=1, stream_elsewhere=1)  # the stream is on gpu:0
    assert (
        rc == 1
        and steps == []
        and err.startswith("the stream belongs to gpu:0 but the call runs on gpu:1")
    )


def test_cuda_13_build_refuses_volta_even_without_bias(capi):
    """docs/gpu.md, "Which GPUs the build targets": CUDA 13's cuBLASLt has no sm_70 kernels: a clear error before
    anything, with or without a bias; a CUDA 12 build runs the bias-free GEMM there."""
    for has_db in (True, False):
        rc, steps, _, err = core(capi, capability=70, has_db=has_db)
        assert (
            rc == 1
            and steps == []
            and err.startswith(
                "this GPU is sm_70 but paddle_mgrad's CUDA part was built with CUDA 13"
            )
        )
        assert "dropped Maxwell, Pascal and Volta" in err and "PADDLE_MGRAD_NO_CUDA=1" in err
    rc, steps, _, err = core(capi, capability=70, has_db=False, cuda_major=12)
    assert rc == 0, err
    rc, _, _, err = core(capi, capability=75, has_db=False)  # Turing: still in CUDA 13
    assert rc == 0, err
    rc, _, _, err = core(capi, sim=70, has_db=False)  # a simulated capability says so
    assert rc == 1 and "sm_70 (simulated)" in err


# ------------------------------------------------------------------ cache and buckets
def test_heuristic_is_asked_for_bucketed_rows_only(capi):
    rows = capi.lib.pmg_heuristic_rows
    assert [rows(m) for m in (0, 1, 7, 63, 64)] == [0, 1, 7, 63, 64]  # small: exact
    prev = 0
    for m in range(65, 70000, 37):
        r = rows(m)
        assert m <= r <= m * 1.125 and r >= prev and rows(r) == r, m  # <= 12.5 % more, stable
        prev = r
    assert rows(1000) == 1024 and rows(4096) == 4096 and rows(4097) == 4608
    rc, steps, _, _ = core(capi, M=1000)
    assert rc == 0 and steps[0] == "heuristic(epilogue,M=1024,ws<=33554432)"


def test_algorithm_cache_is_bounded_and_shared_by_a_bucket(capi):
    sim = capi.lib.pmg_algo_cache_sim
    tokens = np.random.RandomState(0).randint(1, 16385, size=5000).astype(np.int64)  # MoE routing
    out = (ctypes.c_int64 * 3)()
    sim(tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), len(tokens), 1024, out)
    distinct = len(set(tokens.tolist()))
    assert out[0] == out[1] and out[0] < 64 + 8 * 8 and distinct > 2000  # one query per bucket
    assert out[2] == 0
    sim(tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), len(tokens), 16, out)
    assert out[1] == 16 and out[2] == out[0] - 16  # bounded: least recently used evicted


# ------------------------------------------------------------------ the bias kernel
def bias_plan(capi, M, N, in_dtype="bfloat16", address=BASE, sms=132):
    out = (ctypes.c_int64 * 6)()
    capi.lib.pmg_plan_bias_kernel(M, N, DT[in_dtype], address, sms, out)
    return dict(zip(("vec", "tx", "ty", "col_blocks", "splits", "rows_per"), list(out)))


@pytest.mark.parametrize(
    "M,N", [(16384, 16), (16384, 4096), (16384, 14336), (128, 64), (10**6, 8), (300, 11008), (1, 1)]
)
def test_bias_kernel_grid(capi, M, N):
    p = bias_plan(capi, M, N)
    assert p["tx"] * p["ty"] == 256 and p["ty"] & (p["ty"] - 1) == 0  # a power-of-two tree
    assert p["vec"] == (8 if N % 8 == 0 else 1)  # 16-byte loads of 8 bf16 columns
    assert p["col_blocks"] * p["tx"] * p["vec"] >= N > (p["col_blocks"] - 1) * p["tx"] * p["vec"]
    assert (p["splits"] - 1) * p["rows_per"] < M <= p["splits"] * p["rows_per"]  # no empty slice
    assert p["rows_per"] <= 4096 and p["splits"] <= 65535
    blocks = p["col_blocks"] * p["splits"]
    if M >= 4 * p["ty"] * 4 * 132:  # rows enough: the GPU is filled ~4x (less rounding)
        assert blocks >= 0.9 * 4 * 132
    assert p["splits"] == 1 or p["rows_per"] >= max(64, 4 * p["ty"]) or M > 65535 * 4096


def test_bias_kernel_vectors_need_aligned_rows(capi):
    assert bias_plan(capi, 4096, 64, "bfloat16", BASE + 2)["vec"] == 1  # a view at +2 bytes
    assert bias_plan(capi, 4096, 66, "bfloat16")["vec"] == 1  # rows not 16-byte aligned
    assert bias_plan(capi, 4096, 64, "float32")["vec"] == 4
    assert bias_plan(capi, 4096, 64, "float64")["vec"] == 2
    assert bias_plan(capi, 4096, 64, "float16", BASE + 16)["vec"] == 8
    narrow = bias_plan(capi, 16384, 16)  # LoRA-narrow: 2 threads across, 128 row lanes
    assert (narrow["tx"], narrow["ty"], narrow["col_blocks"]) == (2, 128, 1)
    assert narrow["splits"] == 16384 // (4 * 128)


def emulate(dy32, plan):
    """The kernel's order in numpy float32: row lanes, a tree over the lanes, a cascade over the
    slices (written independently of the C++ reference)."""
    M, N = dy32.shape
    ty, rows_per, splits = plan["ty"], plan["rows_per"], plan["splits"]
    partial = np.zeros((splits, N), np.float32)
    for s in range(splits):
        m0, m1 = s * rows_per, min(M, (s + 1) * rows_per)
        lanes = np.zeros((ty, N), np.float32)
        for t in range(ty):
            for m in range(m0 + t, m1, ty):
                lanes[t] = lanes[t] + dy32[m]
        stride = ty // 2
        while stride:
            lanes[:stride] = lanes[:stride] + lanes[stride : 2 * stride]
            stride //= 2
        partial[s] = lanes[0]

    def pairwise(vals):  # balanced binary tree, left to right (binary counter)
        stack = []
        for i, v in enumerate(vals):
            c = i + 1
            while c % 2 == 0:
                v = stack.pop() + v
                c //= 2
            stack.append(v)
        acc = stack.pop()
        while stack:
            acc = stack.pop() + acc
        return acc

    return pairwise(list(partial))


def reference(capi, dy, in_dtype, address=BASE, sms=132):
    M, N = dy.shape
    return capi.bias_reference(dy.ctypes.data, in_dtype, M, N, sms, address=address)


@pytest.mark.parametrize("M,N,sms", [(1000, 24, 4), (3000, 16, 2), (257, 40, 132), (9000, 8, 1)])
def test_bias_reference_follows_the_kernels_order_to_the_bit(capi, M, N, sms):
    rs = np.random.RandomState(M)
    dy = (rs.standard_normal((M, N)) * 10 ** rs.uniform(-3, 3, (M, 1))).astype(np.float32)
    plan = bias_plan(capi, M, N, "float32", sms=sms)
    got = reference(capi, dy, "float32", sms=sms)
    want = emulate(dy, plan).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    exact = dy.astype(np.float64).sum(0)
    bound = (
        np.abs(dy).astype(np.float64).sum(0)
        * 2.0**-24
        * (np.log2(M) + plan["rows_per"] / plan["ty"] + 2)
    )
    assert (np.abs(got - exact) <= bound).all()


def test_bias_reference_bf16_and_fp64(capi):
    rs = np.random.RandomState(5)
    M, N = 5000, 48
    u = rs.standard_normal((M, N)).astype(np.float32).view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # bf16, round to nearest even
    x_bf = (bits.astype(np.uint32) << 16).view(np.float32)  # the same values in fp32
    got = reference(capi, bits, "bfloat16")
    np.testing.assert_array_equal(got, emulate(x_bf, bias_plan(capi, M, N)).astype(np.float64))
    x64 = rs.standard_normal((M, N))
    got64 = reference(capi, x64, "float64")
    np.testing.assert_allclose(got64, x64.sum(0), rtol=1e-13, atol=1e-12)
