"""deploy/systemd: ``systemd-analyze verify`` finds nothing to say about the unit (run where
systemd is installed), and the unit sets what the daemon needs."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "kvdepot.service"


def test_systemd_analyze_verify(tmp_path):
    exe = shutil.which("systemd-analyze")
    kvdepot = shutil.which("kvdepot")
    if exe is None or kvdepot is None:
        pytest.skip("needs systemd-analyze and an installed kvdepot")
    unit = tmp_path / "kvdepot.service"  # verify checks that ExecStart exists: point it at this kvdepot
    unit.write_text(UNIT.read_text().replace("/opt/kvdepot/bin/kvdepot", kvdepot))
    r = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    ours = [line for line in (r.stdout + r.stderr).splitlines() if str(unit) in line]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr


def test_unit_settings():
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read_string(UNIT.read_text())
    svc = cp["Service"]
    assert svc["LimitMEMLOCK"] == "infinity"  # pinned L1
    assert svc["RuntimeDirectory"] == "kvdepot" and svc["User"] == "kvdepot"
    assert svc["ExecStart"].endswith("kvdepot serve")
    assert "KVDEPOT_ENDPOINT=ipc:///run/kvdepot/kvdepot.sock" in UNIT.read_text()
    sysusers = (UNIT.parent / "kvdepot.sysusers").read_text()
    assert any(line.split()[:2] == ["u", svc["User"]] for line in sysusers.splitlines() if line.strip()
               and not line.startswith("#"))
