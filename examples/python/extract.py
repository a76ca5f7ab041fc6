"""Extracts a contact record through the client generated from Quarry's OpenAPI document
(examples/python/generate-client.sh), with grounding, then shows a typed error.

    python examples/python/extract.py [BASE_URL] [API_KEY]

Prints one JSON line: the record, its outcome, usage, grounding, each field's confidence and
span, the fields to review (confidence under 0.5), and the error type of a request naming an
unknown schema. The server tests run it against a live server."""
import json
import os
import sys

sys.path.insert(0, os.environ.get("QUARRY_CLIENT_DIR", os.path.dirname(os.path.abspath(__file__))))

from quarry_client import AuthenticatedClient, Client  # noqa: E402
from quarry_client.api.extraction import extract  # noqa: E402
from quarry_client.api.schemas import list_  # noqa: E402
from quarry_client.api.service import health  # noqa: E402
from quarry_client.models import ErrorBody, ExtractOptions, ExtractRequest, ExtractResponse, Outcome  # noqa: E402

base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"
api_key = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("QUARRY_API_KEY")
client = AuthenticatedClient(base_url=base_url, token=api_key) if api_key else Client(base_url=base_url)

status = health.sync(client=client)
assert status is not None and status.status == "ok", status
ids = list_.sync(client=client).schema_ids
assert "contact" in ids, ids

document = "Hi, this is Maria Lopez from Initech. Reach me at maria.lopez@initech.example or +1 555 0100."
out = extract.sync(
    client=client,
    body=ExtractRequest(
        document=document,
        schema_id="contact",
        grounding=True,
        options=ExtractOptions(max_tokens=128, min_confidence=0.5),
    ),
)
assert isinstance(out, ExtractResponse), out
assert out.outcome == Outcome.OK, out

missing = extract.sync(client=client, body=ExtractRequest(document="x", schema_id="no-such-schema"))
assert isinstance(missing, ErrorBody), missing

print(
    json.dumps(
        {
            "outcome": out.outcome.value,
            "data": out.data.to_dict(),
            "usage": out.usage.to_dict(),
            "grounding": [g.to_dict() for g in out.grounding],
            "fields": [f.to_dict() for f in out.fields],
            "review": list(out.review),
            "error_type": missing.error.type_,
        }
    )
)
