"""The package: `python -m build` gives a wheel and an sdist that install into a fresh venv and
run the benchmark there; the registry metadata in pyproject.toml follows the Comfy registry's rules.

The fresh venvs borrow torch, diffusers and setuptools from this test venv through a .pth file (no
download, no copy of torch), get the package with `pip --no-deps --no-index`, and run from a
directory outside the checkout with no PYTHONPATH, so tome_core is imported from the install,
never from the source tree. The build runs on a copy of the working tree (`--no-isolation`, this
venv's setuptools), so it leaves no build/ or egg-info in the checkout.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

import tome_core

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
NAME = PYPROJECT["project"]["name"]
VERSION = PYPROJECT["project"]["version"]
STEM = f"{NAME.replace('-', '_')}-{VERSION}"  # file names of wheel and sdist (PEP 625/427)
# Not part of a build: environments, caches, build outputs (names at any depth).
NOT_SOURCE = shutil.ignore_patterns(".venv*", ".git", ".cache", "__pycache__", "build", "dist",
                                    "*.egg-info", "bench_out", "node_modules", ".pytest_cache")


def _run(cmd: list, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run with no PYTHONPATH, so only the interpreter's own sys.path decides what is imported."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def _source_modules() -> set[str]:
    """Every module file of tome_core (the engine and its host glue) and tome_bench (the benchmark) in the
    checkout, and the package data tome_core reads (what each family's default costs), as paths relative to the
    repository."""
    return {p.relative_to(REPO).as_posix() for package in ("tome_core", "tome_bench")
            for p in (REPO / package).rglob("*.py") if "__pycache__" not in p.parts} | {"tome_core/catalogue/quality.json"}


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The sdist, and the wheel build makes from that sdist (so the sdist must be complete)."""
    work = tmp_path_factory.mktemp("build")
    shutil.copytree(REPO, work / "src", ignore=NOT_SOURCE)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", work / "dist", work / "src"],
         cwd=work)
    built = sorted(p.name for p in (work / "dist").iterdir())
    assert built == [f"{STEM}-py3-none-any.whl", f"{STEM}.tar.gz"], built
    return {"wheel": work / "dist" / built[0], "sdist": work / "dist" / built[1]}


def _fresh_venv(path: Path) -> tuple[Path, Path]:
    """A venv without pip that sees this venv's site-packages (torch, diffusers) after its own."""
    _run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent)
    python = path / ("Scripts" if os.name == "nt" else "bin") / "python"
    own = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=path.parent).stdout.strip())
    (own / "borrowed_from_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, own


def _install(python: Path, *args) -> None:
    """This venv's pip installs into the fresh one (pip --python): offline, dependencies not fetched."""
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
          *args], cwd=python.parent)


def _installed(python: Path, cwd: Path) -> tuple[Path, str]:
    """Where that venv finds tome_core, and the installed distribution's version.

    find_spec locates the package without running it, so no torch import (seconds) per check.
    """
    out = _run([python, "-c", "import importlib.metadata as m, importlib.util as u, json; "
                f"print(json.dumps([u.find_spec('tome_core').origin, m.version('{NAME}')]))"],
               cwd=cwd)
    file, version = json.loads(out.stdout)
    return Path(file).resolve(), version


