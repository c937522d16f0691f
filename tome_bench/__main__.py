"""``python -m tome_bench``: the benchmark, as ``python -m tome_core bench`` and ``tome-bench``."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
