"""The step-cache experiment (``python -m tome_bench.experiments.step_caches``): vanilla, the cache alone, ToMe alone
and both, through whole sampling loops, on the tests' tiny models (the path and the figures' meaning, not speed)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from tome_bench.experiments import step_caches  # noqa: E402


def test_each_family_gets_every_setting_with_steps_errors_and_bands():
    out = step_caches.main(["--tiny", "--rounds", "1", "--families", "flux,z_image", "--caches",
                            "fbc,taylorseer_lite", "--out", ""])
    found = {r["family"]: r for r in out["results"]}
    assert set(found) == {"flux", "z_image"}
    for family in ("flux",):
        rows = {row["setting"]: row for row in found[family]["rows"]}
        assert set(rows) == {"vanilla", "tome", "fbc", "fbc+tome", "taylorseer_lite", "taylorseer_lite+tome"}
        assert rows["vanilla"]["error"] == 0 and rows["vanilla"]["steps_computed"] == 8
        assert rows["tome"]["steps_computed"] == 8 and rows["tome"]["error"] > 0
        for cache in ("fbc", "taylorseer_lite"):
            alone, both = rows[cache], rows[f"{cache}+tome"]
            assert alone["steps_computed"] < 8 and both["steps_computed"] == alone["steps_computed"]
            assert both["error"] != alone["error"] and both["finite"]
        assert rows["fbc"]["threshold"] in step_caches.THRESHOLDS  # calibrated: alone it skips some steps
        for row in rows.values():
            low, high = row["band"]
            assert low <= row["speedup"] <= high and row["wall_s"] > 0
    # diffusers offers no cache on Z-Image's class: said, not silently left out
    assert found["z_image"]["not_run"] and all("enable_cache" in why for why in found["z_image"]["not_run"].values())
    table = step_caches.table(out["results"])
    assert "FirstBlockCache (diffusers)" in table and "not run" in table
    summary = step_caches.summary_table(dict(out, results=out["results"]))
    assert summary.count("\n") == 2 + 1 and "+ ToMe" in summary  # one best pair for each family that has one


def test_a_cache_failing_by_itself_is_said_not_run():
    """diffusers 0.42.1's FirstBlockCache has no block metadata for LTX-2: the table says it fails by itself."""
    out = step_caches.main(["--tiny", "--rounds", "1", "--families", "ltx2", "--caches", "fbc", "--out", ""])
    why = out["results"][0]["not_run"]["FirstBlockCache (diffusers)"]
    assert why.startswith("fails by itself on LTX2VideoTransformer3DModel")


def test_narrow_models_keep_the_released_head_width():
    model = step_caches.build_model("flux", 1, "narrow", torch.float32)
    attention = model.transformer_blocks[0].attn
    assert attention.heads == step_caches.NARROW_HEADS and model.inner_dim == step_caches.NARROW_HEADS * 128
