#!/usr/bin/env python3
"""llama.cpp (llama-cpp-python) serving the requests `quarry bench throughput --save-requests`
wrote, one after another, greedy, each decoding exactly its recorded number of tokens. Like
llama-cpp-python's own generate(), each prompt reuses the KV cache of the longest prefix it
shares with the previous one. Prints one JSON object."""
import argparse
import json
import time

import llama_cpp
import numpy as np

p = argparse.ArgumentParser()
p.add_argument("requests")
p.add_argument("--model", required=True)
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()

reqs = [json.loads(line) for line in open(a.requests) if line.strip()]
n_ctx = max(len(r["prompt"]) + r["max_tokens"] for r in reqs) + 16
llm = llama_cpp.Llama(model_path=a.model, n_ctx=n_ctx, n_batch=512, n_threads=a.threads,
                      n_threads_batch=a.threads, verbose=False)
vocab = llm.n_vocab()


def last_logits():
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))


def serve(prompt, n, previous):
    shared = 0
    for x, y in zip(previous, prompt):
        if x != y:
            break
        shared += 1
    shared = min(shared, len(prompt) - 1)
    llm.n_tokens = shared  # eval() drops the cache from here on
    t0 = time.perf_counter()
    llm.eval(prompt[shared:])
    tok = int(np.argmax(last_logits()))
    ttft = time.perf_counter() - t0
    seq = prompt + [tok]
    for _ in range(n - 1):
        llm.eval([tok])
        tok = int(np.argmax(last_logits()))
        seq.append(tok)
    return seq, ttft


serve(reqs[0]["prompt"][:64], 4, [])  # warm-up
previous, ttfts, out_tokens = [], [], 0
start = time.perf_counter()
for r in reqs:
    previous, ttft = serve(r["prompt"], r["max_tokens"], previous)
    ttfts.append(ttft * 1e3)
    out_tokens += r["max_tokens"]
seconds = time.perf_counter() - start
ttfts.sort()
print(json.dumps({"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), one request at a time",
                  "requests": len(reqs), "output_tokens": out_tokens, "seconds": seconds,
                  "output_tok_s": out_tokens / seconds, "ttft_ms_p50": ttfts[len(ttfts) // 2]}))
