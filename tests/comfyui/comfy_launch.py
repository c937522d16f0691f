"""Start ComfyUI's own ``main.py`` the way a user does, in this process: ``python comfy_launch.py COMFY_DIR ARGS...``.

The only difference from ``python main.py ARGS...``: PyPI's torchvision (a CUDA build) cannot import
under the CPU torch (nor is there a torchaudio for it), so the stubs of ``comfy_env`` are installed first (ComfyUI imports
them at module level only for models these tests never run).
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_env  # noqa: E402

comfy_env.install_package_stubs()
comfy_dir = os.path.abspath(sys.argv[1])
main = os.path.join(comfy_dir, "main.py")
sys.argv = [main] + sys.argv[2:]
sys.path[0] = comfy_dir  # what `python main.py` puts first
runpy.run_path(main, run_name="__main__")
