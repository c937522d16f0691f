"""The one catalogue of model families: its shape, and that what is derived from it agrees with it."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tome_core.catalogue import comfy_lookup, diffusers_lookup
from tome_core.catalogue.families import BY_NAME, CATALOGUE, family_of_binding, markdown_list, titles

REPO = Path(__file__).resolve().parents[2]


def test_one_entry_per_family_and_every_binding_in_exactly_one():
    names = [family.name for family in CATALOGUE]
    assert len(names) == len(set(names)) and all(re.fullmatch(r"[a-z0-9_]+", n) for n in names)
    for host in ("diffusers", "comfy"):
        bindings = [binding for family in CATALOGUE for binding in getattr(family, host)]
        assert len({b.name for b in bindings}) == len(bindings), host  # one binding name per host
        classes = [cls for b in bindings for cls in b.classes]
        assert len(classes) == len(set(classes)), host  # a class is bound once
        assert all(family_of_binding(b).name for b in bindings)
    assert all(family.diffusers or family.comfy for family in CATALOGUE)
    invocations = [d.invocation for family in CATALOGUE for d in family.invoke]
    assert len(invocations) == len(set(invocations))  # one family per InvokeAI denoise invocation


def test_invokeai_merge_follows_the_class_it_loads():
    """An InvokeAI denoise invocation on a diffusers class takes mode merge exactly where that class's diffusers
    binding does (InvokeAI loads the class itself); on InvokeAI's own FLUX class, mode kv only."""
    classes = {"flux2_denoise": "flux2", "qwen_image_denoise": "qwen_image", "sd3_denoise": "sd3",
               "z_image_denoise": "z_image", "wan_denoise": "wan", "wan_video_denoise": "wan", "krea2_denoise": "krea2"}
    for family in CATALOGUE:
        for denoise in family.invoke:
            if denoise.own is not None:
                assert not denoise.merges and denoise.own.merge is None
                continue
            binding = diffusers_lookup.binding_named(classes[denoise.invocation])
            assert denoise.merges == (binding.merge is not None), denoise.invocation
    assert all(family.grid_dims in (2, 3) for family in CATALOGUE)


def test_the_hosts_lookups_read_the_catalogue():
    own = tuple(d.own for f in CATALOGUE for d in f.invoke if d.own is not None)  # InvokeAI's own classes
    assert diffusers_lookup.bindings() == tuple(b for f in CATALOGUE for b in f.diffusers) + own
    assert diffusers_lookup.by_class()["invokeai.backend.flux.model.Flux"] is BY_NAME["flux"].invoke[0].own
    assert comfy_lookup.binding_named("ltx2") in BY_NAME["ltx2"].comfy  # one name: was "ltxav" in ComfyUI's table
    assert comfy_lookup.binding_named("ltx_video") in BY_NAME["ltx_video"].comfy  # was "ltxv"
    listed = comfy_lookup.supported_names()
    assert all((family.title in listed) == bool(family.comfy) for family in CATALOGUE)


def test_the_readme_list_is_the_catalogues():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- catalogue: .*? -->\n(.*?)<!-- /catalogue -->", readme, re.S)
    assert block and block.group(1) == markdown_list(), "regenerate: python -c 'from tome_core.catalogue.families " \
                                                        "import markdown_list; print(markdown_list())'"


def test_the_help_text_names_every_family():
    shown = subprocess.run([sys.executable, "-m", "tome_core", "--help"], cwd=REPO, capture_output=True, text=True,
                           timeout=60).stdout
    flat = " ".join(shown.split())
    for family in CATALOGUE:
        assert family.title in flat, family.title
    assert titles("diffusers") in flat and titles("comfy") in flat


def test_the_benchmarks_families_are_catalogue_families():
    from tome_bench.dit_models import DIT_FAMILIES, FAMILY_ALIASES
    from tome_bench.dit_runner import DEFAULT_SIZES

    for name in DIT_FAMILIES:
        assert BY_NAME[name].diffusers, name  # the benchmark builds diffusers models
        assert DEFAULT_SIZES[name] == BY_NAME[name].native_px
    assert set(FAMILY_ALIASES.values()) <= set(DIT_FAMILIES)


def test_the_invokeai_docs_list_each_node_with_the_catalogues_modes_and_defaults():
    """docs/INVOKEAI.md's node table: one row per InvokeAI denoise invocation of the catalogue (plus SD's), with the
    modes its class takes and what "model default" runs (``catalogue.defaults``, the rule every host uses)."""
    from tome_core.catalogue.defaults import ModelDefaults
    doc = (REPO / "docs" / "INVOKEAI.md").read_text(encoding="utf-8")
    table = re.search(r"<!-- invokeai nodes -->\n(.*?)<!-- /invokeai nodes -->", doc, re.S).group(1)
    rows = {re.search(r"\(`tome_(\w+)`\)", line).group(1): [cell.strip() for cell in line.split("|")[1:-1]]
            for line in table.splitlines()[2:]}
    wanted = {d.invocation: (family, d) for family in CATALOGUE for d in family.invoke}
    assert set(rows) == set(wanted) | {"denoise_latents"}
    assert rows["denoise_latents"][3:] == ["merge, kv", "merge 0.5 (tomesd's)"]
    for invocation, (family, denoise) in wanted.items():
        defaults = ModelDefaults(family, denoise.merges)
        modes, default = rows[invocation][3], rows[invocation][4]
        assert modes == ("merge, kv" if denoise.merges else "kv"), invocation
        assert default.startswith(f"{defaults.mode} {defaults.ratio(defaults.mode):g}"), invocation
        assert rows[invocation][1] == f"`{invocation}`"
