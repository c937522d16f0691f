"""Start InvokeAI's web server (``invokeai-web``) with torchvision guarded (see torchvision_guard).

Run with .venv-invoke's python: ``python invoke_launch.py [invokeai-web arguments]``; INVOKEAI_ROOT names the root.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchvision_guard  # noqa: E402

torchvision_guard.install()
sys.path.pop(0)  # keep the tests folder off the server's import path

from invokeai.app.run_app import run_app  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "invokeai-web"
    sys.exit(run_app())
