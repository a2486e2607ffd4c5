"""Static check of the package, the benchmarks and the GPU tests: GPU-only code paths never run
in CI (no GPU there), so an undefined name in them must be caught without running them."""

import pathlib

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKED = [ROOT / "kvdepot", ROOT / "benchmarks", ROOT / "tests" / "gpu", ROOT / "tests" / "deploy",
           ROOT / "tests" / "packaging", ROOT / "setup.py"]


class _Collect(Reporter):
    def __init__(self):
        self.problems = []

    def unexpectedError(self, filename, msg):
        self.problems.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.problems.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message):
        text = str(message)
        if "imported but unused" in text or "unable to detect undefined names" in text:
            return
        self.problems.append(text)


def test_no_undefined_names_or_syntax_errors_in_the_package():
    rep = _Collect()
    for path in sorted(p for d in CHECKED for p in ([d] if d.is_file() else d.rglob("*.py"))):
        pyflakes_api.checkPath(str(path), rep)
    assert not rep.problems, "\n".join(rep.problems)
