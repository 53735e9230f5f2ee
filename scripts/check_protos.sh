#!/usr/bin/env bash
# Keeps protos/ the single source of truth.  Fails when:
#   - `buf lint` (STANDARD) finds a problem,
#   - `buf format -d` would change a proto,
#   - regenerating every stub (scripts/gen.sh) changes, adds or removes a generated file,
#   - `buf breaking` (FILE) finds an incompatible change against the previous commit on main
#     (skipped, with a message, when there is no previous commit with protos, e.g. the very
#     first commit or a shallow clone), and, when protos/ has uncommitted edits, against HEAD.
# Set GENSERVE_BREAKING_AGAINST=<git ref> to compare against another commit instead.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/tools.sh
export PATH="$root/.tools/bin:$PATH"
generated=(clients/python/genserve/v1 clients/go/genservev1 deploy/gateway/openapi)

echo "== buf lint"
buf lint
echo "== buf format"
if ! buf format -d --exit-code; then
  echo "check_protos: protos are not buf-formatted; run: .tools/bin/buf format -w" >&2
  exit 1
fi

echo "== regeneration leaves generated files unchanged"
# Compare with the files as they are now (committed or not), so a developer who edited a proto
# and ran scripts/gen.sh passes before committing; on a fresh clone this is the committed state.
before="$(mktemp -d)"
for dir in "${generated[@]}"; do
  mkdir -p "$before/$dir" && cp -R "$dir/." "$before/$dir/"
done
bash scripts/gen.sh
stale=0
for dir in "${generated[@]}"; do
  diff -r -u -x __pycache__ "$before/$dir" "$dir" >&2 || stale=1
done
rm -rf "$before"
if [ "$stale" != 0 ]; then
  echo "check_protos: generated code is out of date with protos/ (diff above); run" \
    "scripts/gen.sh and commit the result" >&2
  exit 1
fi

echo "== buf breaking"
# breaking_against REF: compare the working tree's protos with protos/ as committed in REF.
breaking_against() {
  local ref="$1" tmp
  tmp="$(mktemp -d)"
  # `git archive` + a plain directory avoids buf's own git handling (clones, depth, refs).
  git archive "$ref" protos | tar -x -C "$tmp"
  local rc=0
  buf breaking --against "$tmp/protos" || rc=$?
  rm -rf "$tmp"
  if [ "$rc" != 0 ]; then
    echo "check_protos: incompatible proto change against $ref (see above)" >&2
    return "$rc"
  fi
  echo "buf breaking: no incompatible change against $ref ($(git rev-parse --short "$ref"))"
}
has_protos() { git cat-file -e "$1:protos" 2>/dev/null; }

against="${GENSERVE_BREAKING_AGAINST:-HEAD~1}"
if ! git rev-parse --verify -q "$against^{commit}" >/dev/null; then
  echo "buf breaking: skipped: no commit $against here (first commit or shallow clone)"
elif ! has_protos "$against"; then
  echo "buf breaking: skipped: $against has no protos/ yet"
else
  breaking_against "$against"
fi
# Uncommitted edits to protos/ are compared with HEAD too, so a developer sees a break before
# committing it.
if git rev-parse --verify -q HEAD >/dev/null && has_protos HEAD &&
  [ -n "$(git status --porcelain -- protos)" ]; then
  breaking_against HEAD
fi
echo "check_protos: OK"
