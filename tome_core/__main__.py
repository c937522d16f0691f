"""``python -m tome_core``: what the package can do, and the ``bench`` subcommand."""
import sys

HELP = """\
usage: python -m tome_core <command> [options]

tome_core: Token Merging (ToMe) for diffusion models -- the portable engine (torch only) behind
the ComfyUI nodes and the WebUI extension. It reaches (tome_core/catalogue/families.py):
{unets}
{diffusers}
{comfy}

commands:
  bench        benchmark vanilla vs tome_core's merge/kv modes vs tomesd (UNets) or vanilla vs
               kv (Flux, SD3, Wan): time, speed-up with noise bands, output error, peak memory,
               attention kernel; CPU or CUDA, eager or torch.compile.
               'python -m tome_core bench --help' for options (also: tome-bench)

use it from Python (diffusers):
  import tome_core
  tome_core.apply_patch(pipe, ratio=0.5, mode="kv")   # its UNet or transformer; UNets: or "merge"
  ...                                                 # sample as usual
  tome_core.remove_patch(pipe)

use it in a host (see README.md):
  ComfyUI           this repository in ComfyUI/custom_nodes: the "ToMe (token merging)" and
                    "ToMe (advanced)" nodes patch a MODEL
  A1111 / Forge     this repository in the WebUI's extensions folder: the "ToMe" accordion
"""


def help_text() -> str:
    """The overview, its supported models read from the catalogue."""
    import textwrap

    from .catalogue.families import UNET_FAMILIES, titles

    def wrap(head: str, text: str) -> str:
        return textwrap.fill(text, 100, initial_indent=f"  {head:<17}", subsequent_indent=" " * 19,
                             break_on_hyphens=False)

    return HELP.format(
        unets=wrap("UNets", f"{', '.join(UNET_FAMILIES)}: mode \"merge\" (merge tokens through the transformer "
                            "blocks) or mode \"kv\" (attend to fewer keys/values)"),
        diffusers=wrap("DiTs, diffusers", f"mode \"kv\": {titles('diffusers')}"),
        comfy=wrap("DiTs, ComfyUI", f"mode \"kv\": {titles('comfy')}"))


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``bench``; print the overview for --help (exit 0) or no/unknown command (exit 2)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from tome_bench.cli import main as bench_main  # the benchmark package (same distribution)

        return bench_main(argv[1:])
    if argv and argv[0] in ("-h", "--help", "help"):
        print(help_text())
        return 0
    print(help_text(), file=sys.stderr)
    if argv:
        print(f"python -m tome_core: error: unknown command {argv[0]!r} (choose: bench)",
              file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
