#!/usr/bin/env python3
"""llama.cpp (llama-cpp-python) answering the extraction prompts `quarry bench quality
--save-prompts` wrote: the same prompt token ids (rendered by the same chat template), the
case's schema as its grammar (llama.cpp's own JSON-Schema-to-GBNF converter), greedy, the
same token budget. Writes one {"id", "text", "finish_reason", "tokens", "ms"} line per case,
for `quarry bench quality --score`."""
import argparse
import json
import sys
import time

import llama_cpp

p = argparse.ArgumentParser()
p.add_argument("prompts")
p.add_argument("--model", required=True)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--out", required=True)
a = p.parse_args()

cases = [json.loads(line) for line in open(a.prompts) if line.strip()]
n_ctx = max(len(c["prompt"]) + c["max_tokens"] for c in cases) + 16
llm = llama_cpp.Llama(model_path=a.model, n_ctx=n_ctx, n_batch=512, n_threads=a.threads,
                      n_threads_batch=a.threads, verbose=False)
with open(a.out, "w") as out:
    for c in cases:
        try:
            grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(c["schema"]), verbose=False)
        except Exception as e:  # a schema its converter cannot take: no answer
            print(f"{c['id']}: llama.cpp cannot convert the schema: {e}", file=sys.stderr)
            out.write(json.dumps({"id": c["id"], "text": "", "finish_reason": "error", "tokens": 0, "ms": 0}) + "\n")
            continue
        llm.reset()
        t0 = time.perf_counter()
        r = llm.create_completion(prompt=c["prompt"], max_tokens=c["max_tokens"], temperature=0.0,
                                  repeat_penalty=1.0, grammar=grammar)
        ms = (time.perf_counter() - t0) * 1e3
        choice = r["choices"][0]
        out.write(json.dumps({"id": c["id"], "text": choice["text"], "finish_reason": choice["finish_reason"],
                              "tokens": r["usage"]["completion_tokens"], "ms": ms}) + "\n")
        out.flush()
        print(f"{c['id']}: {choice['finish_reason']}, {r['usage']['completion_tokens']} tokens, {ms:.0f} ms",
              file=sys.stderr)
