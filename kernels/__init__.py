"""CUDA C sources for prefixkv's CuPy raw kernels, shipped as package data.

``source_path(name)`` finds a ``.cu`` file of this folder wherever the package
is installed; the loader in ``prefixkv`` (torch/cupy extras) compiles it with NVRTC.
"""

from __future__ import annotations

from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent


def source_path(name: str) -> Path:
    path = KERNEL_DIR / name
    if path.suffix != ".cu" or not path.is_file():
        available = ", ".join(sorted(p.name for p in KERNEL_DIR.glob("*.cu"))) or "none"
        raise FileNotFoundError(f"no CUDA source {name!r} in {KERNEL_DIR} (available: {available})")
    return path


def sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cu"))
