"""The op library users load exports exactly the C names build_config lists, and nothing of the
test library: its dynamic symbol table is read from the ELF file (no tool needed; ``nm -D``,
where installed, must agree)."""

import ctypes
import shutil
import struct
import subprocess

import pytest

from helpers import require_cpp_op
from paddle_mgrad.ops import _build, build_config as bc

# Names that only test doubles carry (the fake GPU/host, the test C ABI's helpers).
TEST_ONLY = ("fake", "pmg_capi", "testing")


def exported_symbols(path):
    """The defined global/weak symbols of the ELF64 little-endian shared library ``path``'s
    dynamic symbol table (``.dynsym``), as ``nm -D --defined-only`` lists them."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not an ELF64 LE file"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    out = set()
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        strtab = sections[link]
        str_off = strtab[4]
        for i in range(1, size // entsize):
            st_name, st_info, st_other, st_shndx = struct.unpack_from(
                "<IBBH", data, offset + i * entsize
            )
            bind, visibility = st_info >> 4, st_other & 3
            if (
                st_shndx == 0 or bind not in (1, 2, 10) or visibility in (1, 2)
            ):  # undefined, local, hidden
                continue
            end = data.index(b"\0", str_off + st_name)
            out.add(data[str_off + st_name : end].decode())
    return out


def _nm(path):
    nm = shutil.which("nm")
    if nm is None:
        return None
    r = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    return {ln.split()[-1] for ln in r.stdout.splitlines() if ln.strip()}


def problems(path, cuda):
    """Why the library at ``path`` is not the op library users should load ([] when it is)."""
    names = exported_symbols(path)
    want = set(bc.EXPORTED_C_SYMBOLS) | (set(bc.EXPORTED_CUDA_C_SYMBOLS) if cuda else set())
    ours = {n for n in names if n.startswith("pmg_")}
    out = []
    if ours - want:
        out.append(f"unlisted pmg_ names exported: {sorted(ours - want)}")
    if want - ours:
        out.append(f"listed names not exported: {sorted(want - ours)}")
    test_only = sorted(n for n in names if any(t in n.lower() for t in TEST_ONLY))
    if test_only:
        out.append(f"test-only symbols exported: {test_only}")
    return out


def test_op_library_exports_exactly_the_listed_c_names_and_no_test_double():
    path = _build.library_path(require_cpp_op())
    cuda = bool(ctypes.CDLL(path).pmg_has_cuda())
    assert problems(path, cuda) == []
    nm = _nm(path)
    if nm is not None:  # the reader above agrees with binutils
        assert {n for n in nm if n.startswith("pmg_")} == {
            n for n in exported_symbols(path) if n.startswith("pmg_")
        }


@pytest.mark.probe
def test_the_check_sees_the_test_library_for_what_it_is(capi):
    """The test library (the op library's C ABI plus wgrad_capi_testing.cc) fails the same
    check: the fakes and the probes are found, by name."""
    found = problems(capi.path, cuda=False)
    assert any("pmg_fake_gpu_flow_ex" in p and "pmg_choose_bias" in p for p in found), found
    assert any(p.startswith("test-only symbols") and "pmg_fake_cuda_core" in p for p in found), (
        found
    )
    assert set(bc.EXPORTED_C_SYMBOLS) - {"pmg_fast_module"} <= exported_symbols(capi.path)


@pytest.mark.parametrize(
    "name",
    ["pmg_fake_gpu_flow", "pmg_fake_cuda_core", "pmg_choose_bias", "pmg_bf16_min_nonzero_bits_c"],
)
def test_test_hooks_are_not_reachable_in_the_op_library(name):
    with pytest.raises(AttributeError):
        getattr(ctypes.CDLL(_build.library_path(require_cpp_op())), name)
