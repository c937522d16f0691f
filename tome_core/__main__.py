"""``python -m tome_core``: what the package can do, and the ``bench`` subcommand."""
import sys

HELP = """\
usage: python -m tome_core <command> [options]

tome_core: Token Merging (ToMe) for diffusion models -- the portable engine (torch only) behind
the ComfyUI nodes and the WebUI extension. It reaches (tome_core/catalogue/families.py):
{unets}
{diffusers}
{comfy}
{modes}

commands:
{bench}
             'python -m tome_core bench --help' for options (also: tome-bench)

use it from Python (diffusers):
  import tome_core
  tome_core.apply_patch(pipe, ratio=0.5)   # its UNet or transformer, in the family's default mode
  ...                                      # (mode="merge" or mode="kv" to choose); sample as usual
  tome_core.remove_patch(pipe)

use it in a host (see README.md):
  ComfyUI           this repository in ComfyUI/custom_nodes: the "ToMe" (token merging) and
                    "ToMe (advanced)" nodes patch a MODEL
  A1111 / Forge     this repository in the WebUI's extensions folder: the "ToMe" accordion
"""


def help_text() -> str:
    """The overview, its supported models read from the catalogue."""
    import textwrap

    from .catalogue.families import CATALOGUE, UNET_FAMILIES, mode_summary, modes_of, titles

    def wrap(head: str, text: str, width: int = 17) -> str:
        return textwrap.fill(text, 100, initial_indent=f"  {head:<{width}}", subsequent_indent=" " * (width + 2),
                             break_on_hyphens=False)

    return HELP.format(
        unets=wrap("UNets", f"{', '.join(UNET_FAMILIES)}: mode \"merge\" (default: merge tokens through the "
                            "transformer blocks) or mode \"kv\" (attend to fewer keys/values)"),
        diffusers=wrap("DiTs, diffusers", titles("diffusers")),
        comfy=wrap("DiTs, ComfyUI", titles("comfy")),
        modes=wrap("DiT modes", mode_summary()),
        bench=wrap("bench", "benchmark vanilla, tome_core's modes and tomesd on UNets (merge, kv and their variants), "
                            "and vanilla, kv and, where the family's diffusers classes take it, merge on DiTs ("
                            + ", ".join(f.name for f in CATALOGUE if "merge" in modes_of(f, "diffusers"))
                            + "): time, speed-up with noise bands, output error, peak memory, attention kernel; "
                              "CPU or CUDA, eager or torch.compile (UNets)", width=11))


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``bench``; print the overview for --help (exit 0) or no/unknown command (exit 2)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from tome_bench.cli import main as bench_main  # the benchmark package (same distribution)

        return bench_main(argv[1:])
    if argv and argv[0] == "compare":
        from .tools.compare import main as compare_main  # imports diffusers on use

        return compare_main(argv[1:])
    if argv and argv[0] in ("-h", "--help", "help"):
        print(help_text())
        return 0
    print(help_text(), file=sys.stderr)
    if argv:
        print(f"python -m tome_core: error: unknown command {argv[0]!r} (choose: bench, compare)",
              file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
