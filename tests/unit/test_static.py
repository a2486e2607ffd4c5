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


def _walk_own(cls):
    """The nodes of class ``cls``, without those of classes nested in it (their own ``self``)."""
    import ast

    todo = list(ast.iter_child_nodes(cls))
    while todo:
        node = todo.pop()
        yield node
        todo.extend(n for n in ast.iter_child_nodes(node) if not isinstance(n, ast.ClassDef))


def _self_attributes(root: pathlib.Path):
    """Per class of the package: (module path, class name, base names, attributes it defines,
    attributes it reads through ``self``, with a line of each). Defined: methods, class-level
    names and annotations, ``__slots__`` entries and every ``self.x = ...`` in its methods."""
    import ast

    classes = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            defined, reads = set(), {}
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(node.name)
                elif isinstance(node, ast.Assign):
                    for t in node.targets:
                        if isinstance(t, ast.Name):
                            defined.add(t.id)
                            if t.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                                defined.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    defined.add(node.target.id)
            for node in _walk_own(cls):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id == "self"):
                    if isinstance(node.ctx, ast.Store):
                        defined.add(node.attr)
                    else:
                        reads.setdefault(node.attr, node.lineno)
            bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in cls.bases]
            classes.append((path.relative_to(ROOT), cls.name, bases, defined, reads))
    return classes


def test_no_class_reads_state_it_does_not_define():
    """Composition, not mixins: every ``self.x`` a class of the package reads is defined by the
    class itself (or by a base class of the package that it names), so no class relies on
    attributes another class sets on a shared ``self``. Classes built on another library's
    class (vLLM's connector bases, msgspec structs, ...) inherit what that library defines and
    are left out."""
    classes = _self_attributes(ROOT / "kvdepot")
    by_name = {}
    for path, name, bases, defined, reads in classes:
        by_name.setdefault(name, []).append((bases, defined))
    plain = {"object", "Exception", "Protocol", "NamedTuple", "Generic"}

    def inherited(bases, seen=()):
        out = set()
        for b in bases:
            if b in plain:
                continue
            if b not in by_name or len(by_name[b]) != 1 or b in seen:
                return None  # another library's class (or a name used twice): not checked
            b_bases, b_defined = by_name[b][0]
            up = inherited(b_bases, seen + (b,))
            if up is None:
                return None
            out |= b_defined | up
        return out

    problems = []
    for path, name, bases, defined, reads in classes:
        if any(b not in plain and b not in by_name for b in bases) or any("." in b for b in bases):
            continue
        up = inherited(bases)
        if up is None:
            continue
        for attr, line in sorted(reads.items()):
            if attr not in defined and attr not in up and not attr.startswith("__"):
                problems.append(f"{path}:{line}: {name} reads self.{attr}, which it does not define")
    assert not problems, "\n".join(problems)
