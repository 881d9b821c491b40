#!/usr/bin/env bash
# The main job on its built-in default: set up, build, then train a small DeepSeek-style model on
# 4 local ranks with context parallelism and again without it, and report whether the loss curves
# agree (the figure, both runs' tokens/s, and the loss plot's path). Extra arguments go to
# `mlacp train --compare`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" mlacp
cd "$root"
exec "$root/build/mlacp" train --compare "$@"
