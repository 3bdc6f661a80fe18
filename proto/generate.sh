#!/bin/sh
# The one command that generates the Python stubs of proto/ into routereplay/v1/: `make proto`
# and every Dockerfile run it. PYTHON: the interpreter holding grpcio-tools (pinned in
# pyproject.toml's codegen extra; the Dockerfiles install the same pin, and a test checks it).
set -eu
cd "$(dirname "$0")/.."
rm -rf routereplay/v1 && mkdir -p routereplay/v1
"${PYTHON:-python3}" -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. \
    proto/routereplay/v1/*.proto
