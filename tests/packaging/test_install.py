"""What the Docker image does to install kvdepot, done here: build the sdist and wheel with
``python -m build`` (from the sdist, as the image's build stage does), install the wheel into a
fresh virtual environment, and run `kvdepot serve` from it until `kvdepot ping` answers. Also:
what each artifact carries (the CUDA source always, a kernel library only in a wheel built with
nvcc, tagged for its platform), and that an installed wheel without the library builds the
kernels from its own copy of the source.

The virtual environments see the site-packages of the interpreter running the tests, through a
``.pth`` file (torch and the other dependencies are installed there, in a virtualenv or not;
pulling a CUDA torch wheel into each venv would take gigabytes), but kvdepot itself must come
from the venv: its own site-packages comes first, every command runs outside the source tree
and checks where ``kvdepot`` was imported from.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
import venv
import zipfile
from pathlib import Path

import pytest

from kvdepot.gpu.build import PARTS, find_nvcc

ROOT = Path(__file__).resolve().parents[2]
HAVE_NVCC = find_nvcc() is not None
SO = "kvdepot/gpu/_lib/libkvdepot_kernels.so"
CU = "kvdepot/gpu/csrc/kvdepot_kernels.cu"
CU_ALL = {CU, *(f"kvdepot/gpu/csrc/{p}" for p in PARTS)}  # the translation unit and what it includes


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout_s: float = 600) -> str:
    r = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                       timeout=timeout_s, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _build(outdir: Path, *args: str, env: dict | None = None) -> None:
    # a copy of the tracked files only: a kernel library or build/ left in the checkout must not leak in
    src = outdir / "src"
    files = _run(["git", "ls-files", "-z"], ROOT).split("\0")
    for f in filter(None, files):
        dst = src / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes((ROOT / f).read_bytes())
    _run([sys.executable, "-m", "build", *args, "--outdir", str(outdir), str(src)], outdir, env)


def _venv(path: Path, wheel: Path) -> Path:
    """A fresh venv with ``wheel`` installed, the running interpreter's site-packages after its
    own (`venv`'s system_site_packages would give the base interpreter's, which lack torch when
    the tests run in a virtualenv); its bin dir."""
    venv.EnvBuilder(with_pip=False).create(path)
    outer = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    own = next((path / "lib").glob("python*/site-packages"))
    (own / "_outer_site_packages.pth").write_text("".join(f"{p}\n" for p in outer))
    _run([sys.executable, "-m", "pip", "--python", str(path / "bin" / "python"), "install", "--no-deps", "--no-index",
          "--no-cache-dir", "-q", str(wheel)], path)
    return path / "bin"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """``python -m build`` (sdist, then the wheel from it) with the kernels built for sm_90 when
    nvcc is here; and a wheel built without them."""
    out = tmp_path_factory.mktemp("dist")
    _build(out / "full", env={"KVDEPOT_KERNEL_ARCHS": "90"})
    _build(out / "pure", "--wheel", env={"KVDEPOT_SKIP_KERNEL_BUILD": "1"})
    full = out / "full"
    return {"sdist": next(full.glob("*.tar.gz")), "wheel": next(full.glob("*.whl")),
            "pure_wheel": next((out / "pure").glob("*.whl"))}


def test_sdist_carries_sources_and_no_binary(artifacts):
    with tarfile.open(artifacts["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {*CU_ALL, "setup.py", "pyproject.toml", "LICENSE", "README.md", "MANIFEST.in"} <= names
    assert not [n for n in names if n.endswith(".so")]


def test_wheels_carry_the_cuda_source_and_say_what_they_are(artifacts):
    with zipfile.ZipFile(artifacts["wheel"]) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        wheel_info = z.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert CU_ALL <= names
    assert "License-Expression: Apache-2.0" in meta
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    if HAVE_NVCC:  # a prebuilt library: tagged for its platform, in the wheel's root
        assert SO in names
        assert artifacts["wheel"].name.endswith(f"-py3-none-{_platform_tag()}.whl"), artifacts["wheel"].name
        assert "Root-Is-Purelib: false" in wheel_info
    else:
        assert SO not in names and artifacts["wheel"].name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(artifacts["pure_wheel"]) as z:
        pure = set(z.namelist())
    assert CU_ALL <= pure and SO not in pure and artifacts["pure_wheel"].name.endswith("-py3-none-any.whl")


def _platform_tag() -> str:
    import sysconfig

    return sysconfig.get_platform().replace("-", "_").replace(".", "_")


def test_installed_wheel_serves_and_finds_its_kernels(artifacts, tmp_path):
    bindir = _venv(tmp_path / "venv", artifacts["wheel"])
    py = str(bindir / "python")
    where = _run([py, "-c", "import kvdepot; print(kvdepot.__file__)"], tmp_path).strip()
    assert where.startswith(str(tmp_path / "venv")), where
    source = _run([py, "-c", "from kvdepot.gpu.kernels import kernels_source as k; print(k())"], tmp_path,
                  env={"KVDEPOT_KERNELS_SO": "", "XDG_CACHE_HOME": str(tmp_path / "cache")}).strip()
    if HAVE_NVCC:
        assert source == "packaged"
        # the packaged library loads (ABI and source hash match the installed Python side)
        _run([py, "-c", "from kvdepot.gpu.kernels import Kernels, PACKAGED_SO; Kernels(str(PACKAGED_SO))"], tmp_path)
    else:
        assert source == "torch"
    ep = f"ipc://{tmp_path}/kvdepot.sock"
    daemon = subprocess.Popen([str(bindir / "kvdepot"), "serve", "--endpoint", ep, "--l1-bytes", "16m"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:  # as the image's HEALTHCHECK does
            r = subprocess.run([str(bindir / "kvdepot"), "ping", "--endpoint", ep, "--timeout-s", "2"], cwd=tmp_path,
                               capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if r.returncode == 0:
                break
            assert daemon.poll() is None, daemon.communicate()
            assert time.monotonic() < deadline, r.stderr
            time.sleep(0.2)
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=30)
    assert daemon.returncode == 0 and "Traceback" not in err, err


@pytest.mark.skipif(not HAVE_NVCC, reason="needs nvcc")
def test_pure_wheel_builds_kernels_from_its_own_source(artifacts, tmp_path):
    bindir = _venv(tmp_path / "venv", artifacts["pure_wheel"])
    out = tmp_path / "k" / "libkvdepot_kernels.so"
    _run([str(bindir / "kvdepot"), "build-kernels", "--arch", "90", "--out", str(out)], tmp_path)
    _run([str(bindir / "python"), "-c", f"from kvdepot.gpu.kernels import Kernels; Kernels({str(out)!r})"], tmp_path)
