#!/usr/bin/env bash
# Extract an invoice record with the ready-made schema, from a running `quarry serve`.
#   examples/curl/extract.sh [http://127.0.0.1:8080]
set -euo pipefail
url=${1:-http://127.0.0.1:8080}
doc=$(cat "$(dirname "$0")/../documents/invoice.txt")
curl -sS "$url/extract" -H 'content-type: application/json' ${QUARRY_API_KEY:+-H "authorization: Bearer $QUARRY_API_KEY"} \
  -d "$(python3 -c 'import json,sys; print(json.dumps({"schema_id": "invoice", "document": sys.argv[1]}))' "$doc")"
echo
