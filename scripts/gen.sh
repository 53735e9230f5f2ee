#!/usr/bin/env bash
# The one command that regenerates every checked-in stub from protos/:
#   clients/python/genserve/v1/    Python messages, type stubs and gRPC stubs (grpcio-tools)
#   clients/go/genservev1/         Go messages, gRPC stubs and the grpc-gateway reverse proxy
#   deploy/gateway/openapi/        the gateway's OpenAPI v2 spec
# Java stubs are not checked in: Maven generates them from ../../protos at build time.
# Generated code is never edited by hand; change protos/ or deploy/gateway/genserve.yaml and
# run this.  Uses only local plugins (scripts/tools.sh installs them, pinned).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/tools.sh
export PATH="$root/.tools/bin:$PATH"

# Remove what a previous run generated, so a deleted or renamed proto leaves nothing behind.
rm -f clients/go/genservev1/*.pb.go clients/go/genservev1/*.pb.gw.go \
  clients/python/genserve/v1/*_pb2.py clients/python/genserve/v1/*_pb2.pyi \
  clients/python/genserve/v1/*_pb2_grpc.py deploy/gateway/openapi/*.json

buf generate

mapfile -t protos < <(cd protos && find genserve -name '*.proto' | sort)
# The proto package path genserve/v1 makes the imports inside the generated code read
# `from genserve.v1 import ...`, which resolves through the PEP 420 namespace `genserve`.
python-protoc -Iprotos --python_out=clients/python --pyi_out=clients/python \
  --grpc_python_out=clients/python "${protos[@]}"
echo "gen.sh: regenerated Python, Go, gateway and OpenAPI stubs from protos/" >&2
