"""Build configuration of the weight-gradient op and CUDA toolkit discovery, in one place.

Used by the Paddle JIT/AOT build (``ops/_build.py``), by ``benchmarks/gpu/bench_wgrad_gpu.py``
(a machine with CUDA + torch and no Paddle) and, through that script, by the ``cuda_compile``
CI session.  It imports nothing from Paddle (nor from ``paddle_mgrad``): the benchmark loads this
file by path with importlib.

Toolkit discovery (:func:`find_cuda`) picks ONE CUDA release for the compiler, the headers and the
libraries our module links (nvcc, ``cuda_runtime.h``/``libcudart``, ``cublasLt.h``/``libcublasLt``):

1. the toolkit named by ``$CUDA_HOME`` or ``$CUDA_PATH`` (the user's explicit choice), else
   ``nvcc`` on ``PATH`` (its ``bin/..``, or its real path's), else ``/usr/local/cuda``, else an
   nvcc shipped inside an NVIDIA pip wheel (``nvidia/*/bin/nvcc``);
2. its major version (``version.json`` / ``CUDART_VERSION`` / ``nvcc --version``) fixes the
   release: every header and library must come from the toolkit itself or from an NVIDIA pip wheel
   of the SAME major (``nvidia/<pkg>/include`` + ``nvidia/<pkg>/lib``: ``nvidia/cublas`` for
   CUDA 12's ``nvidia-cublas-cu12``, ``nvidia/cu13`` for CUDA 13's ``nvidia-cublas``).

Why the compiler decides and not Paddle's own CUDA version: NVIDIA's ``nvidia-cuda-nvcc-cu12``
wheel (checked: 12.4.131 and 12.9.86) ships ``ptxas``, libdevice and the ``crt`` headers but no
``nvcc`` binary, so a pip-only CUDA 12 toolchain does not exist; and kernels compiled by nvcc N
must be registered through a runtime of the same release (a newer nvcc's fat binaries and its
``crt`` headers against an older ``libcudart``/``cuda_runtime.h`` is not a supported mix).  Our
module therefore carries its own consistent runtime (``libcudart.so.<N>``, ``libcublasLt.so.<N>``)
even when Paddle was built with another CUDA (PyPI's paddlepaddle-gpu 2.6.2 is CUDA 11.8): the
cudaStream_t Paddle hands us is a driver stream, valid across runtimes; the driver must support N.

Wheels ship only versioned libraries (``libcublasLt.so.12``, no ``libcublasLt.so``): those are
linked by file name (``-l:libcublasLt.so.12``) and found at run time through an rpath, so the
module loads without ``LD_LIBRARY_PATH``.  A library that something else links as ``-lNAME``
(Paddle's JIT always adds ``-lcudart``) gets an unversioned symlink in a private link directory
(:meth:`CudaToolkit.link_shims`).  When something is missing, :meth:`CudaToolkit.problem` names
exactly what and how to install it, in one line.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

# ------------------------------------------------------------------- sources and flags
# framework-free CPU core + the GPU path's decisions (no CUDA in them: CPU tests reach them)
CORE_SOURCES = [
    "wgrad_cpu.cc",
    "wgrad_cpu_env.cc",
    "wgrad_bf16_scan.cc",
    "wgrad_dgemm.cc",
    "wgrad_gpu_plan.cc",
]
PADDLE_SOURCES = [
    "wgrad_op.cc",
    "wgrad_pyentry.cc",
]  # the Paddle binding (PD_BUILD_OP), its fast entry
CAPI_SOURCES = ["wgrad_capi.cc"]  # the op library's C ABI for ctypes (the cores, what ran)
# Test doubles (fake GPU, fake host), probes of the GPU path's decisions and of the bf16 scan
# kernels: compiled only into the test/benchmark library (benchmarks/gpu/pmg_gpu_bench/build.py),
# never into the op library users load.
CAPI_TEST_SOURCES = ["wgrad_capi_testing.cc"]
CUDA_SOURCES = ["wgrad_cuda.cu"]  # cuBLASLt (+ BGRADA epilogue) + bias reduction
HEADERS = [
    "wgrad_core.h",
    "wgrad_cpu_env.h",
    "wgrad_cpu_dtype.h",
    "wgrad_dgemm.h",
    "wgrad_cuda.h",
    "wgrad_gpu_plan.h",
    "wgrad_gpu_flow.h",
    "wgrad_cuda_flow.h",
    "wgrad_op.h",
    "wgrad_capi_util.h",
]

# The op library's exported C names (all of them start with ``pmg_``): the C ABI of wgrad_capi.cc
# and the Python fast entry of wgrad_pyentry.cc; a CUDA build adds EXPORTED_CUDA_C_SYMBOLS.
# tests/ops/test_exported_symbols.py reads the built library's dynamic symbol table and checks
# that its pmg_* names are exactly these, and that nothing of the test library is in it.
EXPORTED_C_SYMBOLS = (
    "pmg_cpu_bf16_path",
    "pmg_cpu_gemm_backend",
    "pmg_cpu_isa",
    "pmg_cpu_thread_scratch_bytes",
    "pmg_fast_module",
    "pmg_has_cuda",
    "pmg_wgrad_cpu_c",
)
EXPORTED_CUDA_C_SYMBOLS = (
    "pmg_cuda_stats",
    "pmg_cuda_targets",
    "pmg_wgrad_cuda_c",
    "pmg_wgrad_cuda_ex",
)

# -g0: no debug information.  Python's sysconfig puts -g into every extension's compile line; for
# this op it was a third of the compile time (Paddle's headers are large) and most of the library's
# size, and nobody steps through a JIT-built op in a debugger (a developer who wants to adds -g to
# CFLAGS: the flags are part of the cache key, so that is a separate build).  Last, so that it wins.
CXX_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-g0"]
LD_FLAGS = ["-fopenmp"]
# Code targets: sm_80 (A100) and sm_90 (H100/H200) SASS, compute_90 PTX for anything newer;
# cuda_targets() adds SASS for the GPUs of the building machine that these do not cover.
DEFAULT_TARGETS = ("sm_80", "sm_90", "compute_90")
CUDA_DEFINE = "-DPMG_WITH_CUDA"


def gencode_flags(targets) -> list:
    """``-gencode`` flags for targets such as ``sm_80`` (SASS) and ``compute_90`` (PTX)."""
    out = []
    for t in targets:
        kind, num = t.split("_", 1)
        arch = "compute_" + num
        out.append(f"-gencode=arch={arch},code={'sm_' + num if kind == 'sm' else arch}")
    return out


def nvcc_flags(targets=DEFAULT_TARGETS) -> list:
    """nvcc flags for our .cu: the targets' -gencode flags, and the targets recorded in the
    binary (``-DPMG_CUDA_TARGETS=sm_80+sm_90+compute_90``), so that the core can refuse a GPU
    they do not cover with a clear error before it writes anything."""
    return (
        ["-O3", "-std=c++17", CUDA_DEFINE]
        + gencode_flags(targets)
        + [f"-DPMG_CUDA_TARGETS={'+'.join(targets)}"]
    )


def covers(targets, capability: int) -> bool:
    """Whether code built for ``targets`` runs on a GPU of ``capability`` (major * 10 + minor):
    SASS ``sm_XY`` on the same major with minor >= Y, PTX ``compute_XY`` on any capability
    >= XY (the driver JIT-compiles it).  The C++ side's ``pmg::targets_cover`` is the same rule."""
    for t in targets:
        kind, num = t.split("_", 1)
        digits = "".join(c for c in num if c.isdigit())
        if not digits:
            continue
        v = int(digits)
        if num.endswith("a"):
            if v == capability:
                return True
        elif kind == "sm":
            if v // 10 == capability // 10 and v % 10 <= capability % 10:
                return True
        elif v <= capability:
            return True
    return False


