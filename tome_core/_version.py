"""The package's version, read from its one source: ``[project] version`` in pyproject.toml.

It lives there because the Comfy registry and ComfyUI-Manager read it from that file as text. A
checkout (ComfyUI custom_nodes, the WebUI's extensions folder, ``pip install -e``) has the file
beside ``tome_core/``; an installed wheel or sdist has it in its metadata instead.
"""
import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "tome-diffusion"

_PROJECT_TABLE = re.compile(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", re.MULTILINE | re.DOTALL)
_VERSION_KEY = re.compile(r'^version\s*=\s*"([^"]+)"', re.MULTILINE)


def version_from_pyproject(text: str) -> str | None:
    """``version`` of the ``[project]`` table of a pyproject.toml text, or None without one."""
    table = _PROJECT_TABLE.search(text)
    found = _VERSION_KEY.search(table.group(1)) if table else None
    return found.group(1) if found else None


def read_version() -> str:
    """The checkout's pyproject.toml where tome_core sits in one, else the installed metadata."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        text = pyproject.read_text(encoding="utf-8")
        if f'name = "{DISTRIBUTION}"' in text:
            found = version_from_pyproject(text)
            if found:
                return found
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        # A copy of tome_core/ without its checkout or metadata: say so rather than guess.
        return "0+unknown"


__version__ = read_version()
