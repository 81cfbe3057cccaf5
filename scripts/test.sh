#!/usr/bin/env bash
# The README's test command: set up, then every test tier (unit, multi-process, end to end).
# Two workers: one runs the end-to-end tests in order (they share servers, hosts and the colocated
# reference: tests/conftest.py), the other every other test beside them, on the core the
# servers leave idle while they wait. `-n 0` after it runs everything in this process.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec uv run --no-sync pytest -n 2 "$@"
