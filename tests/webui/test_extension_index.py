"""The AUTOMATIC1111 extension index entry kept in docs/ for a maintainer to submit (one file under the index's
extensions/): it passes the index's own entry check, mirrored from AUTOMATIC1111/stable-diffusion-webui-extensions
956826e, .github/scripts/validate.py ``validate_entry`` (required keys, tags from tags.json, an https git URL,
an ISO date), and points at the repository pyproject.toml names."""
from __future__ import annotations

import datetime
import json
import re
import tomllib
from pathlib import Path

from webui_helpers import REPO

ENTRY = Path(REPO) / "docs" / "webui-extension-index" / "tome-diffusion.json"
# tags.json of the index at 956826e (the keys validate.py checks against)
INDEX_TAGS = {"script", "localization", "tab", "dropdown", "ads", "installed", "training", "models", "UI related",
              "prompting", "editing", "manipulations", "online", "animation", "query", "science", "extras"}
GIT_URL = re.compile(r"(https://[^ ]+?)(?:(?:\.git)$|$)")  # validate.py's git_url_pattern


def test_the_entry_passes_the_index_check_and_names_this_repository():
    entry = json.loads(ENTRY.read_text())
    assert {"name", "url", "description", "tags"} <= set(entry)
    assert entry["tags"] and set(entry["tags"]) <= INDEX_TAGS
    datetime.date.fromisoformat(entry["added"])
    match = GIT_URL.match(entry["url"])
    assert match and entry["url"].endswith(".git")
    project = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["project"]
    assert match.group(1) == project["urls"]["Repository"]
