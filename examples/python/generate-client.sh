#!/usr/bin/env bash
# Generates a typed Python client for Quarry from openapi/openapi.json with
# openapi-python-client, into examples/python/quarry_client (or the folder given).
#   examples/python/generate-client.sh [OUT_DIR]
# Needs openapi-python-client (scripts/setup-clients installs it into the clients venv).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/quarry_client}
gen=${OPENAPI_PYTHON_CLIENT:-openapi-python-client}
if ! command -v "$gen" >/dev/null; then
  gen=$HOME/.cache/quarry/clients/bin/openapi-python-client
fi
"$gen" generate --path "$here/../../openapi/openapi.json" --meta none \
  --config "$here/generator.yaml" --output-path "$out" --overwrite
