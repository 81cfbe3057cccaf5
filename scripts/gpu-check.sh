#!/usr/bin/env bash
# First run on a CUDA machine: the CUDA build of vLLM, then AFD over NCCL against colocated vLLM
# and afd-bench --quick (python -m afd_common.tools.gpu_check --help). Not part of CI: no GPU there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
    # Help needs no GPU and no CUDA build: whatever environment is here.
    exec uv run --no-sync python -m afd_common.tools.gpu_check --help
  fi
done
if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet uv
  export PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$HOME/.local/bin:$PATH"
fi
uv sync --locked --extra cuda
exec uv run --no-sync python -m afd_common.tools.gpu_check "$@"
