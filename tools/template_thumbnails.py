"""The template browser's thumbnails (example_workflows/<name>.jpg), drawn from the templates themselves.

Each thumbnail names the model, the task and the setting the template runs: its ToMe node's mode and ratio, with
"model default" read through the catalogue (tome_core/catalogue/families.py) the way the node resolves it. The words
are also stored in the JPEG's comment, so a test (tests/test_templates.py) checks every thumbnail against what its
template runs today without reading pixels. Run after changing a template or a family's default:

    python tools/template_thumbnails.py          # rewrite every thumbnail
    python tools/template_thumbnails.py --check  # exit 1 naming each thumbnail whose words are stale
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "example_workflows"
sys.path.insert(0, str(REPO))

from tome_core.catalogue.families import BY_NAME, TOMESD_RATIO  # noqa: E402

MODEL_DEFAULT = -1.0  # nodes/tome_nodes.py MODEL_DEFAULT
SIZE = 256
# name -> (model title, task, catalogue family or None for a UNet, background colour)
TEMPLATES: Dict[str, Tuple[str, str, Optional[str], Tuple[int, int, int]]] = {
    "ToMe_SD15_basic": ("SD 1.5", "basic node", None, (40, 90, 159)),
    "ToMe_SD15_advanced": ("SD 1.5", "advanced node", None, (59, 70, 150)),
    "ToMe_SD15_compare": ("SD 1.5", "plain | ToMe, same seed", None, (40, 90, 159)),
    "ToMe_Flux1_dev": ("Flux.1 dev", "text to image", "flux", (30, 30, 30)),
    "ToMe_Qwen_Image": ("Qwen-Image", "text to image", "qwen_image", (109, 40, 149)),
    "ToMe_Z_Image_Turbo": ("Z-Image Turbo", "text to image", "z_image", (170, 80, 20)),
    "ToMe_Wan22_5B_t2v": ("Wan 2.2 5B", "text to video", "wan", (20, 110, 100)),
    "ToMe_WanVideoWrapper_T2V": ("Wan 2.1 T2V", "WanVideoWrapper", "wan", (20, 110, 100)),
    "ToMe_LTX2_t2v": ("LTX-2", "text to video + audio", "ltx2", (150, 29, 60)),
}
# Where each ToMe node keeps ratio, mode and max_downsample in widgets_values (None: the node has no such widget).
WIDGETS = {"TomeCoreToMe": (0, None, 1), "TomeCoreToMeAdvanced": (0, 6, 1), "TomeCoreToMeWanVideo": (0, 1, None)}


def tome_node(workflow: dict) -> dict:
    return next(node for node in workflow["nodes"] if node["type"] in WIDGETS)


def setting_words(name: str, workflow: dict) -> str:
    """What the template's ToMe node runs, e.g. "merge 0.625 (model default)" or "merge 0.6, 2 levels"."""
    family = TEMPLATES[name][2]
    node = tome_node(workflow)
    ratio_at, mode_at, depth_at = WIDGETS[node["type"]]
    values = node["widgets_values"]
    catalogue = BY_NAME[family] if family else None
    default_mode = catalogue.default_mode if catalogue else "merge"
    mode = values[mode_at] if mode_at is not None else default_mode
    ratio = float(values[ratio_at])
    if ratio == MODEL_DEFAULT:
        words = f"{mode} {catalogue.ratio_for(mode) if catalogue else TOMESD_RATIO:g} (model default)"
    else:
        words = f"{mode} {ratio:g}"
    depth = values[depth_at] if depth_at is not None and family is None else 1
    return words + (f", {depth} levels" if depth > 1 else "")


def words_of(name: str) -> List[str]:
    title, task, _, _ = TEMPLATES[name]
    workflow = json.loads((EXAMPLES / f"{name}.json").read_text(encoding="utf-8"))
    return [title, task, setting_words(name, workflow)]


def _font(size: int, bold: bool = False):
    from PIL import ImageFont

    for path in (f"/usr/share/fonts/truetype/dejavu/DejaVuSans{'-Bold' if bold else ''}.ttf",
                 f"DejaVuSans{'-Bold' if bold else ''}.ttf"):
        try:
            return ImageFont.truetype(path, size)
        except OSError:
            continue
    return ImageFont.load_default(size)


def _fitted(draw, text: str, size: int, bold: bool, width: int):
    while size > 9 and draw.textlength(text, font=_font(size, bold)) > width:
        size -= 1
    return _font(size, bold)


def draw(name: str):
    """The thumbnail: the top-left corner is left to the template browser's "Node graph" badge."""
    from PIL import Image, ImageDraw

    title, task, setting = words_of(name)
    colour = TEMPLATES[name][3]
    image = Image.new("RGB", (SIZE, SIZE), colour)
    pen = ImageDraw.Draw(image)
    cell, gap, left, top = 16, 4, SIZE - 4 * 20 - 12, 12  # ToMe's 4x4 grid, one kept token per 2x2 cell
    kept_at = {(0, 0): (0, 1), (0, 1): (1, 1), (1, 0): (1, 0), (1, 1): (0, 0)}  # (cell row, col) -> (row, col) in it
    for row in range(4):
        for col in range(4):
            x, y = left + col * (cell + gap), top + row * (cell + gap)
            kept = kept_at[(row // 2, col // 2)] == (row % 2, col % 2)
            pen.rectangle([x, y, x + cell, y + cell], outline="white", width=2, fill="white" if kept else None)
    pen.text((16, 52), "ToMe", fill="white", font=_font(30, True))
    pen.text((16, 112), title, fill="white", font=_fitted(pen, title, 30, True, SIZE - 32))
    pen.text((16, 156), task, fill=(235, 240, 245), font=_fitted(pen, task, 18, False, SIZE - 32))
    pen.text((16, 196), setting, fill=(215, 225, 235), font=_fitted(pen, setting, 16, False, SIZE - 32))
    return image


def comment_of(path: Path) -> str:
    from PIL import Image

    with Image.open(path) as image:
        comment = image.info.get("comment", b"")
    return comment.decode("utf-8") if isinstance(comment, bytes) else str(comment)


def stale() -> List[str]:
    """The thumbnails whose stored words are not what their template runs now."""
    return [name for name in TEMPLATES if comment_of(EXAMPLES / f"{name}.jpg") != " | ".join(words_of(name))]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale thumbnails")
    args = parser.parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            print(f"{name}.jpg is stale: run python tools/template_thumbnails.py")
        return 1 if names else 0
    for name in TEMPLATES:
        path = EXAMPLES / f"{name}.jpg"
        draw(name).save(path, "JPEG", quality=75, optimize=True, comment=" | ".join(words_of(name)).encode("utf-8"))
        print(f"{path.name}: {' | '.join(words_of(name))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
