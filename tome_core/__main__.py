"""``python -m tome_core``: what the package can do, and the ``bench`` subcommand."""
import sys

HELP = """\
usage: python -m tome_core <command> [options]

tome_core: Token Merging (ToMe) for Stable Diffusion UNets (SD1.x, SD2.x, SDXL) -- the portable
engine (torch only) behind the ComfyUI node and the WebUI extension.

commands:
  bench        benchmark vanilla vs tome_core's merge/kv modes vs tomesd: time, speed-up with
               noise bands, output error, peak memory, attention kernel; CPU or CUDA, eager or
               torch.compile. 'python -m tome_core bench --help' for options (also: tome-bench)

use it from Python (diffusers):
  import tome_core
  tome_core.apply_patch(pipe.unet, ratio=0.5, mode="kv")   # or mode="merge"
  ...                                                      # sample as usual
  tome_core.remove_patch(pipe.unet)

use it in a host (see README.md):
  ComfyUI           this repository in ComfyUI/custom_nodes: the "ToMe (token merging)" and
                    "ToMe (advanced)" nodes patch a MODEL
  A1111 / Forge     this repository in the WebUI's extensions folder: the "ToMe" accordion
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``bench``; print the overview for --help (exit 0) or no/unknown command (exit 2)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from tome_core.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] in ("-h", "--help", "help"):
        print(HELP)
        return 0
    print(HELP, file=sys.stderr)
    if argv:
        print(f"python -m tome_core: error: unknown command {argv[0]!r} (choose: bench)",
              file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
