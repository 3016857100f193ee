"""docs/ARCHITECTURE.md stays true to the tree, and the repository stands alone.

- every module of the package is named in the doc's code map by its dotted name;
- every ``eventpush.…`` dotted name the doc writes is a real module, or a real name inside one
  (found from the module's source, located through importlib; no module below the package is
  executed, so the test stays fast and needs neither Airflow nor Spark);
- no tracked file points at a design document outside the repository.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "include" / "eventpush"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
DOTTED = re.compile(r"(?<![\w./-])eventpush(?:\.[A-Za-z_]\w*)+")
# Built from parts so that this file does not contain what it looks for.
OUTSIDE = ("../" + "shared", "shared/" + "DESIGN")
NOT_SCANNED_DIRS = {".git", ".venv", "var", "artifacts", "__pycache__", "node_modules"}


def doc_text() -> str:
    assert DOC.is_file(), f"{DOC.relative_to(ROOT)} is missing"
    return DOC.read_text(encoding="utf-8")


def code_map() -> str:
    text = doc_text()
    match = re.search(r"^## Code map\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, "docs/ARCHITECTURE.md has no '## Code map' section"
    return match.group(1)


def package_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        if path.name in ("__init__.py", "__main__.py") or "versions" in rel.parts:
            continue
        names.append(".".join(rel.with_suffix("").parts))
    return names


def test_every_module_is_in_the_code_map() -> None:
    section = code_map()
    modules = package_modules()
    assert "eventpush.push.engine" in modules  # the walk found the package
    unnamed = [m for m in modules if f"`{m}`" not in section]
    assert not unnamed, f"modules missing from the code map of docs/ARCHITECTURE.md: {unnamed}"


def top_level_names(tree: ast.Module) -> dict[str, ast.AST | None]:
    """Names a module defines or imports at its top level (value: the class node, if any)."""
    names: dict[str, ast.AST | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
    return names


def class_members(node: ast.ClassDef) -> set[str]:
    members = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            members.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return members


def module_file(dotted: str) -> Path | None:
    """The source of module ``dotted`` (a package's ``__init__.py``, or the folder of a
    namespace package), found from where Python imports ``eventpush`` without importing
    anything below it: finding ``a.b.c`` with importlib would execute ``a.b``."""
    spec = importlib.util.find_spec("eventpush")
    assert spec is not None and spec.submodule_search_locations, "eventpush is not importable"
    base = Path(next(iter(spec.submodule_search_locations)))
    parts = dotted.split(".")[1:]
    path = base.joinpath(*parts)
    if path.with_suffix(".py").is_file() and parts:
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.is_dir():
        return path
    return None


def resolve(dotted: str) -> str | None:
    """None when ``dotted`` names a module or a name in one; else what is wrong."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        source = module_file(module)
        if source is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        if source.is_dir():
            return f"{module} is a folder without names, not one with {rest[0]!r}"
        names = top_level_names(ast.parse(source.read_text(encoding="utf-8")))
        if rest[0] not in names:
            return f"{module} has no {rest[0]!r}"
        node = names[rest[0]]
        if len(rest) == 1:
            return None
        if isinstance(node, ast.ClassDef) and len(rest) == 2 and rest[1] in class_members(node):
            return None
        return f"{module}.{rest[0]} has no {'.'.join(rest[1:])!r}"
    return "no such module"


def test_every_dotted_name_in_the_doc_exists() -> None:
    names = sorted(set(DOTTED.findall(doc_text())))
    assert len(names) > 30, f"too few eventpush names found in the doc: {names}"
    wrong = {name: why for name in names if (why := resolve(name)) is not None}
    assert not wrong, f"names in docs/ARCHITECTURE.md that do not exist: {wrong}"


def test_resolve_tells_real_names_from_made_up_ones() -> None:
    assert resolve("eventpush.push.store.commit") is None
    assert resolve("eventpush.sinks.contract.Target.runner_id") is None
    assert resolve("eventpush.push.store.no_such_function") is not None
    assert resolve("eventpush.no_such_module") is not None
    assert resolve("eventpush.migrations.env") is None
    assert resolve("eventpush.airflow.push_slice.PushSliceSensor") is None


def repository_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout.decode()
        return [ROOT / name for name in listed.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (an unpacked archive): every file but the local state.
        files = []
        for folder, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in NOT_SCANNED_DIRS]
            files.extend(Path(folder) / n for n in names)
        return files


def test_no_file_points_outside_the_repository() -> None:
    files = repository_files()
    assert any(f.name == "pyproject.toml" for f in files)
    offenders = []
    for path in files:
        if not path.is_file():
            continue  # deleted in the work tree but still in the index
        data = path.read_bytes()
        offenders += [
            f"{path.relative_to(ROOT)}: {needle}" for needle in OUTSIDE if needle.encode() in data
        ]
    assert not offenders, f"files that point outside the repository: {offenders}"


@pytest.mark.parametrize("needle", OUTSIDE)
def test_the_doc_stands_alone(needle: str) -> None:
    assert needle not in doc_text()


def test_paths_the_package_computes_point_into_the_checkout():
    """Modules that find the checkout from their own file (the demo, the Spark DAGs' jobs)
    must follow a move of the module."""
    from eventpush.airflow.spark_submit import JOBS_DIR
    from eventpush.demo.story import REPO as DEMO_REPO

    assert (DEMO_REPO / "dags" / "eventpush_push.py").is_file()
    assert (JOBS_DIR / "audit.py").is_file()
