"""The suite's layout (tests/__init__.py): every test module sits in a folder named after a wing of
eagle3cli or in a documented extra folder, and no module under tests/ imports a test module; what
several modules share lives in tests/helpers/ or a conftest.py."""

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "eagle3cli"
# Folders beside the wings, each described in tests/__init__.py's docstring.
EXTRA = {"cli", "repo"}
NO_TESTS = {"helpers", "fixtures"}


def wings() -> set[str]:
    return {p.parent.name for p in PACKAGE.glob("*/__init__.py")}


def imported_test_modules(source: str, module: str) -> list[str]:
    """The test modules (and conftest modules) that ``source``, the text of ``module`` (dotted,
    e.g. ``tests.data.test_x``), imports, at any depth."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [base] if is_test_module(base) else [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [t for t in targets if is_test_module(t)]
    return found


def is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in dotted.split("."))


def _modules():
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS.parent).with_suffix("")
        yield path, ".".join(rel.parts)


@pytest.mark.parametrize("source,module,expected", [
    pytest.param("from test_trainer import store", "tests.core.test_time_limit", ["test_trainer"], id="top"),
    pytest.param("def f():\n    from test_evaluate import make_draft\n", "tests.core.test_x", ["test_evaluate"],
                 id="in-a-function"),
    pytest.param("import tests.train.test_trainer as t", "tests.core.test_x", ["tests.train.test_trainer"],
                 id="dotted"),
    pytest.param("from tests.train import test_trainer", "tests.core.test_x", ["tests.train.test_trainer"],
                 id="from-package"),
    pytest.param("from .test_y import a", "tests.core.test_x", ["tests.core.test_y"], id="relative"),
    pytest.param("from ..train import test_ttt", "tests.core.test_x", ["tests.train.test_ttt"], id="relative-up"),
    pytest.param("from tests.conftest import smol_tiny_dir", "tests.core.test_x", ["tests.conftest"], id="conftest"),
    pytest.param("from tests.helpers.trainer import config\nimport eagle3cli.train.trainer", "tests.core.test_x", [],
                 id="helpers-and-package"),
])
def test_the_scan_finds_every_spelling_of_a_test_module_import(source, module, expected):
    assert imported_test_modules(source, module) == expected


def test_no_module_under_tests_imports_a_test_module():
    offenders = {module: found for path, module in _modules()
                 if (found := imported_test_modules(path.read_text(), module))}
    assert offenders == {}, "move what they share into tests/helpers/ or a conftest.py"


def test_every_test_module_sits_in_a_wing_folder_or_a_documented_extra_one():
    allowed = wings() | EXTRA
    assert {"core", "data", "train", "evaluate", "workflows"} <= allowed  # the package was found
    misplaced = []
    for path in sorted(TESTS.rglob("test_*.py")):
        parts = path.relative_to(TESTS).parts
        if len(parts) != 2 or parts[0] not in allowed:
            misplaced.append(str(path.relative_to(TESTS.parent)))
    assert misplaced == []


def test_every_folder_is_a_wing_an_extra_or_helpers_and_each_is_a_package():
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - wings() - EXTRA - NO_TESTS == set()
    # same-named test files in two folders need distinct module names: tests.<folder>.test_x
    assert [f for f in sorted(folders - {"fixtures"}) if not (TESTS / f / "__init__.py").is_file()] == []
    assert (TESTS / "__init__.py").is_file()
    assert not list((TESTS / "helpers").glob("test_*.py"))


def test_the_extra_folders_are_documented():
    doc = ast.get_docstring(ast.parse((TESTS / "__init__.py").read_text()))
    assert [f for f in sorted(EXTRA | NO_TESTS) if f"{f}/" not in doc] == []


def test_every_test_path_the_docs_and_code_name_exists():
    """A move under tests/ updates the docs, docstrings and comments that point at the file (the
    CHANGELOG's released sections keep the paths of their day)."""
    root = TESTS.parent
    scanned = ([root / "README.md"] + sorted((root / "docs").glob("*.md"))
               + [p for d in ("eagle3cli", "benchmarks", "tests") for p in sorted((root / d).rglob("*.py"))])
    path = re.compile(r"(?<![\w/.])tests/[\w/]+\.py")
    named = {(str(p.relative_to(root)), m) for p in scanned for m in path.findall(p.read_text())}
    assert {"tests/repo/test_design_refs.py", "tests/helpers/families.py"} <= {m for _, m in named}  # the scan reads
    assert sorted((f, m) for f, m in named if not (root / m).is_file()) == []
