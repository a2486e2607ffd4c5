"""The nvcc command line of the kernel library, with no import of torch or of the package, so
that ``setup.py`` can build the library at install time (``python setup.py``-style builds run
without torch in their isolated environment) and `kvdepot.gpu.kernels` can build it on first
use with the same flags.

The library links the CUDA runtime statically and exposes a C ABI only (no libtorch), so one
build serves every torch version. It is stamped with the first 16 hex digits of the SHA-256 of
its source files (``kvd_source_hash()``, `source_hash`); the loader refuses a library built
from other source.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

SRC = Path(__file__).parent / "csrc" / "kvdepot_kernels.cu"  # the translation unit nvcc compiles
PARTS = ("kvd_lanes.cuh", "kvd_requests.cuh", "kvd_engine_side.cuh")  # what it includes, in order
# what an install ships: every data-centre and workstation GPU arch nvcc 13 builds for, plus
# PTX of the newest so later GPUs can JIT it
INSTALL_ARCHS = ("80", "86", "89", "90", "100", "120")


def sources() -> list[Path]:
    """The kernel library's source files: `SRC` and the parts it includes (`PARTS`)."""
    return [SRC, *(SRC.parent / p for p in PARTS)]


def source_hash() -> str:
    """First 16 hex digits of the SHA-256 of the kernel source, every file of `sources` in
    order (what a library must be built from)."""
    h = hashlib.sha256()
    for path in sources():
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def find_nvcc() -> str | None:
    """nvcc on PATH, else ``$CUDA_HOME/bin/nvcc`` (default /usr/local/cuda), else None."""
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return nvcc if os.path.exists(nvcc) else None


def build(out_path: Path, archs: Sequence[str], ptx: bool = False) -> None:
    """Compile the library into ``out_path`` for SM ``archs`` (e.g. ``["90"]``), plus PTX of
    the last arch if ``ptx``; written to a temporary name and renamed, so readers never see a
    partial file.

    Raises:
        FileNotFoundError: no nvcc.
        subprocess.CalledProcessError: compilation failed.
    """
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found; set CUDA_HOME or KVDEPOT_KERNELS_SO")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if ptx:
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f"{out_path.name}.tmp{os.getpid()}")
    try:
        subprocess.run([nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", *gencode,
                        f'-DKVD_SOURCE_HASH="{source_hash()}"', "-o", str(tmp), str(SRC)], check=True)
        os.replace(tmp, out_path)
    finally:
        if tmp.exists():
            tmp.unlink()
