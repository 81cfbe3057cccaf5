#!/usr/bin/env bash
# Set up a fresh machine that has only Python and pip: install uv if missing, sync the workspace
# with the CPU build of vLLM. Sourced by the README's two commands.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet uv
  export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$HOME/.local/bin:$PATH"
fi
uv sync --locked --extra cpu
