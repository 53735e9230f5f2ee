#!/usr/bin/env bash
# Sets everything up and runs the whole test suite: proto checks (buf lint/format/breaking,
# regeneration), ruff, mypy, pytest (unit, e2e against real servers, clients), Go and Java
# client tests.  Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
if [ -f scripts/tools.sh ]; then bash scripts/tools.sh; fi
if [ -f scripts/check_protos.sh ]; then bash scripts/check_protos.sh; fi
echo "== ruff"
.venv/bin/ruff check service tests clients/python docs/hooks
.venv/bin/ruff format --check service tests clients/python docs/hooks
echo "== mypy"
.venv/bin/mypy service/genserve clients/python/genserve/client docs/hooks
echo "== docs"
# A broken link or anchor, or a nav entry without its page, fails the strict build.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir site
echo "== pytest"
.venv/bin/pytest -q -p no:cacheprovider "$@"
