#!/usr/bin/env bash
# Builds .venv-invoke for tests/invokeai: a real InvokeAI 6.14.2 from PyPI, torch==2.13.0 installed first
# and pinned (InvokeAI asks torch>=2.7,<3), so pip never replaces the CPU torch. Idempotent (tests/env_stamp.sh).
#   bash tests/invokeai/setup_env.sh
# then:  TOME_REQUIRE_INVOKE=1 .venv-invoke/bin/python -m pytest -q tests/invokeai --confcutdir=tests/invokeai
set -euo pipefail
cd "$(dirname "$0")/../.."
source tests/pip_quiet.sh
VENV="${TOME_INVOKE_VENV:-.venv-invoke}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"
export TOME_ENV_EXTRA="$TORCH_SPEC"
stamp_inputs=(tests/invokeai/setup_env.sh requirements-invoke-test.txt)
if bash tests/env_stamp.sh check "$VENV" "${stamp_inputs[@]}"; then
  echo "$VENV is up to date"
  exit 0
fi
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "$TORCH_SPEC" > "$constraints"
"$PY" -c "import torch" 2>/dev/null || pip_install "$PY" "$TORCH_SPEC"
pip_install "$PY" -c "$constraints" -r requirements-invoke-test.txt
"$PY" -c "import importlib.metadata as m, torch; print('InvokeAI test env ready: torch', torch.__version__, 'invokeai', m.version('invokeai'))"
bash tests/env_stamp.sh write "$VENV" "${stamp_inputs[@]}"
