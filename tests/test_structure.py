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


# Methods of namedtuple's public API, whose names start with an underscore so as not to clash with fields.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
DOCUMENTED = NAMEDTUPLE_API | {"_exit"}  # os._exit: documented, the exit without cleanup of a forked child
# The one module per library that may read a library's private names, each tested on its own.
INTERNALS_SUFFIX = "_internals.py"


def defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines itself: its functions, methods and class attributes, and the attributes
    it assigns on any object (`self._x = ...`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if _is_private(name)}


def foreign_private_names(path: Path, root: Path = ROOT) -> list[str]:
    """Private names `path` reads that it does not define: imports from a private module or of a private name of
    a library, `obj._name` on anything but self and cls, and getattr(obj, "_name"), as 'file:line name'."""
    tree = ast.parse(path.read_text(), str(path))
    own = defined_private_names(tree) | DOCUMENTED
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if any(_is_private(part) for part in node.module.split(".")):
                found.append((node.lineno, node.module))
            elif node.module.split(".")[0] not in PACKAGES:
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if any(_is_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in own:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, f"._{node.attr[1:]}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _is_private(node.args[1].value) \
                and node.args[1].value not in own:
            found.append((node.lineno, f"{node.func.id} {node.args[1].value}"))
    return [f"{path.relative_to(root)}:{line} {name}" for line, name in sorted(found)]


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a project package in `path`, at module level or inside a function."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, module) for line, module in found if module.split(".")[0] in PACKAGES]


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports, at module level, inside functions or for type checking only
    (`from pipelines import sources` names pipelines.sources; `from pipelines.sources import X` names it too)."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for package in packages for p in (root / package).rglob("*.py")}

    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                    and node.module.split(".")[0] in packages:  # the module, and `from package import module`
                targets |= {module_of(node.module), *(module_of(f"{node.module}.{a.name}") for a in node.names)}
            elif isinstance(node, ast.Import):
                targets |= {module_of(a.name) for a in node.names if a.name.split(".")[0] in packages}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (each a circle of imports), sorted."""
    order, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(module: str) -> None:  # Tarjan's algorithm
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, ()):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(circles)


@pytest.mark.unit
def test_components_import_no_other_package_of_the_project():
    """The steps sit below pipelines, trainer, serving and the Spark jobs: what they need from a layer above comes
    in as an argument (components.tracking's model logger, for instance)."""
    hits = [f"{path.relative_to(ROOT)}:{line} {module}" for path in (ROOT / "components").rglob("*.py")
            for line, module in project_imports(path) if module.split(".")[0] != "components"]
    assert hits == []


@pytest.mark.unit
def test_no_module_imports_another_modules_private_names():
    """The tests too: a test that needs an internal gets it through a public name, so a rename cannot pass
    unnoticed and the test shows how the code is meant to be used."""
    files = [path for package in (*PACKAGES, "tests") for path in (ROOT / package).rglob("*.py")]
    assert len(files) > 50
    assert [hit for path in files for hit in private_imports(path)] == []


@pytest.mark.unit
def test_no_module_reads_another_modules_private_names_as_attributes():
    files = [path for package in (*PACKAGES, "tests") for path in (ROOT / package).rglob("*.py")
             if path != Path(__file__)]  # this file's own examples name private attributes on purpose
    assert [hit for path in files for hit in private_attributes(path)] == []


@pytest.mark.unit
def test_private_names_of_libraries_are_read_only_in_their_internals_modules():
    """A library's private names (Keras' `_flatten_layers`, TensorFlow's `_inference_function`) are read in one
    module per library, trainer/keras_internals.py and serving/tensorflow_internals.py, whose tests fail when
    an upgrade drops them; anywhere else they would break silently."""
    files = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
             if not path.name.endswith(INTERNALS_SUFFIX)]
    assert [hit for path in files for hit in foreign_private_names(path)] == []
    internals = sorted(p.relative_to(ROOT).as_posix() for package in PACKAGES
                       for p in (ROOT / package).rglob(f"*{INTERNALS_SUFFIX}"))
    assert internals == ["serving/tensorflow_internals.py", "trainer/keras_internals.py"]
    for module in internals:  # each has its test
        test = ROOT / "tests" / Path(module).parent / f"test_{Path(module).name}"
        assert test.exists(), test


@pytest.mark.unit
def test_the_check_finds_foreign_private_names_and_leaves_a_modules_own_alone(tmp_path):
    module = tmp_path / "x.py"
    module.write_text("from airflow._shared.tz import parse\nfrom mlflow.utils import _use\nimport keras._tf\n"
                      "class A:\n    def _mine(self):\n        self._kept = 1\n"
                      "def f(m, other, info):\n    m._flatten_layers(); other._mine(); other._kept; info._replace()\n"
                      "    getattr(m, '_inference_function'); getattr(m, 'public'); self._x; cls._y\n")
    assert foreign_private_names(module, tmp_path) == [
        "x.py:1 airflow._shared.tz", "x.py:2 mlflow.utils._use", "x.py:3 keras._tf", "x.py:8 ._flatten_layers",
        "x.py:9 getattr _inference_function"]


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


@pytest.mark.unit
def test_no_two_modules_import_each_other():
    """Not even inside a function or for type checking only: a circle means two modules that cannot be read,
    tested or replaced apart (a source needs only what it asks of a run: pipelines.sources.SourceContext)."""
    graph = import_graph()
    assert len(graph) > 100 and graph["pipelines.context"] >= {"pipelines.sources", "components.layout"}
    assert import_circles(graph) == []


@pytest.mark.unit
def test_the_check_finds_an_import_circle_through_a_function_and_type_checking(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.d"] == {"pkg", "pkg.a"}  # the package runs its __init__ first
    assert import_circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
