#!/usr/bin/env bash
# Soak test (not part of CI): mixed load with cancellations, deadlines and overload against
# one genserve for N minutes; fails on growth of RSS, threads, fds or KV blocks in use.
#   bash scripts/soak.sh --minutes 10 [--clients 12] [--model-id DIR|""]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh" >&2
exec "$root/.venv/bin/python" "$root/scripts/soak.py" "$@"
