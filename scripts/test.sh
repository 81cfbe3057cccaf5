#!/usr/bin/env bash
# The README's test command: set up, then every test tier (unit, multi-process, end to end).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec uv run --no-sync pytest "$@"
