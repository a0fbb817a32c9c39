"""Run the project's CUDA C sources (kernels/*.cu) on the CPU.

``build(source, names)`` compiles a kernel source with the host C++ compiler against the shim headers
in ``include/`` (force-included prelude ``cuda_emu_prelude.h``, stand-ins for ``cuda_fp16.h`` and
``cuda_bf16.h``) and the fiber runtime ``runtime.cpp``, into a shared library cached under the temp
directory by a hash of everything that goes into it. Each kernel name expression (as given to NVRTC)
gets an ``extern "C"`` launcher; ``EmuModule.launch(name, grid, block, args)`` runs it over the grid
like ``cuLaunchKernel``, with numpy arrays for device pointers and numpy scalars for values.

The function-local statics that ``__shared__`` becomes are moved (objcopy) into one ELF section,
``emu_shared``, which the runtime fills with 0xFF bytes (NaN) before each block.

``emulated_paged_attention`` runs ``prefixkv.kv.cuda_kernels``' own plans (same kernels, grids and
argument lists as the CuPy path) on numpy inputs; bf16 arrays are uint16 bit patterns.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
RUNTIME = HERE / "runtime.cpp"
CXX = os.environ.get("CXX", "g++")
# -fno-ipa-reference-addressable: a never-written static (a __shared__ array read before any write)
# must be read from memory, not folded to zero.
CXXFLAGS = ["-std=c++17", "-fPIC", "-fno-strict-aliasing", "-Wno-unknown-pragmas", "-fno-omit-frame-pointer",
            "-fno-ipa-reference-addressable"]


class EmulationError(RuntimeError):
    """A launch the emulator refused or aborted (deadlock, bad warp intrinsic use, bad config)."""


def available() -> str | None:
    """None when the emulator can build here, else the reason it cannot."""
    for tool in (CXX, "objcopy", "readelf"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


def cache_root() -> Path:
    return Path(os.environ.get("PREFIXKV_EMU_CACHE", Path(tempfile.gettempdir()) / "prefixkv-cuda-emu"))


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _compiler_id() -> str:
    try:
        return subprocess.run([CXX, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    except Exception:  # pragma: no cover
        return CXX


def _run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise EmulationError(f"command failed: {' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr}")
    return proc


class EmuModule:
    _launch_lock = threading.Lock()

    def __init__(self, lib_path: Path, names: list[str]):
        self.path = lib_path
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.symbols = {name: f"emu_k{i}" for i, name in enumerate(names)}
        self._fns = {}

    def set_schedule(self, mode: str = "forward", seed: int = 0) -> None:
        """Order in which the scheduler resumes a block's threads: forward, reverse or random."""
        self.lib.emu_set_schedule(ctypes.c_int({"forward": 0, "reverse": 1, "random": 2}[mode]),
                                  ctypes.c_uint(seed))

    def launch(self, name: str, grid, block, args) -> None:
        if name not in self.symbols:
            raise KeyError(f"{name} was not built into this emulated module")
        fn = self._fns.get(name)
        if fn is None:
            fn = getattr(self.lib, self.symbols[name])
            fn.restype = ctypes.c_int
            self._fns[name] = fn
        keep = []
        for a in args:
            if isinstance(a, np.ndarray):
                if not a.flags["C_CONTIGUOUS"]:
                    raise ValueError("emulated kernels take contiguous arrays")
                keep.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, (np.int32, int)) and not isinstance(a, bool):
                keep.append(ctypes.c_int32(int(a)))
            elif isinstance(a, np.float32):
                keep.append(ctypes.c_float(float(a)))
            elif isinstance(a, np.int64):
                keep.append(ctypes.c_int64(int(a)))
            else:
                raise TypeError(f"unsupported kernel argument {type(a).__name__}")
        argv = (ctypes.c_void_p * max(len(keep), 1))(*[ctypes.cast(ctypes.pointer(k), ctypes.c_void_p) for k in keep])
        g = (ctypes.c_uint * 3)(*[int(x) for x in (tuple(grid) + (1, 1))[:3]])
        b = (ctypes.c_uint * 3)(*[int(x) for x in (tuple(block) + (1, 1))[:3]])
        with self._launch_lock:
            rc = fn(g, b, argv)
            if rc:
                raise EmulationError(f"{name}: {self.lib.emu_last_error().decode()}")


_build_lock = threading.Lock()


