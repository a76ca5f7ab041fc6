"""Runs an OpenAI batch end to end against a running `quarry serve` with the official OpenAI
Python client, unchanged: files.create, batches.create, batches.retrieve until done,
files.content of the output and error files, batches.list, and a cancelled batch. Output lines
are matched by custom_id. Prints one JSON line with what it saw; exits non-zero on any
mismatch. Usage: openai_batch.py BASE_URL API_KEY"""
import io
import json
import sys
import time

import openai

base_url, api_key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key=api_key)
model = client.models.list().data[0].id
schema = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
cities = ["Paris", "Lima", "Oslo", "Cairo", "Hanoi", "Quito"]
lines = [
    {
        "custom_id": f"city-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"{city} is a city. Which country is it in?"}],
            "temperature": 0,
            "max_tokens": 48,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}},
        },
    }
    for i, city in enumerate(cities)
]
# A line for another endpoint, and one that is not JSON: each fails alone, named.
lines.append({"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {"model": model}})
text = "\n".join(json.dumps(line) for line in lines) + "\n{not json\n"

uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(text.encode())), purpose="batch")
assert uploaded.purpose == "batch" and uploaded.bytes == len(text.encode()), uploaded
batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"run": "test"})
assert batch.status in ("in_progress", "completed"), batch
deadline = time.time() + 600
while batch.status not in ("completed", "failed", "cancelled", "expired"):
    assert time.time() < deadline, batch
    time.sleep(0.5)
    batch = client.batches.retrieve(batch.id)
assert batch.status == "completed", batch
assert batch.request_counts.total == 8, batch.request_counts
assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 2), batch.request_counts
assert batch.metadata == {"run": "test"}, batch.metadata

output = [json.loads(l) for l in client.files.content(batch.output_file_id).text.splitlines()]
by_id = {o["custom_id"]: o for o in output}
assert sorted(by_id) == sorted(f"city-{i}" for i in range(len(cities))), sorted(by_id)
for o in output:
    assert o["error"] is None and o["response"]["status_code"] == 200, o
    answer = json.loads(o["response"]["body"]["choices"][0]["message"]["content"])
    assert set(answer) == {"city", "country"}, answer
errors = [json.loads(l) for l in client.files.content(batch.error_file_id).text.splitlines()]
errors_by_id = {e["custom_id"]: e for e in errors}
# The line that is not JSON has no custom_id: null, its error naming the line.
assert set(errors_by_id) == {None, "wrong-url"}, errors
assert "line 7" in errors_by_id["wrong-url"]["error"]["message"], errors_by_id["wrong-url"]
assert errors_by_id[None]["error"]["message"].startswith("line 8:"), errors_by_id[None]

# A finished batch cannot be cancelled: a 409, and it stays completed.
try:
    client.batches.cancel(batch.id)
    raise AssertionError("a completed batch was cancelled")
except openai.ConflictError as e:
    assert "batch_not_cancellable" in str(e), str(e)
assert client.batches.retrieve(batch.id).status == "completed"

# The input file can be deleted once the batch has it; then it is gone.
gone = client.files.delete(uploaded.id)
assert gone.deleted and gone.id == uploaded.id, gone
try:
    client.files.retrieve(uploaded.id)
    raise AssertionError("a deleted file is still there")
except openai.NotFoundError:
    pass
assert client.batches.retrieve(batch.id).status == "completed"

listed = client.batches.list(limit=10)
assert batch.id in [b.id for b in listed.data], listed

# Cancelled at once (more requests than the server runs at a time): what had not started
# ends cancelled, counted failed; what was running finishes.
big = "\n".join(json.dumps(dict(line, custom_id=f"again-{i}")) for i, line in enumerate(lines[:6] * 12)) + "\n"
second = client.files.create(file=("more.jsonl", io.BytesIO(big.encode())), purpose="batch")
running = client.batches.create(input_file_id=second.id, endpoint="/v1/chat/completions", completion_window="24h")
cancelled = client.batches.cancel(running.id)
assert cancelled.status in ("cancelling", "cancelled"), cancelled
while cancelled.status == "cancelling":
    assert time.time() < deadline, cancelled
    time.sleep(0.5)
    cancelled = client.batches.retrieve(running.id)
assert cancelled.status == "cancelled", cancelled
assert cancelled.request_counts.failed > 0, cancelled.request_counts
assert client.batches.cancel(running.id).status == "cancelled", "cancelling again changes nothing"

# A custom_id twice is refused, naming both lines.
twice = "\n".join(json.dumps(line) for line in [lines[0], lines[1], lines[0]]) + "\n"
dup = client.files.create(file=("dup.jsonl", io.BytesIO(twice.encode())), purpose="batch")
try:
    client.batches.create(input_file_id=dup.id, endpoint="/v1/chat/completions", completion_window="24h")
    raise AssertionError("a repeated custom_id was accepted")
except openai.BadRequestError as e:
    assert "line 1" in str(e) and "line 3" in str(e), str(e)

print(json.dumps({"batch": batch.id, "completed": batch.request_counts.completed, "failed": batch.request_counts.failed,
                  "cancelled_failed": cancelled.request_counts.failed}))
