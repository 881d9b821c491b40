#!/usr/bin/env bash
# The main job on its built-in default: set up, build, run `mlacp verify`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" mlacp
exec "$root/build/mlacp" verify "$@"
