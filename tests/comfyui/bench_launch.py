"""``python -m tome_core bench`` in a ComfyUI test environment: ``python bench_launch.py BENCH_ARGS...``.

The only difference from ``python -m tome_core bench BENCH_ARGS...``: PyPI's torchvision (a CUDA build) cannot import
under the CPU torch, so the stubs of ``comfy_env`` are installed first, as ``comfy_launch.py`` does for the server
(ComfyUI's model_base imports torchvision at module level for models the bench never builds). Used by
test_comfy_bench_host.py and by the CPU smoke run of tools/gpu_suite.sh (``TOME_COMFY_PYTHON``).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))  # the checkout: tome_core, tome_bench, nodes
import comfy_env  # noqa: E402

comfy_env.install_package_stubs()
from tome_bench.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
