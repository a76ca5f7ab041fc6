"""Drives a running `quarry serve` with the official OpenAI Python client: a json_schema chat
completion, a streamed one, and a legacy completion with logprobs. Prints one JSON line with what it saw; exits non-zero on any
mismatch. Usage: openai_client.py BASE_URL API_KEY"""
import json
import sys

import openai

base_url, api_key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key=api_key)
model = client.models.list().data[0].id
schema = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
done = client.chat.completions.create(
    model=model,
    messages=[{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "A city and its population?"}],
    temperature=0,
    max_tokens=64,
    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
)
answer = json.loads(done.choices[0].message.content)
assert set(answer) == {"city", "population"}, answer
assert isinstance(answer["city"], str) and len(answer["city"]) <= 20, answer
assert isinstance(answer["population"], int) and answer["population"] >= 0, answer
assert done.choices[0].finish_reason == "stop", done
assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens, done.usage

pieces, usage, finish = [], None, None
for chunk in client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Say hello."}],
    max_tokens=12,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
):
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        pieces.append(c.delta.content or "")
        finish = c.finish_reason or finish
assert "".join(pieces), "the stream carried no text"
assert finish in ("stop", "length"), finish
assert usage is not None and usage.completion_tokens >= 1, usage

legacy = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2)
assert legacy.choices[0].text and legacy.choices[0].finish_reason == "length", legacy
assert len(legacy.choices[0].logprobs.tokens) == 4 and len(legacy.choices[0].logprobs.top_logprobs[0]) == 2, legacy
assert legacy.usage.completion_tokens == 4, legacy.usage

try:
    client.chat.completions.create(model="not-this-one", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("a wrong model was accepted")
except openai.NotFoundError:
    pass

print(json.dumps({"model": model, "answer": answer, "streamed": "".join(pieces), "completion": legacy.choices[0].text,
                  "openai": openai.__version__}))
