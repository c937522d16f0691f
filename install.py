"""The WebUI's install hook: install what requirements.txt lists and the WebUI lacks; nothing else, never torch.

The AUTOMATIC1111/Forge WebUI runs this file at every start with its ``launch`` module importable, and it
installs through the WebUI's own pip wrapper (``launch.run_pip``). Anywhere else it does nothing and says
so: ComfyUI-Manager also runs a pack's install.py, but it installs requirements.txt itself, and the Comfy
registry's standards discourage a pack running pip. Idempotent: installed packages are left alone.
"""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parent / "requirements.txt"
# The host owns these: a pip resolve here could replace its CUDA build.
NEVER_INSTALL = {"torch", "torchvision", "torchaudio", "xformers"}
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_lines(path: Path = REQUIREMENTS) -> list[str]:
    """The requirement specifiers in ``path`` (comments, blank lines and pip options dropped)."""
    if not path.is_file():
        return []
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def distribution_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"install.py: cannot read a package name from requirement {requirement!r}.")
    return match.group(1)


def is_installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_requirements(lines: list[str]) -> list[str]:
    return [
        line for line in lines
        if distribution_name(line).lower() not in NEVER_INSTALL and not is_installed(distribution_name(line))
    ]


def webui_launcher():
    """The WebUI's ``launch`` module (its run_pip honours the WebUI's pip settings), or None outside the WebUI."""
    try:
        import launch
    except ImportError:
        return None
    return launch if hasattr(launch, "run_pip") else None


def main(path: Path = REQUIREMENTS) -> list[str]:
    """In the WebUI, install the missing requirements; returns what was installed (elsewhere nothing)."""
    launch = webui_launcher()
    if launch is None:
        print("[ToMe] install.py: not run by the WebUI, so nothing to install here (ComfyUI-Manager installs "
              "requirements.txt itself; this file is the WebUI's install hook).")
        return []
    missing = missing_requirements(requirement_lines(path))
    if not missing:
        print("[ToMe] install.py: all requirements are met; nothing to install.")
        return []
    for requirement in missing:
        print(f"[ToMe] install.py: installing {requirement}")
        launch.run_pip(f'install "{requirement}"', f"ToMe requirement: {requirement}")
    print(f"[ToMe] install.py: installed {', '.join(missing)}.")
    return missing


if __name__ == "__main__":
    main()
