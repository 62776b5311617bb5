"""The distribution installs under one namespace, ``trajwh`` (issue 18): the repository's top-level
folders (lineage/, schemas/, ...) become trajwh.lineage, trajwh.schemas, ..., so installing the
project never shadows another package called ``schemas`` or ``lineage``."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("schemas", "ingest", "lineage", "pipelines", "redaction", "dedup", "fragments", "synth",
               "packing", "licenses", "datacards")


def test_no_code_imports_a_top_level_folder_name():
    """Every import of the project's own code goes through ``trajwh.``: an import of ``lineage``
    would load a second copy of the module (or fail once installed)."""
    offenders = []
    for folder in (*SUBPACKAGES, "trajwh", "tests", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                              if n.split(".")[0] in SUBPACKAGES]
    assert not offenders, "import through trajwh.: " + ", ".join(offenders)


def test_installed_names_resolve_under_trajwh_only(tmp_path):
    """From another working directory, the installed project answers to ``trajwh.*`` and the bare
    folder names are not importable; building the definitions loads no bare name."""
    code = ("import importlib.util, sys; import trajwh.pipelines.definitions, trajwh; "
            f"bare = {list(SUBPACKAGES)!r}; "
            "print([n for n in bare if importlib.util.find_spec(n) is not None or n in sys.modules]); "
            "print(callable(trajwh.open))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    assert out[:2] == ["[]", "True"]


@pytest.mark.timeout(300)
def test_wheel_holds_one_top_level_package(tmp_path):
    """The wheel's files are all under trajwh/ (plus its dist-info), the folders mapped by
    package-dir, and the console script points into the namespace."""
    had_build = (ROOT / "build").exists()
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True)
    if not had_build:  # setuptools builds inside the checkout: leave it as it was
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    if proc.returncode != 0 and "No matching distribution found for setuptools" in proc.stderr:
        pytest.skip("the package registry is not reachable: no setuptools to build the wheel with")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"trajwh"}
    for sub in SUBPACKAGES:
        assert f"trajwh/{sub}/__init__.py" in names, sub
    assert "trajwh/ingest/adapters/__init__.py" in names and "trajwh/lineage/catalog.py" in names
    (entry,) = [n for n in names if n.endswith("entry_points.txt")]
    assert "trajwh = trajwh.pipelines.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_lock_file_pins_every_dependency_within_its_range():
    """``requirements-dev.lock`` (what ``make`` installs) pins every dependency of pyproject.toml,
    the dev extra included, at a version its range admits: a dependency added or narrowed without
    ``make lock`` fails here."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (ROOT / "requirements-dev.lock").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split(";")[0].strip().split("==")
            pins[canonicalize_name(name)] = version
    wanted = [Requirement(r) for r in (*project["dependencies"], *project["optional-dependencies"]["dev"])]
    problems = [f"{r} (locked: {pins.get(canonicalize_name(r.name))})" for r in wanted
                if canonicalize_name(r.name) not in pins or not r.specifier.contains(pins[canonicalize_name(r.name)])]
    assert not problems, "run `make lock`: " + ", ".join(problems)
    assert len(pins) > len(wanted)  # the transitive dependencies are pinned too
