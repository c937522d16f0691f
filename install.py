"""Install what requirements.txt lists and the environment lacks; nothing else, never torch.

Host-neutral and idempotent: the AUTOMATIC1111/Forge WebUI runs this file at every start with its
``launch`` module importable (then the WebUI's own pip wrapper is used); ComfyUI-Manager runs it
with plain Python (then ``python -m pip``). Already-installed packages are left alone (no upgrades).
"""
from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
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


def pip_install(requirement: str) -> None:
    try:
        import launch  # the WebUI's launcher: its run_pip honours the WebUI's pip settings
    except ImportError:
        launch = None
    if launch is not None and hasattr(launch, "run_pip"):
        launch.run_pip(f'install "{requirement}"', f"ToMe requirement: {requirement}")
    else:
        subprocess.check_call([sys.executable, "-m", "pip", "install", requirement])


def main(path: Path = REQUIREMENTS) -> list[str]:
    """Install the missing requirements; returns what was installed."""
    missing = missing_requirements(requirement_lines(path))
    if not missing:
        print("[ToMe] install.py: all requirements are met; nothing to install.")
        return []
    for requirement in missing:
        print(f"[ToMe] install.py: installing {requirement}")
        pip_install(requirement)
    print(f"[ToMe] install.py: installed {', '.join(missing)}.")
    return missing


if __name__ == "__main__":
    main()
