"""The test suite's layout (issue 27, item 5), checked over the tree:

- No module under ``tests/`` imports from a ``conftest``: a conftest only defines fixtures;
  fakes, harnesses and the types tests annotate with live in ``tests/fakes/`` (or, for one
  suite's private helpers, an ``_``-prefixed module of that suite).
- ``tests/server/`` mirrors ``kvturn_server``: every server test is in the folder of the package
  it tests (``tests/server/router/`` for ``kvturn_server/router/``), except the few cross-cutting
  ones listed in ``CROSS_CUTTING``, which stay at the top.
- Every folder of tests is a package (``__init__.py``): test modules are imported by their
  dotted name, so two folders may hold files of the same name.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SERVER_TESTS = TESTS / "server"
PACKAGE = TESTS.parent / "server" / "kvturn_server"

# Tests of the whole tree rather than of one package: the top-level command, the deploy files,
# the GPU script, the README's recipe, the house rules, and the vLLM internals both the
# connector and the launcher rely on (scripts/gpu-check.sh runs that one by its path).
CROSS_CUTTING = {
    "test_cli.py",
    "test_deploy_manifests.py",
    "test_gpu_check.py",
    "test_grafana_dashboard.py",
    "test_package_faces.py",
    "test_readme_recipe.py",
    "test_settings.py",
    "test_vllm_contract.py",
}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)


def _conftest_imports(path: Path) -> list[str]:
    """Every import in ``path`` of a module named ``conftest`` (absolute, relative or as a name
    taken from a package), as written."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[-1] == "conftest"]
        elif isinstance(node, ast.ImportFrom):
            written = "." * node.level + (node.module or "")
            if (node.module or "").split(".")[-1] == "conftest":
                found.append(written)
            joint = "." if node.module else ""
            found += [f"{written}{joint}{a.name}" for a in node.names if a.name == "conftest"]
    return found


def test_no_module_imports_from_a_conftest() -> None:
    offenders = {_module_name(path): names for path in sorted(TESTS.rglob("*.py"))
                 if (names := _conftest_imports(path))}
    assert offenders == {}, (
        "import fakes, harnesses and settings from tests/fakes/ (or a suite's _private module), "
        f"not from a conftest: {offenders}")


def test_the_check_sees_every_form_of_conftest_import(tmp_path: Path) -> None:
    cases = {
        "from tests.server.conftest import MakeHarness": ["tests.server.conftest"],
        "from .conftest import RETENTION_TTL": [".conftest"],
        "from . import conftest": [".conftest"],
        "from tests.e2e import conftest": ["tests.e2e.conftest"],
        "import tests.sdk.conftest": ["tests.sdk.conftest"],
        "from tests.fakes.router_harness import MakeHarness": [],
    }
    for source, expected in cases.items():
        module = tmp_path / "case.py"
        module.write_text(source + "\n")
        assert _conftest_imports(module) == expected, source


def _packages() -> set[tuple[str, ...]]:
    """Every package of ``kvturn_server`` below the top, as path parts (``("bench", "agent")``)."""
    return {init.parent.relative_to(PACKAGE).parts for init in PACKAGE.rglob("__init__.py")
            if init.parent != PACKAGE}


def test_server_tests_mirror_the_packages() -> None:
    packages = _packages()
    misplaced = []
    for path in sorted(SERVER_TESTS.rglob("test_*.py")):
        folder = path.parent.relative_to(SERVER_TESTS).parts
        if folder == ():
            if path.name not in CROSS_CUTTING:
                misplaced.append(f"{path.name} (at the top, not in CROSS_CUTTING)")
        elif folder not in packages:
            misplaced.append(f"{'/'.join(folder)}/{path.name} (no package kvturn_server/"
                             f"{'/'.join(folder)})")
    assert misplaced == [], (
        "put each server test in tests/server/<package>/ for the package of kvturn_server it "
        f"tests; only cross-cutting tests stay at the top: {misplaced}")
    stale = sorted(name for name in CROSS_CUTTING if not (SERVER_TESTS / name).is_file())
    assert stale == [], f"CROSS_CUTTING lists tests that are not at tests/server/: {stale}"


def test_every_test_folder_is_a_package() -> None:
    folders = {path.parent for path in TESTS.rglob("*.py")} - {TESTS.parent}
    missing = sorted(str(folder.relative_to(TESTS.parent)) for folder in folders
                     if "__pycache__" not in folder.parts
                     and not (folder / "__init__.py").is_file())
    assert missing == [], f"test folders without __init__.py: {missing}"
