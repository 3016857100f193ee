"""The layers of include/eventpush point down only, and nothing in it imports in a circle.

The contracts are declared once, in pyproject.toml ([tool.importlinter]); ``lint-imports``
checks them on the import graph grimp builds from the source, imports inside functions
included. A broken copy of the package shows that both checks do fail on a violation.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CIRCLES = ROOT / "scripts" / "import_circles.py"
# An upward import inside a function (a leaf importing the runtime): both checks must see it.
UPWARD = "\n\ndef _upward():\n    from eventpush.push import engine  # noqa: F401\n"


def run(args: list[str], cwd: Path, include: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        args,
        cwd=cwd,
        env={"PYTHONPATH": str(include), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_layer_contracts_are_kept() -> None:
    done = run([str(LINT_IMPORTS), "--no-cache"], ROOT, ROOT / "include")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "broken" not in done.stdout.replace("0 broken", "")


def test_no_import_circle_in_the_package() -> None:
    done = run([sys.executable, str(CIRCLES)], ROOT, ROOT / "include")
    assert done.returncode == 0 and "no import circle" in done.stdout, done.stdout + done.stderr


def test_both_checks_fail_on_an_upward_import_in_a_function(tmp_path: Path) -> None:
    """A copy of the package where ``errors`` (a leaf) imports the engine, which imports
    ``errors``: a layer violation and a circle at once."""
    include = tmp_path / "include"
    shutil.copytree(
        ROOT / "include" / "eventpush",
        include / "eventpush",
        ignore=shutil.ignore_patterns("__pycache__", "static", "migrations"),
    )
    errors = include / "eventpush" / "errors.py"
    errors.write_text(errors.read_text() + UPWARD)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")

    linted = run([str(LINT_IMPORTS), "--no-cache"], tmp_path, include)
    assert linted.returncode == 1, linted.stdout + linted.stderr
    assert "eventpush layers point down BROKEN" in linted.stdout
    assert "eventpush.errors -> eventpush.push.engine" in linted.stdout

    circles = run([sys.executable, str(CIRCLES), str(include)], tmp_path, include)
    assert circles.returncode == 1, circles.stdout + circles.stderr
    assert "eventpush.errors" in circles.stdout and "eventpush.push.engine" in circles.stdout