def cuda_targets(capabilities=(), supported=None) -> tuple:
    """The targets to build: :data:`DEFAULT_TARGETS` plus native SASS (``sm_XY``) for each
    running GPU's capability that no default SASS covers (PTX alone would be JIT-compiled at
    load, or not run at all on an older GPU), when ``supported`` (the ``sm_*`` names this nvcc
    can build, None = unknown: assume yes) allows.  A GPU left uncovered gets a clear error
    from the core, before any write."""
    out = list(DEFAULT_TARGETS)
    sass = [t for t in out if t.startswith("sm_")]
    for cap in sorted(set(int(c) for c in capabilities)):
        name = f"sm_{cap}"
        if covers(sass, cap) or name in out:
            continue
        if supported is not None and name not in supported:
            continue
        out.append(name)
    return tuple(out)


NVCC_ARCH = gencode_flags(DEFAULT_TARGETS)
NVCC_FLAGS = nvcc_flags()
ONEDNN_DEFINE = "-DPMG_WITH_ONEDNN"
# The only CUDA library our code calls (cuBLAS proper is not used).  libcudart is linked by
# Paddle's JIT (-lcudart) or, in the benchmark, by nvcc itself (static cudart).
CUDA_LIBS = ["cublasLt"]


def csrc_dir() -> str:
    """``csrc/`` of a source checkout, or ``paddle_mgrad/_csrc`` of an installed package."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shipped = os.path.join(pkg, "_csrc")
    if os.path.isdir(shipped):
        return shipped
    return os.path.join(os.path.dirname(pkg), "csrc")


# ------------------------------------------------------------------- toolkit discovery
def _pip_hint(component: str, major) -> str:
    """How to install one missing CUDA component (NVIDIA's wheel names differ per major)."""
    if component == "nvcc":
        return (
            "install the CUDA toolkit (nvcc) and set CUDA_HOME to it (NVIDIA's "
            "nvidia-cuda-nvcc-cu12 wheel has no nvcc binary)"
        )
    pkg = {"cublasLt": "cublas", "cudart": "cuda-runtime", "thrust": "cuda-cccl"}[component]
    if major is None:
        return f"install the CUDA toolkit's {component}"
    if major >= 13:
        return f'pip install "nvidia-{pkg}>={major},<{major + 1}"'
    return f"pip install nvidia-{pkg}-cu{major}"


def _lib_major(path: str):
    m = re.search(r"\.so\.(\d+)", os.path.basename(path))
    return int(m.group(1)) if m else None


def site_dirs():
    """Where NVIDIA's pip wheels may live: every sys.path entry (venv site-packages first)."""
    return [p for p in sys.path if p and os.path.isdir(p)]


def _wheel_roots(search_paths):
    roots = []
    for base in search_paths:
        roots += sorted(d for d in glob.glob(os.path.join(base, "nvidia", "*")) if os.path.isdir(d))
    return roots


def _toolkit_lib_dirs(home):
    return [
        d
        for d in (os.path.join(home, s) for s in ("lib64", "lib", "targets/x86_64-linux/lib"))
        if os.path.isdir(d)
    ]


def toolkit_version(home, nvcc=None, run=subprocess.run):
    """(major, minor) of the toolkit at ``home``: version.json, CUDART_VERSION, nvcc --version."""
    try:
        with open(os.path.join(home, "version.json")) as f:
            v = json.load(f)["cuda"]["version"].split(".")
            return int(v[0]), int(v[1])
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        with open(os.path.join(home, "include", "cuda_runtime_api.h")) as f:
            m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", f.read())
        if m:
            v = int(m.group(1))
            return v // 1000, (v % 1000) // 10
    except OSError:
        pass
    if nvcc:
        try:
            out = run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
            m = re.search(r"release (\d+)\.(\d+)", out or "")
            if m:
                return int(m.group(1)), int(m.group(2))
        except (OSError, subprocess.SubprocessError):
            pass
    return None


class CudaToolkit:
    """What :func:`find_cuda` found: one CUDA release, or what is missing."""

    def __init__(self):
        self.home = None  # CUDA_HOME for nvcc / Paddle's JIT (``home/bin/nvcc``)
        self.nvcc = None
        self.version = None  # (major, minor)
        self.include_dirs = []  # beyond home/include: wheels' include, cccl
        self.libs = {}  # component -> library file (e.g. cublasLt -> .../libcublasLt.so.13)
        self.missing = []  # one entry per missing component: "what (how to install)"
        self.source = {}  # component -> where it came from (for logs)

    @property
    def major(self):
        return self.version[0] if self.version else None

    @property
    def ok(self) -> bool:
        return not self.missing

    def problem(self) -> str:
        """One line naming exactly what is missing and how to install it ('' when complete)."""
        if not self.missing:
            return ""
        where = (
            f"CUDA {self.version[0]}.{self.version[1]} at {self.home}"
            if self.version and self.home
            else "no CUDA toolkit"
        )
        return f"{where}: missing " + "; ".join(self.missing)

    def lib_dirs(self):
        return list(dict.fromkeys(os.path.dirname(p) for p in self.libs.values()))

    def _link_name(self, comp):
        path = self.libs[comp]
        unversioned = os.path.join(os.path.dirname(path), f"lib{comp}.so")
        if os.path.exists(unversioned):
            return f"-l{comp}"
        return f"-l:{os.path.basename(path)}"  # wheels: versioned file only

    def link_args(self, components=CUDA_LIBS):
        """g++/ld flags: -L, -l (by file name for versioned-only libraries) and rpaths."""
        dirs = list(dict.fromkeys(os.path.dirname(self.libs[c]) for c in components))
        return (
            [f"-L{d}" for d in dirs]
            + [self._link_name(c) for c in components]
            + [f"-Wl,-rpath,{d}" for d in dirs]
        )

    def nvcc_link_args(self, components=CUDA_LIBS):
        """The same for an nvcc link line (nvcc rejects a bare ``-l:``; pass it to the linker)."""
        dirs = list(dict.fromkeys(os.path.dirname(self.libs[c]) for c in components))
        names = [self._link_name(c) for c in components]
        return (
            [f"-L{d}" for d in dirs]
            + [n if not n.startswith("-l:") else f"-Xlinker={n}" for n in names]
            + [f"-Xlinker=-rpath,{d}" for d in dirs]
        )

    def link_shims(self, components=("cudart",)):
        """{unversioned name: real file} for libraries that others link as ``-lNAME`` but that
        exist only versioned (wheels); create them as symlinks in a private ``-L`` directory."""
        out = {}
        for c in components:
            path = self.libs.get(c)
            if path and not os.path.exists(os.path.join(os.path.dirname(path), f"lib{c}.so")):
                out[f"lib{c}.so"] = path
        return out

    def supported_codes(self, run=subprocess.run):
        """The ``sm_*`` targets this nvcc can build (``nvcc --list-gpu-code``); None if unknown."""
        if not self.nvcc:
            return None
        if not hasattr(self, "_codes"):
            try:
                out = (
                    run(
                        [self.nvcc, "--list-gpu-code"], capture_output=True, text=True, timeout=60
                    ).stdout
                    or ""
                )
                self._codes = frozenset(re.findall(r"\bsm_\w+", out)) or None
            except (OSError, subprocess.SubprocessError):
                self._codes = None
        return self._codes

    def summary(self) -> str:
        if not self.ok:
            return self.problem()
        v = f"{self.version[0]}.{self.version[1]}" if self.version else "?"
        parts = ", ".join(f"{c} from {self.source[c]}" for c in sorted(self.source))
        return f"CUDA {v} (nvcc {self.nvcc}; {parts})"


def _find_header_lib(comp, header, lib_glob, home, major, roots):
    """(include_dir, lib_file, where, mismatch) from the toolkit or a same-major wheel."""
    mismatch = []
    inc = os.path.join(home, "include")
    if os.path.exists(os.path.join(inc, header)):
        for d in _toolkit_lib_dirs(home):
            libs = sorted(glob.glob(os.path.join(d, lib_glob)))
            if libs:
                return inc, libs[0], home, mismatch
    for root in roots:
        inc, lib = os.path.join(root, "include"), os.path.join(root, "lib")
        libs = sorted(glob.glob(os.path.join(lib, lib_glob)))
        if not (os.path.exists(os.path.join(inc, header)) and libs):
            continue
        lib_major = _lib_major(libs[-1])
        if major is not None and lib_major is not None and lib_major != major:
            mismatch.append(f"CUDA {lib_major}'s in {root}")
            continue
        # prefer the versioned file with the shortest name (libcublasLt.so.13 over .so.13.1.0.3)
        return inc, min(libs, key=len), root, mismatch
    return None, None, None, mismatch


def find_cuda(
    search_paths=None,
    environ=None,
    which=shutil.which,
    need_thrust=False,
    run=subprocess.run,
    default_home="/usr/local/cuda",
) -> CudaToolkit:
    """Find one consistent CUDA release for building the CUDA part (see the module docstring).

    ``need_thrust``: the host compiler needs ``thrust/complex.h`` (Paddle 2.6's
    ``paddle/extension.h`` under ``PADDLE_WITH_CUDA``).  Never raises; see ``.missing``.
    """
    environ = os.environ if environ is None else environ
    search_paths = site_dirs() if search_paths is None else search_paths
    roots = _wheel_roots(search_paths)
    tk = CudaToolkit()

    def is_toolkit(home):
        inc = os.path.join(home or "", "include")
        return (
            bool(home)
            and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK)
            and (
                os.path.exists(os.path.join(inc, "cuda_runtime_api.h"))
                or os.path.exists(os.path.join(inc, "crt", "host_config.h"))
            )
        )

    explicit = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if explicit:
        if not is_toolkit(explicit):
            tk.missing.append(
                f"nvcc: CUDA_HOME/CUDA_PATH={explicit} has no bin/nvcc and CUDA headers "
                f"({_pip_hint('nvcc', None)})"
            )
            return tk
        tk.home = explicit
    else:
        cands = []
        found = which("nvcc")
        if found:
            cands += [
                os.path.dirname(os.path.dirname(found)),
                os.path.dirname(os.path.dirname(os.path.realpath(found))),
            ]
        cands.append(default_home)
        cands += roots  # a wheel that ships nvcc (nvidia/*/bin/nvcc), if any ever does
        tk.home = next((c for c in dict.fromkeys(cands) if is_toolkit(c)), None)
        if tk.home is None:
            tk.missing.append(f"nvcc ({_pip_hint('nvcc', None)})")
            return tk
    tk.nvcc = os.path.join(tk.home, "bin", "nvcc")
    tk.version = toolkit_version(tk.home, tk.nvcc, run=run)
    major = tk.major
    for comp, header, lib_glob in (
        ("cudart", "cuda_runtime.h", "libcudart.so*"),
        ("cublasLt", "cublasLt.h", "libcublasLt.so*"),
    ):
        inc, lib, where, mismatch = _find_header_lib(comp, header, lib_glob, tk.home, major, roots)
        if lib is None:
            what = f"{comp} ({header}, lib{comp}.so) for CUDA {major}"
            if mismatch:
                what += f" (found only {', '.join(mismatch)}, but nvcc is CUDA {major})"
            tk.missing.append(f"{what}: {_pip_hint(comp, major)}")
            continue
        tk.libs[comp] = lib
        tk.source[comp] = where
        if inc != os.path.join(tk.home, "include"):
            tk.include_dirs.append(inc)
    if need_thrust:
        incs = [os.path.join(tk.home, "include")] + [os.path.join(r, "include") for r in roots]
        hit = None
        for inc in incs:
            for d in (inc, os.path.join(inc, "cccl")):  # CUDA 13 moved thrust to include/cccl
                if os.path.exists(os.path.join(d, "thrust", "complex.h")):
                    hit = hit or d
        if hit is None:
            tk.missing.append(
                f"thrust (thrust/complex.h, needed by Paddle's headers): "
                f"{_pip_hint('thrust', major)}"
            )
        else:
            tk.source["thrust"] = hit
            if hit != os.path.join(tk.home, "include"):
                tk.include_dirs.append(hit)
    tk.include_dirs = list(dict.fromkeys(tk.include_dirs))
    return tk
