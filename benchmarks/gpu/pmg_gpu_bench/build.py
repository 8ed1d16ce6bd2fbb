"""Building the test/benchmark library with the Paddle build's flags and toolkit discovery.

The library is the framework-free core with both C ABIs: the op library's (``wgrad_capi.cc``)
and the test-only one (``wgrad_capi_testing.cc``: fake GPU, fake host, probes of the GPU path's
decisions).  The op library users load is built by ``paddle_mgrad/ops/_build.py`` without the
test-only one."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time

from .capi import Core, CoreError

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.normpath(os.path.join(HERE, "..", "..", "..", "csrc"))


def _load_build_config():
    """paddle_mgrad/ops/build_config.py by file path (it imports nothing from Paddle; the package's
    __init__ does): the same flags, sources and toolkit discovery as the Paddle build."""
    path = os.path.normpath(
        os.path.join(HERE, "..", "..", "..", "paddle_mgrad", "ops", "build_config.py")
    )
    spec = importlib.util.spec_from_file_location("pmg_build_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bc = _load_build_config()
NVCC_ARCH = bc.NVCC_ARCH


def toolkit(need_thrust=False):
    """The CUDA toolkit (nvcc, headers, cuBLASLt) as build_config finds it for the Paddle build."""
    return bc.find_cuda(need_thrust=need_thrust)


def cuda_include_dirs(tk=None):
    """Directories holding cuda_runtime.h and cublasLt.h (toolkit or pip wheels)."""
    tk = tk or toolkit()
    return ([os.path.join(tk.home, "include")] if tk.home else []) + list(tk.include_dirs)


def cublas_lib_dirs(tk=None):
    tk = tk or toolkit()
    return [os.path.dirname(tk.libs["cublasLt"])] if "cublasLt" in tk.libs else []


def _require(tk):
    if not tk.ok:
        raise RuntimeError(f"CUDA toolkit incomplete: {tk.problem()}")
    return tk


def check_paddle_binding(paddle_include, python_include):
    """Syntax-check the Paddle binding's GPU branch (PADDLE_WITH_CUDA + PMG_WITH_CUDA) against a
    Paddle wheel's headers; a CPU wheel suffices (Paddle 2.6's: 3.x's CUDA headers want ATen)."""
    tk = _require(toolkit(need_thrust=True))  # Paddle 2.6's extension.h includes thrust
    incs = [paddle_include, os.path.join(paddle_include, "third_party"), python_include, CSRC]
    incs += cuda_include_dirs(tk)
    cmd = [
        "g++",
        "-fsyntax-only",
        "-Wall",
        *bc.CXX_FLAGS[1:2],
        "-DPADDLE_WITH_CUDA",
        bc.CUDA_DEFINE,
        *[f"-I{d}" for d in incs if os.path.isdir(d)],
        os.path.join(CSRC, "wgrad_op.cc"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(" ".join(cmd), "\n", r.stdout, r.stderr[-6000:])
        raise RuntimeError("the Paddle binding's CUDA branch does not compile")
    print("checked wgrad_op.cc (CUDA branch) against", paddle_include, flush=True)


def compile_only(build_dir):
    """Compile (no link) the CUDA core and the C API with the shipped flags, then link the whole
    library as the GPU run does, load it and call its CUDA entry point with empty shapes: without
    a GPU it must fail cleanly, naming the call."""
    os.makedirs(build_dir, exist_ok=True)
    tk = _require(toolkit())
    print(f"toolkit: {tk.summary()}", flush=True)
    incs = [f"-I{d}" for d in tk.include_dirs]
    for src in bc.CUDA_SOURCES + bc.CAPI_SOURCES + bc.CAPI_TEST_SOURCES + bc.CORE_SOURCES:
        cmd = [
            tk.nvcc,
            "-c",
            "-x",
            "cu" if src.endswith(".cu") else "c++",
            *bc.NVCC_FLAGS,
            "-Xcompiler",
            "-fPIC,-Wall,-fopenmp",
            f"-I{CSRC}",
            *incs,
            os.path.join(CSRC, src),
            "-o",
            os.path.join(build_dir, src + ".o"),
        ]
        if not src.endswith(".cu"):
            cmd = [c for c in cmd if not c.startswith("-gencode")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0 or "warning" in (r.stderr or "").lower():
            print(" ".join(cmd), "\n", r.stdout, r.stderr)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed on {src}")
        print(f"compiled {src}", flush=True)
    if tk.libs.get("cublasLt"):
        core = Core(build(build_dir, cuda=True), cuda=True)
        print(f"linked and loaded; targets {core.targets()}", flush=True)
        try:
            core.gpu_ex(
                None,
                None,
                "bfloat16",
                0,
                0,
                0,
                None,
                "float32",
                1.0,
                None,
                "float32",
                1.0,
                device=0,
                stream=None,
            )
            print("CUDA call without a GPU returned success (a GPU is present?)", flush=True)
        except CoreError as e:
            print(f"CUDA call without a GPU failed cleanly: {e}", flush=True)
            if "cuda" not in str(e).lower():
                raise RuntimeError(f"unexpected error text from the CUDA core: {e}") from e


TEST_SOURCES = bc.CORE_SOURCES + bc.CAPI_SOURCES + bc.CAPI_TEST_SOURCES


def _cpu_command(srcs, out):
    return ["g++", *bc.CXX_FLAGS, "-fPIC", "-shared", f"-I{CSRC}", *srcs, "-o", out]


def build(build_dir, cuda=True, targets=None):
    """Build the test/benchmark library: CPU core + decisions + both C ABIs (g++), or with the
    CUDA core (nvcc, ``targets`` default: build_config's)."""
    os.makedirs(build_dir, exist_ok=True)
    out = os.path.join(build_dir, "libpmg_wgrad_cuda.so" if cuda else "libpmg_wgrad_cpu.so")
    srcs = [os.path.join(CSRC, f) for f in TEST_SOURCES]
    if not cuda:
        cmd = _cpu_command(srcs, out)
    else:
        tk = _require(toolkit())
        flags = bc.nvcc_flags(tuple(targets)) if targets else bc.NVCC_FLAGS
        # the CXX flags go to the host compiler (-fopenmp etc.); cudart is linked statically by
        # nvcc; cuBLASLt by file name when only libcublasLt.so.<major> exists (wheels), + rpath
        # --threads=0: nvcc compiles the targets in parallel (the build is most of a run's setup)
        cmd = [
            tk.nvcc,
            *flags,
            "--threads=0",
            "-shared",
            "-Xcompiler",
            ",".join(["-fPIC"] + bc.CXX_FLAGS[2:]),
            f"-I{CSRC}",
            *[f"-I{d}" for d in tk.include_dirs],
            *[os.path.join(CSRC, f) for f in bc.CUDA_SOURCES],
            *srcs,
            *tk.nvcc_link_args(),
            "-lgomp",
            "-o",
            out,
        ]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("build failed:\n" + " ".join(cmd) + "\n" + r.stdout + r.stderr)
    print(f"built {out} in {time.time() - t0:.1f} s", flush=True)
    return out


def cpu_library_key() -> str:
    """What the CPU test library's binary depends on: the compile line, the compiler's version,
    the sources and headers."""
    h = hashlib.sha256(" ".join(_cpu_command(TEST_SOURCES, "out")).encode())
    try:
        h.update(
            subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.encode()
        )
    except OSError:
        pass
    for name in sorted(set(TEST_SOURCES + bc.HEADERS)):
        path = os.path.join(CSRC, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


def cached_cpu_library(root) -> str:
    """The CPU test library in ``root/capi-test-<key>/`` (:func:`cpu_library_key`), built there
    once: compiled in a private directory and renamed into place, so a reader never sees a
    partial one."""
    final = os.path.join(root, f"capi-test-{cpu_library_key()}")
    lib = os.path.join(final, "libpmg_wgrad_cpu.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(root, mode=0o700, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".capi-test-", dir=root)
    try:
        build(tmp, cuda=False)
        try:
            os.rename(tmp, final)
        except OSError:  # another process published it first
            if not os.path.exists(lib):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return lib