def build(source: str | Path, names: list[str], *, defines: tuple[str, ...] = (), opt: str = "-O1",
          cache: Path | None = None) -> EmuModule:
    """Compile ``source`` (a path, or CUDA C text) with launchers for the kernel ``names``."""
    if isinstance(source, Path):
        text, src_path = source.read_text(), source
    else:
        text, src_path = source, None
    shim_text = "".join(p.read_text() for p in sorted(INCLUDE.glob("*.h")))
    key = _digest(text, names, defines, opt, RUNTIME.read_text(), shim_text, Path(__file__).read_text(), CXXFLAGS,
                  _compiler_id())
    root = cache or cache_root()
    out_dir = root / key
    lib = out_dir / "kernels.so"
    with _build_lock:
        if lib.exists():
            return EmuModule(lib, names)
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="build-", dir=root))   # same filesystem: the rename is atomic
        try:
            if src_path is None:
                src_path = work / "kernel.cu"
                src_path.write_text(text)
            lines = [f'#include "{src_path}"',
                     'extern "C" char __start_emu_shared[];',
                     'extern "C" char __stop_emu_shared[];',
                     # a function-local static like every __shared__ one: renamed into emu_shared with them,
                     # so the section exists (and is one NOBITS section) even without __shared__ variables
                     'extern "C" char* emu_shared_anchor() { static char anchor[16]; return anchor; }']
            for i, name in enumerate(names):
                lines.append(f'extern "C" int emu_k{i}(const unsigned* g, const unsigned* b, void** a) '
                             f'{{ return ::emu::launch_kernel(&{name}, g, b, a, __start_emu_shared, '
                             f'__stop_emu_shared); }}')
            (work / "wrapper.cpp").write_text("\n".join(lines) + "\n")
            inc = [f"-I{INCLUDE}", "-include", "cuda_emu_prelude.h"]
            _run([CXX, *CXXFLAGS, opt, "-fdata-sections", *inc, *[f"-D{d}" for d in defines],
                  "-c", "wrapper.cpp", "-o", "kernels.o"], work)
            sections = _run(["readelf", "-SW", "kernels.o"], work).stdout
            renames = []
            for sec in sorted(set(re.findall(r"\s(\.bss\._ZZ\S+)", sections))):
                renames += ["--rename-section", f"{sec}=emu_shared"]
            if renames:
                _run(["objcopy", *renames, "kernels.o", "kernels_shared.o"], work)
            else:
                shutil.copy(work / "kernels.o", work / "kernels_shared.o")
            _run([CXX, *CXXFLAGS, "-O2", f"-I{INCLUDE}", "-c", str(RUNTIME), "-o", "runtime.o"], work)
            _run([CXX, "-shared", "kernels_shared.o", "runtime.o", "-o", "kernels.so"], work)
            try:
                os.replace(work, out_dir)
            except OSError:  # another process got there first
                shutil.rmtree(work, ignore_errors=True)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return EmuModule(lib, names)


# -- bf16 / fp16 helpers ---------------------------------------------------------------------------
def to_bf16_bits(x) -> np.ndarray:
    """float -> bf16 bit patterns (uint16), round to nearest even, NaN kept NaN."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def from_bf16_bits(b) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_device_dtype(x, dtype: str) -> np.ndarray:
    return to_bf16_bits(x) if dtype == "bfloat16" else np.ascontiguousarray(x, dtype=np.float16)


def to_float(x, dtype: str) -> np.ndarray:
    return from_bf16_bits(x) if dtype == "bfloat16" else np.asarray(x, dtype=np.float32)


# -- paged attention through the emulator ------------------------------------------------------
def emulated_paged_attention(module: EmuModule, query, k_pool, v_pool, block_tables, seq_lens, scale,
                             query_start_loc=None, return_lse=False, *, dtype: str, out=None, lse=None,
                             num_splits=None, rows=None, poison=True):
    """``prefixkv.kv.cuda_kernels.paged_attention_cuda`` with the emulated kernels, on numpy arrays."""
    from prefixkv.kv import cuda_kernels as ck

    dims = ck.check_inputs(query, k_pool, v_pool, block_tables, seq_lens, query_start_loc, dtype=dtype)
    plan = ck.plan_attention(dims, num_splits=num_splits, rows=rows)
    storage = query.dtype

    def alloc(shape, kind):
        dt = storage if kind == "query" else np.float32
        if poison:
            fill = 0xFFFF if dt == np.uint16 else np.nan
            return np.full(shape, fill, dtype=dt)
        return np.empty(shape, dtype=dt)

    if poison:
        if out is not None:
            out.fill(0xFFFF if out.dtype == np.uint16 else np.nan)
        if lse is not None:
            lse.fill(np.nan)
    return ck.run_plan(plan, module.launch, alloc, query=query, k_pool=k_pool, v_pool=v_pool,
                       block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc, scale=scale,
                       return_lse=return_lse, out=out, lse=lse), plan
