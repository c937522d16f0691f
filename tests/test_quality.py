"""Each family's default is the frontier's rule on the committed run, and every text that shows the trade reads it.

``tome_core/catalogue/quality.json`` is written by ``python -m tome_bench.experiments.frontier --quality JSON`` from a
committed frontier run; these tests fail when it, the catalogue's defaults, the README's table or the texts shown where
users pick the ratio (ComfyUI tooltips, the WebUI accordion, the bench's --help, ``describe()``) drift from that run."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tome_bench.experiments import frontier
from tome_core.catalogue import quality
from tome_core.catalogue.families import BY_NAME, CATALOGUE, TOMESD_RATIO, modes_of

REPO = Path(__file__).resolve().parents[1]
DATA = quality.load()


def test_the_summary_is_its_frontier_runs():
    """quality.json is the frontier run it names, summarised again: no figure in it is written by hand."""
    source = REPO / DATA["source"]
    result = json.loads(source.read_text(encoding="utf-8"))
    assert result["complete"] and result["settings"]["dtype"] == "fp32"
    assert frontier.quality_summary(result, DATA["source"]) == DATA
    assert DATA["families"], "no family measured"


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_each_catalogue_default_is_the_rule_on_its_deepest_run(name):
    """The catalogue's default mode and ratio are the rule's (the fastest setting at or under tomesd's error that saves
    work, else the closest under it) on the family's deepest run; a family not measured keeps tomesd's 0.5."""
    family, entry = BY_NAME[name], DATA["families"].get(name)
    if entry is None:
        assert family.default_ratio == TOMESD_RATIO
        return
    result = json.loads((REPO / DATA["source"]).read_text(encoding="utf-8"))
    rows = [r for r in result["rows"] if r["family"] == name and r.get("blocks") == entry["blocks"]]
    assert entry["default"] == frontier.default_setting(rows, result["yardstick"])
    assert (family.default_mode, family.default_ratio) == (entry["default"]["mode"], entry["default"]["ratio"])
    assert family.default_mode in modes_of(family)
    deepest = max(int(n) for r in result["rows"] if r["family"] == name for n in [sum(map(int, r["blocks"].split("+")))])
    assert sum(map(int, entry["blocks"].split("+"))) == deepest


def test_the_trade_sentences_read_the_summary():
    """Each measured family's sentence gives its default and the next setting as multiples of tomesd's error,
    computed from the summary, and says plainly where nothing both holds the yardstick and saves work."""
    yard = DATA["yardstick"]
    for name, entry in DATA["families"].items():
        text = quality.trade(name)
        default = entry["default"]
        times = max(default["errors"][c] / yard[c] for c in ("noise", "photo"))
        assert f"default {default['mode']} {default['ratio']:g} ({times:.2f}x tomesd's error)" in text
        assert ("Loses quality fast" in text) == (not default["holds_and_saves"]) == quality.loses_quality_fast(name)
        more = quality.higher(name)
        if more is not None:
            assert f"{more['mode']} {more['ratio']:g}: {max(more['errors'][c] / yard[c] for c in ('noise', 'photo')):.2f}x" in text
    assert quality.trade("not_a_family") is None


def test_the_texts_where_the_ratio_is_picked_carry_it():
    """The WebUI accordion's ratio info and the bench's --help hold every measured family's sentence (the ComfyUI
    nodes' short tooltips point to their help pages, which hold the table: below)."""
    from tome_bench.cli import build_parser as _parser
    from tome_webui.ui import RATIO_INFO

    summary = quality.trade_summary()
    assert summary and all(quality.trade(name) in summary for name in DATA["families"])
    assert summary in RATIO_INFO
    help_text = re.sub(r"\s+", " ", _parser().format_help())
    assert all(quality.trade(name) in help_text for name in DATA["families"])


def test_the_readme_defaults_table_is_the_summarys():
    """README's defaults table is written from the catalogue and the summary (python -m tome_bench.experiments.frontier
    --docs), and names the run it comes from."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = frontier.DEFAULTS_BLOCK.search(text)
    assert match, "README.md has no <!-- defaults --> block"
    assert match.group(2) == quality.defaults_table() + "\n"
    assert DATA["source"] in text
    for family in CATALOGUE:
        assert f"| {family.title.split(' (')[0]} | {family.default_mode} {family.default_ratio:g}" in match.group(2)


def test_describe_and_the_comfyui_plan_say_it():
    """describe() on a patched diffusers transformer, and the ComfyUI plan's description (what the node draws), end
    with the family's sentence."""
    from test_dit_diffusers import flux
    from tome_core import apply_patch, describe

    model, _, _ = flux()
    apply_patch(model)
    said = quality.trade("flux", "Flux")
    assert said and describe(model).splitlines()[-1] == said + "."


def test_the_nodes_help_pages_carry_the_defaults_table():
    """The ComfyUI nodes' help pages (web/docs/<node id>.md, which the 2026 frontend shows for a node) hold the same
    defaults table as the README, the long reasoning the ratio tooltip points to."""
    for name in ("TomeCoreToMe", "TomeCoreToMeAdvanced", "TomeCoreToMeWanVideo"):
        match = frontier.DEFAULTS_BLOCK.search((REPO / "web" / "docs" / f"{name}.md").read_text(encoding="utf-8"))
        assert match and match.group(2) == quality.defaults_table() + "\n", name
