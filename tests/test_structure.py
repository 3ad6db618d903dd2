"""The house rules that can be checked by reading the code: no module reaches into another's private names, and
components (the steps) import no layer above them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("components", "pipelines", "spark_jobs", "trainer", "serving", "dags", "bench")


def private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """`from <project module> import _name` lines in `path`, as 'file:line name'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            found += [f"{path.relative_to(root)}:{node.lineno} {alias.name}" for alias in node.names
                      if _is_private(alias.name)]
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a project package in `path`, at module level or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, module) for line, module in found if module.split(".")[0] in PACKAGES]


@pytest.mark.unit
def test_components_import_no_other_package_of_the_project():
    """The steps sit below pipelines, trainer, serving and the Spark jobs: what they need from a layer above comes
    in as an argument (components.tracking's model logger, for instance)."""
    hits = [f"{path.relative_to(ROOT)}:{line} {module}" for path in (ROOT / "components").rglob("*.py")
            for line, module in project_imports(path) if module.split(".")[0] != "components"]
    assert hits == []


@pytest.mark.unit
def test_no_module_imports_another_modules_private_names():
    files = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]
    assert len(files) > 50
    assert [hit for path in files for hit in private_imports(path)] == []


@pytest.mark.unit
def test_the_check_finds_a_private_import(tmp_path):
    module = tmp_path / "x.py"
    module.write_text("from trainer.train import _save, load_checkpoint\nfrom os import _exit\n")
    assert private_imports(module, tmp_path) == ["x.py:1 _save"]
