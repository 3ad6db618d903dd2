"""The house rules that can be checked by reading the code: no module reaches into another's private names."""

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
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


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
