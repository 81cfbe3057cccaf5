#!/usr/bin/env bash
# The README's main command: set up, then run the AFD demo.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
uv run --no-sync afd-demo "$@"
