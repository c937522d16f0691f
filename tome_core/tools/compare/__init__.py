"""``python -m tome_core compare``: an A/B of plain against ToMe settings on the user's own diffusers pipeline.

command: the command line, the renders and the report; images: PSNR, SSIM and the labelled grid; load: the user's
pipeline from a local folder or a single-file checkpoint. diffusers, Pillow and tqdm are imported on use.
"""
from .command import main, parse_setting
from .load import CompareError

__all__ = ["CompareError", "main", "parse_setting"]
