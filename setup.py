"""Build hooks: compile the CUDA transfer kernels at build / install time when nvcc is present,
and tag a wheel that carries them for its platform.

Everything else about the package is in pyproject.toml. The library goes to
``kvdepot/gpu/_lib/libkvdepot_kernels.so`` (in the source tree for an editable install), built
for `kvdepot.gpu.build.INSTALL_ARCHS` plus PTX, or for ``$KVDEPOT_KERNEL_ARCHS`` (comma-separated
compute capabilities, e.g. ``90`` or ``80,90,100``; PTX of the last). Without nvcc, or if the
build fails, the build goes on: the wheel is then ``py3-none-any`` and still carries the CUDA
source, so an installed kvdepot builds the kernels on first use into a per-user cache (or runs
the torch fallback; see kvdepot/gpu/kernels.py). ``KVDEPOT_SKIP_KERNEL_BUILD=1`` skips the build.

A wheel with the library is tagged ``py3-none-<platform>`` (e.g. ``linux_x86_64``): the library
is called through ctypes with a C ABI and links the CUDA runtime statically, so it depends on
the platform but not on the Python version or on torch.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
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
        archs = [a.strip() for a in os.environ.get("KVDEPOT_KERNEL_ARCHS", "").split(",") if a.strip()]
        try:
            b.build(out, archs or b.INSTALL_ARCHS, ptx=True)
            print(f"kvdepot: built the CUDA kernels into {out}", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - an install without the kernels still works
            print(f"kvdepot: building the CUDA kernels failed ({exc}); they will be built on first use",
                  file=sys.stderr)


class BdistWheelTagged(bdist_wheel):
    """``py3-none-<platform>`` when the build produced the kernel library, else pure."""

    def run(self) -> None:
        self.run_command("build")
        build_lib = Path(self.get_finalized_command("build").build_lib)
        self.root_is_pure = not (build_lib / "kvdepot" / "gpu" / "_lib" / "libkvdepot_kernels.so").exists()
        if not self.root_is_pure:  # install into the wheel's root (platlib), not <name>.data/purelib
            self.distribution.has_ext_modules = lambda: True
        super().run()

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        return ("py3", "none", plat) if not self.root_is_pure else (python, abi, plat)


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": BdistWheelTagged})
