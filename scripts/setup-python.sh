#!/usr/bin/env bash
# The Python side: a virtual environment inside the repository (.venv/, ignored by git) with the
# pinned packages of python/requirements.txt (mlacp, its tests) and python/requirements-peers.txt
# (the peer benchmark). Idempotent: quick when the pins are installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MLACP_VENV:-$root/.venv}"
requirements="$root/python/requirements.txt"
peers="$root/python/requirements-peers.txt"
stamp="$venv/.mlacp-requirements"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "mlacp setup: creating $venv"
  "$python" -m venv "$venv"
fi
if ! cat "$requirements" "$peers" | cmp -s - "$stamp"; then
  echo "mlacp setup: installing python/requirements*.txt into $venv (torch is a large download)"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$requirements" -r "$peers"
  cat "$requirements" "$peers" > "$stamp"
fi
