#!/usr/bin/env bash
# ETL: invoices as free text in a CSV column in, one CSV row per invoice line out, with the
# columns the invoice schema defines (invoice_number, date, total, currency, lines.item,
# lines.amount) plus id, outcome and error.
#
#   examples/etl/run.sh                         # offline, with `quarry extract`
#   examples/etl/run.sh http://127.0.0.1:8080   # through a running `quarry serve` (a batch job)
#
# Writes examples/etl/invoices.out.csv.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=$here/invoices.out.csv
if [ $# -eq 0 ]; then
  quarry=${QUARRY:-$root/target/release/quarry}
  [ -x "$quarry" ] || (cd "$root" && cargo build --release --quiet)
  (cd "$root" && "$quarry" extract --schema schemas/invoice.json \
     --input "$here/invoices.csv" --output "$out" --explode lines)
else
  url=$1
  auth=()
  [ -n "${QUARRY_API_KEY:-}" ] && auth=(-H "authorization: Bearer $QUARRY_API_KEY")
  job=$(curl -sSf "${auth[@]}" -H 'content-type: text/csv' --data-binary @"$here/invoices.csv" \
        "$url/jobs?schema_id=invoice" | python3 -c 'import json,sys; print(json.load(sys.stdin)["job_id"])')
  echo "job $job" >&2
  until curl -sSf "${auth[@]}" "$url/jobs/$job" | python3 -c 'import json,sys; s=json.load(sys.stdin); print(f"{s[\"ok\"]+s[\"failed\"]}/{s[\"total\"]}", file=sys.stderr); sys.exit(0 if s["done"] else 1)'; do
    sleep 1
  done
  curl -sSf "${auth[@]}" "$url/jobs/$job/results?format=csv&explode=lines" -o "$out"
fi
echo "wrote $out" >&2
