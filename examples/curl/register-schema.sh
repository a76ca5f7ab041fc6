#!/usr/bin/env bash
# Register a schema, print its id and the report of every keyword, then extract with it.
#   examples/curl/register-schema.sh [http://127.0.0.1:8080]
set -euo pipefail
url=${1:-http://127.0.0.1:8080}
auth=(${QUARRY_API_KEY:+-H "authorization: Bearer $QUARRY_API_KEY"})
schema='{"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
  "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": true}},
  "required": ["name", "email"], "additionalProperties": false}'
reply=$(curl -sS "$url/schemas" -H 'content-type: application/json' "${auth[@]}" -d "{\"schema\": $schema}")
echo "$reply"
id=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["schema_id"])' "$reply")
curl -sS "$url/extract" -H 'content-type: application/json' "${auth[@]}" \
  -d "{\"schema_id\": \"$id\", \"document\": \"Met Ada Lovelace (ada@example.org) at the conference.\"}"
echo
