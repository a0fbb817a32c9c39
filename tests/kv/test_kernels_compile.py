"""Every kernels/*.cu compiles for sm_90 with nvcc, without register spills (skipped without nvcc).

``nvcc -arch=sm_90 -cubin -Xptxas -v`` per source; the test fails on a compile error or on any
function whose ptxas report shows spill stores or spill loads, and prints the register report
(run with ``-s`` to see it). A second test compiles the source the way the CuPy path does (NVRTC,
``-DPREFIXKV_NO_INSTANTIATIONS`` plus name expressions) when an NVRTC library can be found.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefixkv.kv import cuda_kernels as ck

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")


def parse_ptxas(report: str) -> list[dict]:
    """One entry per compiled entry function: name, registers, stack, spill stores/loads, smem."""
    funcs: list[dict] = []
    cur = None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = dict(name=m.group(1), registers=None, stack=0, spill_stores=0, spill_loads=0, smem=0)
            funcs.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = (int(g) for g in m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return funcs


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if not tool:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def test_ptxas_report_parser():
    report = """ptxas info    : Compiling entry function '_Z1kPf' for 'sm_90'
ptxas info    : Function properties for _Z1kPf
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 16 bytes cumulative stack size, 34912 bytes smem"""
    (f,) = parse_ptxas(report)
    assert f == dict(name="_Z1kPf", registers=255, stack=16, spill_stores=8, spill_loads=4, smem=34912)


def test_there_are_kernel_sources():
    assert SOURCES, f"no .cu files in {KERNEL_DIR}"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH (CUDA toolkit absent): kernels not compiled")
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_nvcc_compiles_without_spills(source, tmp_path):
    cmd = [NVCC, "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / (source.stem + ".cubin")), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"nvcc failed:\n{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    funcs = parse_ptxas(proc.stdout + proc.stderr)
    assert funcs, "ptxas reported no entry function (are the templates instantiated?)"
    pretty = demangle([f["name"] for f in funcs])
    rows = sorted(zip(pretty, funcs))
    print(f"\n{source.name}: nvcc -arch=sm_90 register report ({len(funcs)} kernels)")
    print(f"{'kernel':<72} {'regs':>4} {'stack':>5} {'spill st':>8} {'spill ld':>8} {'smem':>6}")
    for name, f in rows:
        short = re.sub(r"\(.*\)$", "", name).replace("void ", "").replace("prefixkv::", "")
        print(f"{short:<72} {f['registers']:>4} {f['stack']:>5} {f['spill_stores']:>8} {f['spill_loads']:>8} "
              f"{f['smem']:>6}")
    spills = [(n, f) for n, f in rows if f["spill_stores"] or f["spill_loads"]]
    assert not spills, "register spills: " + "; ".join(
        f"{n}: {f['spill_stores']} B stores, {f['spill_loads']} B loads" for n, f in spills)
    if source.name == ck.SOURCE:
        compiled = {re.sub(r"^void |\(.*\)$", "", n).replace(" ", "") for n in pretty}
        wanted = {n.replace(" ", "") for n in ck.all_kernel_names()}
        if not all("<" in n for n in compiled):
            return  # no demangler: the names cannot be compared
        missing = wanted - compiled
        assert not missing, f"kernels the Python side launches but the .cu does not instantiate: {sorted(missing)}"


# -- NVRTC, the compiler CuPy uses --------------------------------------------------------------
def _find_nvrtc() -> str | None:
    candidates = []
    name = ctypes.util.find_library("nvrtc")
    if name:
        candidates.append(name)
    for root in [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]:
        if root:
            candidates += sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")), reverse=True)
    for entry in sys.path:
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")),
                             reverse=True)
        candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "cu*", "lib", "libnvrtc.so*")), reverse=True)
    for c in candidates:
        try:
            ctypes.CDLL(c)
        except OSError:
            continue
        # libnvrtc dlopens its builtins by soname: preload the ones beside it (wheels are not on the
        # loader's path).
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(c), "libnvrtc-builtins.so*"))):
            try:
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
        return c
    return None


def _cuda_include_dirs() -> list[str]:
    dirs = []
    for root in [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h")):
            dirs.append(os.path.join(root, "include"))
    for entry in sys.path:
        dirs += glob.glob(os.path.join(entry, "nvidia", "cuda_runtime", "include"))
    return dirs


NVRTC = _find_nvrtc()


@pytest.mark.skipif(NVRTC is None, reason="no NVRTC library found (CUDA toolkit or nvidia-cuda-nvrtc wheel)")
def test_nvrtc_compiles_the_name_expressions():
    lib = ctypes.CDLL(NVRTC)
    source = (KERNEL_DIR / ck.SOURCE).read_bytes()
    names = [ck.attention_kernel_name("bfloat16", 128, 16, 4), ck.attention_kernel_name("float16", 64, 8, 8),
             ck.reduce_kernel_name("bfloat16", 128)]
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"paged_attention.cu", 0, None, None) == 0
    for n in names:
        assert lib.nvrtcAddNameExpression(prog, n.encode()) == 0
    opts = [b"-DPREFIXKV_NO_INSTANTIATIONS", b"--gpu-architecture=compute_90"]
    opts += [f"-I{d}".encode() for d in _cuda_include_dirs()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, f"NVRTC failed:\n{log.value.decode(errors='replace')}"
    for n in names:
        lowered = ctypes.c_char_p()
        assert lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(lowered)) == 0
        assert lowered.value and lowered.value.startswith(b"_Z")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
