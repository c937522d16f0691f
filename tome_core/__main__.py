"""``python -m tome_core bench [options]``: run the benchmark (``--help`` for options)."""
import sys

USAGE = "usage: python -m tome_core bench [--help] [options]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "bench":
        print(USAGE, file=sys.stderr)
        return 2
    from tome_core.bench.cli import main as bench_main

    return bench_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
