"""The house rules that can be checked by reading the code: no module reaches into another's private names (by
import or as an attribute of what it imported), and components (the steps) import no layer above them."""

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


def private_attributes(path: Path, root: Path = ROOT) -> list[str]:
    """`<project name>._name` in `path`, where the name is bound by an import of a project package (`import
    pipelines.stack as stack`, `from pipelines import stack`, `from serving.model import LoadedModel`), as
    'file:line dotted.name'. Attributes of other objects (instances) cannot be told apart by reading and pass."""
    tree = ast.parse(path.read_text(), str(path))
    imported: dict[str, str] = {}  # local name -> what it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    local = alias.asname or alias.name.split(".")[0]
                    imported[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level \
                and node.module.split(".")[0] in PACKAGES:
            imported.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in imported:
                found.append((node.lineno, node.col_offset, '.'.join([imported[value.id], *chain, node.attr])))
    return [f"{path.relative_to(root)}:{line} {name}" for line, _, name in sorted(found)]


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
def test_no_module_reads_another_modules_private_names_as_attributes():
    files = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]
    assert [hit for path in files for hit in private_attributes(path)] == []


@pytest.mark.unit
def test_the_check_finds_private_attributes_of_project_modules_and_their_names(tmp_path):
    module = tmp_path / "x.py"
    module.write_text("import os\nimport pipelines.stack as stack\nimport trainer.train\n"
                      "from serving import model\nfrom serving.model import LoadedModel\n"
                      "stack._start(); trainer.train._save(); model._cache\n"
                      "LoadedModel._converters; stack.start(); os._exit; self._own; model.__name__\n")
    assert private_attributes(module, tmp_path) == [
        "x.py:6 pipelines.stack._start", "x.py:6 trainer.train._save", "x.py:6 serving.model._cache",
        "x.py:7 serving.model.LoadedModel._converters"]


@pytest.mark.unit
def test_the_check_finds_a_private_import(tmp_path):
    module = tmp_path / "x.py"
    module.write_text("from trainer.train import _save, load_checkpoint\nfrom os import _exit\n")
    assert private_imports(module, tmp_path) == ["x.py:1 _save"]
