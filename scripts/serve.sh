#!/usr/bin/env bash
# Sets everything up (first run: a few minutes) and serves the embedded default model
# (SmolLM2-135M-Instruct) over gRPC on port 50051.  Extra arguments go to `genserve`,
# e.g. `scripts/serve.sh --port 8081 --dtype bfloat16`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/genserve" "$@"
