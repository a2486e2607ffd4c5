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


def _module_imports(root: pathlib.Path) -> dict[str, set[str]]:
    """kvdepot's modules -> the kvdepot modules each imports at module level (``if
    TYPE_CHECKING:`` blocks included; imports inside functions are not)."""
    import ast

    mods = {}
    for p in root.rglob("*.py"):
        name = ".".join(p.relative_to(root.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        top = ast.parse(path.read_text()).body
        nodes = [n for stmt in top for n in ([stmt] if isinstance(stmt, (ast.Import, ast.ImportFrom))
                                              else ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [])]
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                # a submodule imported from its package, else the module the names come from
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("kvdepot"):
                    out.add(t)
        graph[name] = out
    return graph


def test_no_import_cycle_in_the_package():
    graph = _module_imports(ROOT / "kvdepot")
    cycles, state = [], {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_over_600_lines():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sorted((ROOT / "kvdepot").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600]
    assert not long, long
