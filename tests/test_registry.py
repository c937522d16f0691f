"""Where ComfyUI users get the pack: the Comfy registry's node archive and ComfyUI-Manager's missing-node lookup.

The archive is built and pyproject.toml parsed by comfy-cli's own code (``comfy_cli.file_utils.zip_files``,
``comfy_cli.registry.config_parser.extract_node_configuration``; comfy-cli 1.23.0 from PyPI, installed by
tests/run.sh). ComfyUI-Manager's scanner is not on PyPI: ``manager_scan`` mirrors the rules of its
``scanner.py`` (Comfy-Org/ComfyUI-Manager f39cbd5, SCANNER_VERSION 2.0.13: ``extract_nodes`` phase 1,
the ``_CLASS_MAPPINGS = {...}`` regex of ``extract_nodes_from_repo`` and ``node_list.json`` in ``gen_json``).
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NODE_IDS = {"TomeCoreToMe", "TomeCoreToMeAdvanced"}  # the MODEL nodes (nodes/tome_nodes.py)
LISTED_IDS = NODE_IDS | {"TomeCoreToMeWanVideo"}  # what the pack registers, and ComfyUI-Manager maps to it
PRODUCT = ["__init__.py", "nodes/tome_nodes.py", "nodes/tome_v3.py", "web/tome.js", "tome_core/engine/merge.py",
           "tome_core/catalogue/families.py", "tome_core/adapters/model_patcher/dit.py",
           "tome_core/tools/compare/command.py", "README.md", "LICENSE",
           "pyproject.toml", "node_list.json", "example_workflows/ToMe_SD15_basic.json"]
LEFT_OUT = ("tests/", "docs/results/", "tome_bench/", "tools/", ".ci/", "scripts/", "tome_webui/", "install.py")


@pytest.fixture(scope="module")
def comfy_cli():
    pytest.importorskip("comfy_cli.file_utils", reason="comfy-cli (tests/run.sh installs it)")
    import comfy_cli.file_utils
    import comfy_cli.registry.config_parser

    return comfy_cli


@pytest.fixture(scope="module")
def archive(comfy_cli, tmp_path_factory):
    """node.zip as ``comfy node pack`` builds it in the repository (git-tracked files minus .comfyignore)."""
    if subprocess.run(["git", "-C", str(REPO), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout: comfy-cli would zip every file")
    config = comfy_cli.registry.config_parser.extract_node_configuration(str(REPO / "pyproject.toml"))
    target = tmp_path_factory.mktemp("registry") / "node.zip"
    with contextlib.chdir(REPO):
        comfy_cli.file_utils.zip_files(str(target), includes=config.tool_comfy.includes)
    return target


def test_pyproject_parses_without_warnings(comfy_cli):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        config = comfy_cli.registry.config_parser.extract_node_configuration(str(REPO / "pyproject.toml"))
    assert "Warning" not in out.getvalue(), out.getvalue()
    project, comfy = config.project, config.tool_comfy
    assert project.name == "tome-diffusion" and project.version and project.license.text == "MIT"
    assert project.supported_comfyui_version == ">=0.0.1"  # validated by comfy-cli's version pattern
    assert comfy.publisher_id and comfy.display_name and comfy.icon.endswith("docs/icon.svg")


def test_the_node_archive_holds_the_product_only(archive):
    names = zipfile.ZipFile(archive).namelist()
    missing = [name for name in PRODUCT if name not in names]
    assert not missing, missing
    stray = [name for name in names if name.startswith(LEFT_OUT)]
    assert not stray, stray[:10]
    assert all(name.startswith(("nodes/", "web/", "tome_core/", "example_workflows/", "docs/")) or "/" not in name
               for name in names), names
    assert archive.stat().st_size < 500_000, archive.stat().st_size  # the product: 0.48 MB; the whole repository: 2 MB


def test_the_archive_loads_as_a_comfyui_custom_node(archive, tmp_path):
    """Unpacked as the registry installs it (custom_nodes/<id>), imported as ComfyUI's load_custom_node does (its
    module named after the folder's path): the nodes are there without anything the archive leaves out."""
    folder = tmp_path / "custom_nodes" / "tome-diffusion"
    zipfile.ZipFile(archive).extractall(folder)
    code = (
        "import importlib.util, json, sys\n"
        f"path = {str(folder)!r}\n"
        "spec = importlib.util.spec_from_file_location(path.replace('.', '_x_'), path + '/__init__.py')\n"
        "module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "print(json.dumps(sorted(module.NODE_CLASS_MAPPINGS)))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert set(json.loads(result.stdout.splitlines()[-1])) == LISTED_IDS  # the WanVideoWrapper node with the rest


def manager_scan(root: Path) -> set:
    """The node ids ComfyUI-Manager's scanner finds in a pack: module-level ``NODE_CLASS_MAPPINGS``/``NODE_CONFIG``
    literal dicts (scanner.py ``extract_nodes``), any ``..._CLASS_MAPPINGS = {...}`` literal (the regex of
    ``extract_nodes_from_repo``), and the keys of a root ``node_list.json`` (``gen_json``)."""
    found = set()
    pattern = re.compile(r"_CLASS_MAPPINGS\s*(?::\s*\w+\s*)?=\s*(?:\\\s*)?{([^}]*)}", re.MULTILINE | re.DOTALL)
    for path in root.rglob("*.py"):
        if "__pycache__" in path.parts or any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        code = path.read_text(encoding="utf-8", errors="ignore")
        try:
            tree = ast.parse(re.sub(r'\\[^"\']', "", code))
        except SyntaxError:
            tree = None
        for node in getattr(tree, "body", ()):
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(target, ast.Name) and target.id in ("NODE_CONFIG", "NODE_CLASS_MAPPINGS") and \
                    isinstance(node.value, ast.Dict):
                found |= {key.value.strip() for key in node.value.keys
                          if isinstance(key, ast.Constant) and isinstance(key.value, str)}
                break
        for match in pattern.finditer(code):
            body = match.group(1)
            found |= {key.strip() for key, _ in re.findall(r"\"([^\"]*)\"\s*:\s*([^,\n]*)", body)}
            found |= {key.strip() for key, _ in re.findall(r"'([^']*)'\s*:\s*([^,\n]*)", body)}
    listed = root / "node_list.json"
    if listed.is_file():
        found |= {name.strip() for name in json.loads(listed.read_text())}
    return found


def test_manager_finds_exactly_our_nodes_in_the_repository_and_the_archive(archive, tmp_path):
    """"Install Missing Custom Nodes" maps a shared workflow's TomeCoreToMe / TomeCoreToMeAdvanced /
    TomeCoreToMeWanVideo to this pack, and nothing else (the test suite's own nodes are not offered as the pack's)."""
    from nodes.tome_nodes import NODE_CLASS_MAPPINGS, ToMe, ToMeAdvanced
    from nodes.tome_wanvideo import ToMeWanVideo

    assert {ToMe.NODE_ID, ToMeAdvanced.NODE_ID} == set(NODE_CLASS_MAPPINGS) == NODE_IDS
    assert manager_scan(REPO) == LISTED_IDS == NODE_IDS | {ToMeWanVideo.NODE_ID}  # the scanner clones the repository
    unpacked = tmp_path / "pack"
    zipfile.ZipFile(archive).extractall(unpacked)
    assert manager_scan(unpacked) == LISTED_IDS
