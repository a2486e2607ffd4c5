"""Build hook: compile the CUDA transfer kernels at install time when nvcc is present.

Everything else about the package is in pyproject.toml. The library goes to
``kvdepot/gpu/_lib/libkvdepot_kernels.so`` (in the source tree for an editable install), built
for `kvdepot.gpu.build.INSTALL_ARCHS` plus PTX. Without nvcc, or if the build fails, the install
goes on: the daemon then builds on first use into a per-user cache, or runs the torch fallback
(see kvdepot/gpu/kernels.py). ``KVDEPOT_SKIP_KERNEL_BUILD=1`` skips the build.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _load_build_module():
    # by file path: importing the package would import torch, absent from the build environment
    spec = importlib.util.spec_from_file_location("_kvdepot_build", HERE / "kvdepot" / "gpu" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if os.environ.get("KVDEPOT_SKIP_KERNEL_BUILD") == "1":
            return
        b = _load_build_module()
        if b.find_nvcc() is None:
            print("kvdepot: no nvcc; the CUDA kernels will be built on first use (or the torch fallback used)",
                  file=sys.stderr)
            return
        root = HERE if getattr(self, "editable_mode", False) else Path(self.build_lib)
        out = root / "kvdepot" / "gpu" / "_lib" / "libkvdepot_kernels.so"
        try:
            b.build(out, b.INSTALL_ARCHS, ptx=True)
            print(f"kvdepot: built the CUDA kernels into {out}", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - an install without the kernels still works
            print(f"kvdepot: building the CUDA kernels failed ({exc}); they will be built on first use",
                  file=sys.stderr)


setup(cmdclass={"build_py": BuildPyWithKernels})
