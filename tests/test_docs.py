"""The texts users read agree with their one source: the catalogue for families and modes, docs/results for figures.

Lists and modes: the README's supported list, ``python -m tome_core --help``, ``bench --help`` and the ComfyUI
node texts are derived from ``tome_core/catalogue/families.py``; a statement in README or docs that a family takes
kv only must name a family without mode merge. Figures: every README table under a ``<!-- results: ... -->``
marker is read cell by cell and compared with the JSON it names, which names its device and commit.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tome_core.catalogue.families import (BY_NAME, CATALOGUE, default_modes, markdown_list, merging, mode_summary,
                                          modes_of, short_title)

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_readme_list_is_the_catalogues():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- catalogue: .*? -->\n(.*?)<!-- /catalogue -->", readme, re.S)
    assert block and block.group(1) == markdown_list()


def test_the_mode_summary_says_what_the_catalogue_holds():
    text = mode_summary()
    parts = text.split(";")
    defaults, also = parts[0], parts[1] if len(parts) == 3 else ""  # no "also" clause where every merger defaults to it
    for family in CATALOGUE:
        title = short_title(family)
        if "merge" not in modes_of(family):
            assert title not in text, title  # named only among the families that take merge
        elif family.default_mode == "merge":
            assert title in defaults, title
        else:
            assert title in also, title
    assert merging("merge") and all(f.default_mode == "merge" for f in merging("merge"))


def test_both_help_texts_are_derived_from_the_catalogue():
    run = lambda *a: subprocess.run([sys.executable, "-m", "tome_core", *a], cwd=REPO, capture_output=True,
                                    text=True, timeout=120)
    overview = _flat(run("--help").stdout)
    assert _flat(mode_summary()) in overview
    from tome_bench.dit_runner import DIT_FAMILIES, methods_for, methods_text

    bench = _flat(run("bench", "--help").stdout)
    assert _flat(methods_text()) in bench
    merge_list = re.search(r"merge on DiTs \(([^)]*)\)", overview).group(1).split(", ")
    assert merge_list == [f.name for f in CATALOGUE if "merge" in modes_of(f, "diffusers")]
    for name in DIT_FAMILIES:  # the bench runs merge exactly where the family's diffusers classes take it
        assert ("merge" in methods_for(name)) == ("merge" in modes_of(BY_NAME[name], "diffusers")), name
        assert ("merge" in methods_for(name)) == (name in merge_list), name
    for stale in ("kv only", "vanilla,kv only", "vanilla vs mode kv", "under 8 minutes", "flux,sd3,wan:"):
        assert stale not in bench and stale not in overview, stale


def test_the_node_texts_are_derived_from_the_catalogue():
    sys.path.insert(0, str(REPO))
    try:
        from nodes.tome_nodes import ADVANCED_INPUTS, MODEL_INPUT, ToMe
    finally:
        sys.path.remove(str(REPO))
    assert default_modes() in ToMe.DESCRIPTION and "\n" not in ToMe.DESCRIPTION
    assert mode_summary() in MODEL_INPUT[1]["tooltip"]
    mode_tip = ADVANCED_INPUTS["mode"][1]["tooltip"]
    assert all(short_title(family) in mode_tip for family in merging())
    assert not any(short_title(family) in mode_tip for family in CATALOGUE if family not in merging())


# A statement that some families take kv only: "<titles> take(s) mode kv only", "kv only on <titles>", ...
KV_ONLY = re.compile(r"((?:[^.;:\n]|\.(?=\d))*?)\b(?:take|takes|run|runs)\s+(?:`?mode=?\"?kv\"?`?|kv)\s+only|"
                     r"\bkv only\b([^.;\n]*)", re.I)


def test_no_doc_says_kv_only_of_a_family_that_takes_merge():
    """Every 'kv only' sentence in README and docs names no family the catalogue gives mode merge."""
    merge_names = {short_title(f).split(" ")[0] for f in merging()} | {f.name for f in merging()}  # Wan, wan
    bad = []
    for path in DOCS:
        for match in KV_ONLY.finditer(path.read_text(encoding="utf-8")):
            said = match.group(1) or match.group(2) or ""
            for name in merge_names:
                if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", said, re.I):
                    bad.append(f"{path.name}: {name!r} in {match.group(0).strip()!r}")
    assert not bad, "\n".join(bad)


def test_every_results_table_is_its_jsons_figures():
    """Each table under a results marker, in README and docs, equals the table written again from its JSONs."""
    from tome_bench import doc_tables

    marked = 0
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in doc_tables.BLOCK.finditer(text):
            marked += 1
            for name in match.group(2).split():
                result = json.loads((REPO / name).read_text(encoding="utf-8"))
                assert result.get("device") and result.get("commit"), name
            assert doc_tables.render(match.group(2).split(), match.group(3)) == match.group(3), \
                f"{path.name}: regenerate with python -m tome_bench.doc_tables {path.relative_to(REPO)}"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(doc_tables.BLOCK.findall(readme)) == 3 and marked >= 4  # README: two GPU tables, one CPU table


def test_every_frontier_table_is_its_jsons():
    """Each frontier table (each family's ratio at tomesd's quality) in README and docs equals the table written again
    from the frontier JSON it names, which names its device and commit."""
    from tome_bench.experiments import frontier

    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in frontier.BLOCK.finditer(text):
            result = json.loads((REPO / match.group(2).strip()).read_text(encoding="utf-8"))
            assert result.get("device") and result.get("commit"), match.group(2)
            assert match.group(3) == frontier.summary_table(result) + "\n", \
                f"{path.name}: regenerate with python -m tome_bench.experiments.frontier --docs {match.group(2)} " \
                f"{path.relative_to(REPO)}"


def test_every_step_cache_table_is_its_jsons():
    """Each step-cache table (the pairs of a cache and ToMe) in README and docs equals the table written again from the
    JSON it names, which names its device and commit."""
    from tome_bench.experiments import step_caches

    found = 0
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in step_caches.BLOCK.finditer(text):
            found += 1
            result = json.loads((REPO / match.group(3).strip()).read_text(encoding="utf-8"))
            assert result.get("device") and result.get("commit"), match.group(3)
        assert step_caches.rewrite_docs(text, REPO) == text, \
            f"{path.name}: regenerate with python -m tome_bench.experiments.step_caches --docs {path.relative_to(REPO)}"
    assert found >= 3  # README's best pairs; docs/STEP_CACHES.md's best pairs and every row


def test_a_changed_figure_is_caught(tmp_path):
    from tome_bench import doc_tables

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = doc_tables.BLOCK.search(readme)
    changed = block.group(3).replace("×", "1×", 1)  # one figure off
    assert doc_tables.render(block.group(2).split(), changed) != changed


def test_every_result_names_its_device_and_commit():
    for path in sorted((REPO / "docs" / "results").glob("*.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        assert result.get("device") and re.fullmatch(r"[0-9a-f]{7,40}", result.get("commit") or ""), path.name


def test_the_readme_is_short_and_its_links_resolve():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 400
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if not target.startswith("http"):
                assert (path.parent / target).exists(), f"{path.name}: {target}"


def test_no_hand_written_test_counts():
    """Test counts go stale with every test added: README and docs give none."""
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\b\d+ (?:passed|skipped|failed)\b|\b\d{2,} tests\b", text), path.name


def test_every_node_tooltip_is_short_enough_to_read():
    """A tooltip says what the input does, its safe range and default in at most ~300 characters; the reasoning lives
    in the node's help page (web/docs/<node id>.md), which every tooltip that says "More" has."""
    sys.path.insert(0, str(REPO))
    try:
        from nodes.tome_nodes import ToMe, ToMeAdvanced
        from nodes.tome_wanvideo import ToMeWanVideo
    finally:
        sys.path.remove(str(REPO))
    for node in (ToMe, ToMeAdvanced, ToMeWanVideo):
        for name, (_, options) in node.spec().items():
            tip = options.get("tooltip", "")
            assert tip and len(tip) <= 300 and "\n" not in tip, (node.NODE_ID, name, len(tip))
            for internal in ("docs/results", ".json", "tomesd's error", "saves 1.1x"):
                assert internal not in tip, (node.NODE_ID, name, internal)
        assert (REPO / "web" / "docs" / f"{node.NODE_ID}.md").is_file(), node.NODE_ID
        assert len(node.DESCRIPTION) <= 400 and node.SEARCH_ALIASES, node.NODE_ID
