#!/usr/bin/env bash
# Installs the proto/client toolchain, pinned, into the project-local .tools/ directory:
#   buf                        npm @bufbuild/buf (version below)
#   protoc-gen-go, protoc-gen-go-grpc, protoc-gen-grpc-gateway, protoc-gen-openapiv2,
#   grpcurl, grpc_health_probe go install, versions and checksums pinned by the tool module
#                              scripts/tools/go.mod + go.sum
#   python-protoc              grpcio-tools (version below) in its own venv, .tools/pyenv
# Every executable ends up in .tools/bin.  Idempotent: each group records what it installed
# and is skipped when that still matches, so a warm run takes well under a second.  Everything
# comes from the package registries (npm, the Go module proxy, PyPI).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
bin="$tools/bin"
mkdir -p "$bin"
# Keep the directory out of git without touching the repository's .gitignore.
[ -f "$tools/.gitignore" ] || echo '*' > "$tools/.gitignore"

BUF_VERSION=1.75.0
# Must equal the version that generated clients/python/genserve/v1: the generated code embeds
# the protoc and grpcio versions, so another version would make the regeneration check fail.
GRPCIO_TOOLS_VERSION=1.85.1

log() { echo "tools.sh: $*" >&2; }
# current NAME WANT: true when group NAME was installed with fingerprint WANT.
current() { [ "$(cat "$tools/.$1.stamp" 2>/dev/null)" = "$2" ]; }
record() { echo "$2" > "$tools/.$1.stamp"; }

want="$BUF_VERSION"
if ! current buf "$want" || [ ! -x "$bin/buf" ]; then
  log "npm install @bufbuild/buf@$BUF_VERSION"
  mkdir -p "$tools/npm"
  npm install --silent --no-audit --no-fund --no-save --prefix "$tools/npm" \
    "@bufbuild/buf@$BUF_VERSION" >&2
  ln -sf "$tools/npm/node_modules/.bin/buf" "$bin/buf"
  record buf "$want"
fi

go_tools=(protoc-gen-go protoc-gen-go-grpc protoc-gen-grpc-gateway protoc-gen-openapiv2 grpcurl
  grpc-health-probe)
want="$(cat "$root/scripts/tools/go.mod" "$root/scripts/tools/go.sum" | sha256sum | cut -c1-16)"
missing=0
for name in "${go_tools[@]}"; do [ -x "$bin/$name" ] || missing=1; done
if ! current go "$want" || [ "$missing" = 1 ]; then
  log "go install tool (scripts/tools/go.mod) -> .tools/bin"
  # -mod=readonly: the committed go.sum is the checksum authority for these modules.
  (cd "$root/scripts/tools" && GOBIN="$bin" GOFLAGS="${GOFLAGS:-} -mod=readonly" go install tool)
  # The module builds `grpc-health-probe`; the name everyone types is grpc_health_probe.
  ln -sf grpc-health-probe "$bin/grpc_health_probe"
  record go "$want"
fi

want="$GRPCIO_TOOLS_VERSION"
if ! current python-protoc "$want" || [ ! -x "$bin/python-protoc" ]; then
  log "pip install grpcio-tools==$GRPCIO_TOOLS_VERSION into .tools/pyenv"
  python3 -m venv --clear "$tools/pyenv"
  "$tools/pyenv/bin/python" -m pip install -q --disable-pip-version-check \
    "grpcio-tools==$GRPCIO_TOOLS_VERSION"
  # A wrapper, so scripts call `.tools/bin/python-protoc ARGS` as they would call protoc.
  printf '#!/usr/bin/env bash\nexec "%s" -m grpc_tools.protoc "$@"\n' \
    "$tools/pyenv/bin/python" > "$bin/python-protoc"
  chmod +x "$bin/python-protoc"
  record python-protoc "$want"
fi

# ghz, the gRPC load tester (reflection-only load tests, the soak command).  Its own pinned
# go install: it is a standalone binary, and its dependency set would drag the tool module's.
GHZ_VERSION=v0.121.0
want="$GHZ_VERSION"
if ! current ghz "$want" || [ ! -x "$bin/ghz" ]; then
  log "go install github.com/bojand/ghz/cmd/ghz@$GHZ_VERSION -> .tools/bin"
  (cd "$tools" && GOBIN="$bin" GOFLAGS=-mod=mod go install "github.com/bojand/ghz/cmd/ghz@$GHZ_VERSION")
  record ghz "$want"
fi

# nginx, the gRPC proxy sidecar of the proxy tests (deploy/nginx/): Debian's package, installed
# when missing and we are root with apt (CI).  Never fatal: the proxy tests skip, saying why,
# where it cannot be installed.
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "apt-get install nginx-light"
    # RUNLEVEL=1: the package must not start a system nginx on port 80; tests run their own.
    (apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light) >&2 \
      || log "nginx could not be installed: the proxy tests will skip"
  else
    log "nginx missing and not installable here (not root or no apt-get): proxy tests will skip"
  fi
fi

# kustomize renders deploy/kubernetes overlays for the manifest tests (kubectl is not here).
KUSTOMIZE_VERSION=v5.7.1
want="$KUSTOMIZE_VERSION"
if ! current kustomize "$want" || [ ! -x "$bin/kustomize" ]; then
  log "go install sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION -> .tools/bin"
  (cd "$tools" && GOBIN="$bin" GOFLAGS=-mod=mod go install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION")
  record kustomize "$want"
fi
