"""The user-facing docs stand alone and stay true to the code: links resolve inside the
repository, no development history, every `kvdepot serve` flag and every metric documented,
and the README's test command is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

from kvdepot import cli
from kvdepot.server.metrics import Metrics, _Family

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").rglob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_resolve_inside_the_repository():
    for doc in DOCS:
        text = doc.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, doc
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists() and ROOT in dest.parents, f"{doc.name}: broken link {target}"
            if anchor:
                headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                assert anchor in headings, f"{doc.name}: no heading for #{anchor} in {dest.name}"


def test_no_development_history():
    for doc in DOCS:
        text = doc.read_text()
        assert not re.search(r"\bcommits?\b[^.\n]{0,20}\b[0-9a-f]{7,40}\b", text), doc
        assert not re.search(r"\bsession[- ]\d", text), doc


def test_every_serve_flag_is_documented():
    readme = (ROOT / "README.md").read_text()
    serve = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    flags = [o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    missing = [f for f in flags if f"`{f}" not in readme]
    assert not missing, f"kvdepot serve flags missing from README.md: {missing}"


def test_every_metric_is_documented():
    readme = (ROOT / "README.md").read_text()
    names = [f.name for f in vars(Metrics()).values() if isinstance(f, _Family)]
    missing = [n for n in names if n not in readme]
    assert not missing, f"metrics missing from README.md: {missing}"


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2 and "kvdepot demo" in block[0] and "pytest" in block[1]
    assert block[1] in (ROOT / ".ci" / "run").read_text()


def test_every_setting_is_documented():
    from kvdepot.config import SETTINGS, env_vars

    readme = (ROOT / "README.md").read_text()
    missing = [s.key for s in SETTINGS if f"| `{s.key}` |" not in readme]
    missing += [e for e in env_vars() if f"`{e}" not in readme]
    assert not missing, f"settings missing from README.md: {missing}"