def test_version_is_the_pyprojects_and_a_static_semver():
    """ComfyUI-Manager reads `version` from pyproject.toml as text, so it is static X.Y.Z there."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION), VERSION
    assert "version" not in PYPROJECT["project"].get("dynamic", [])
    assert tome_core.__version__ == VERSION
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"## [{VERSION}]" in changelog


def test_comfy_registry_metadata():
    """The fields docs.comfy.org/registry/specifications documents, with their rules."""
    project, comfy = PYPROJECT["project"], PYPROJECT["tool"]["comfy"]
    # name: < 100 chars, alphanumerics and -_. only, no consecutive specials, starts with a letter,
    # and (their best practice) without "ComfyUI"; "tome" itself is an unrelated PyPI package.
    assert re.fullmatch(r"[A-Za-z](?:[A-Za-z0-9]|[-_.](?=[A-Za-z0-9]))*", NAME) and len(NAME) < 100
    assert "comfyui" not in NAME.lower() and NAME != "tome"
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert "Flux" in project["description"] and "SDXL" in project["description"]
    repository = project["urls"]["Repository"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", repository), repository
    assert comfy["PublisherId"] and comfy["DisplayName"]
    # Icon: a URL to a file shipped in this repository, SVG/PNG/JPG/GIF, square, at most 400 px.
    raw = repository.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"
    assert comfy["Icon"].startswith(raw), (comfy["Icon"], raw)
    icon = REPO / comfy["Icon"][len(raw):]
    assert icon.is_file() and icon.suffix == ".svg", icon
    svg = ET.parse(icon).getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    assert svg.get("width") == svg.get("height") and int(svg.get("width")) <= 400
    # ComfyUI registers a web folder named in [tool.comfy] web on top of WEB_DIRECTORY: none here.
    assert "web" not in comfy


def test_runtime_requirements_never_name_torch():
    """torch is the host's: neither the package nor requirements.txt (what hosts install) lists it."""
    assert PYPROJECT["project"]["dependencies"] == []
    lines = (REPO / "requirements.txt").read_text(encoding="utf-8").splitlines()
    assert not [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_wheel_holds_tome_core_tome_bench_and_their_metadata(dists):
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read(f"{STEM}.dist-info/METADATA").decode()
        entry_points = wheel.read(f"{STEM}.dist-info/entry_points.txt").decode()
    modules = {n for n in names if not n.startswith(f"{STEM}.dist-info/")}
    assert modules == _source_modules()  # every module, subpackages included, and nothing else
    assert {"tome_bench/cli.py", "tome_core/engine/kv.py"} <= modules
    assert f"{STEM}.dist-info/licenses/LICENSE" in names
    assert not [n for n in names if n.startswith(("tests/", ".venv", "nodes/", "scripts/", "web/"))]
    header = dict(line.split(": ", 1) for line in metadata.split("\n\n", 1)[0].splitlines())
    assert (header["Name"], header["Version"]) == (NAME, VERSION)
    assert header["Requires-Python"] == ">=3.10" and header["License-Expression"] == "MIT"
    unconditional = [line for line in metadata.splitlines()
                     if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert unconditional == []  # torch in particular: never pulled in by installing this
    assert "tome-bench = tome_bench.cli:main" in entry_points


def test_sdist_holds_the_source_and_no_environment(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "PKG-INFO"} <= names
    assert _source_modules() <= names
    assert not [n for n in names if n.startswith(("tests", ".venv", ".git", "build/"))]


def test_wheel_installs_into_a_fresh_venv_and_runs_the_benchmark(dists, tmp_path):
    python, site = _fresh_venv(tmp_path / "venv")
    _install(python, dists["wheel"])
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    file, version = _installed(python, outside)
    assert file.is_relative_to(site.resolve()) and not file.is_relative_to(REPO), file
    assert version == VERSION

    shown = _run([python, "-m", "tome_core", "bench", "--help"], cwd=outside)
    assert "usage: python -m tome_core bench" in shown.stdout
    bench = python.parent / ("tome-bench.exe" if os.name == "nt" else "tome-bench")
    _run([bench, "--tiny", "--families", "sd15", "--methods", "vanilla,merge,kv",
          "--no-progress", "--out", outside / "out"], cwd=outside)
    results = json.loads((outside / "out" / "results.json").read_text())
    rows = {row["method"]: row for row in results["rows"]}
    assert results["complete"] is True and set(rows) == {"vanilla", "merge", "kv"}
    # tome_core.__version__ as the installed run saw it: from the metadata, no pyproject.toml there
    assert results["environment"]["tome_core"] == VERSION
    assert rows["vanilla"]["rel_err"] == 0.0
    assert rows["merge"]["rel_err"] > 0 and rows["kv"]["rel_err"] > 0  # ToMe changed the output


def test_sdist_installs_into_a_fresh_venv(dists, tmp_path):
    python, site = _fresh_venv(tmp_path / "venv")
    _install(python, "--no-build-isolation", dists["sdist"])  # setuptools: the borrowed one
    file, version = _installed(python, tmp_path)
    assert file.is_relative_to(site.resolve()) and version == VERSION


def test_editable_install_of_a_checkout(tmp_path):
    """The README's `pip install -e ".[bench]"`, offline: tome_core found in the checkout."""
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO, checkout, ignore=NOT_SOURCE)
    python, _ = _fresh_venv(tmp_path / "venv")
    _install(python, "--no-build-isolation", "-e", f"{checkout}[bench]")
    file, version = _installed(python, tmp_path)
    assert file == (checkout / "tome_core" / "__init__.py").resolve() and version == VERSION
