#!/usr/bin/env bash
# Remembers what a test environment was built from, so a second tests/run.sh skips pip's re-check
# (about 17 s per environment) while nothing it installs from has changed.
#   bash tests/env_stamp.sh check VENV FILE...   exit 0 when VENV was built from exactly these FILEs
#   bash tests/env_stamp.sh write VENV FILE...   record them after a successful set-up
# The stamp holds the sha256 of each FILE, the venv's Python version and TOME_ENV_EXTRA (set by a
# caller for inputs that are not files, e.g. a ComfyUI folder). TOME_REFRESH_ENVS=1 forces a set-up.
set -euo pipefail
action="$1" venv="$2"
shift 2
stamp="$venv/.tome-env-stamp"
describe() {
  "$venv/bin/python" -c 'import sys; print(sys.version.split()[0])'
  echo "extra: ${TOME_ENV_EXTRA:-}"
  sha256sum "$@"
}
case "$action" in
  check)
    [ "${TOME_REFRESH_ENVS:-}" != 1 ] && [ -x "$venv/bin/python" ] && [ -f "$stamp" ] &&
      [ "$(describe "$@")" = "$(cat "$stamp")" ] ;;
  write) describe "$@" > "$stamp" ;;
  *) echo "usage: $0 check|write VENV FILE..." >&2; exit 2 ;;
esac
