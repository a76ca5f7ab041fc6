#!/usr/bin/env python3
"""Single-stream prefill and decode speed of llama.cpp (llama-cpp-python) on the same GGUF and
the same prompt token ids as `quarry bench single`. Prints one JSON object."""
import argparse
import json
import statistics
import time

import llama_cpp
import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--input-len", type=int, default=256)
p.add_argument("--output-len", type=int, default=128)
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()

llm = llama_cpp.Llama(model_path=a.model, n_ctx=a.input_len + a.output_len + 16, n_batch=512,
                      n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
vocab = llm.n_vocab()
# The same formula as quarry's bench_prompt: ordinary token ids, identical for both engines.
prompt = [100 + (i * 7919) % (vocab - 200) for i in range(a.input_len)]


def last_logits():
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(vocab,))


prefill, decode = [], []
for rep in range(a.repeats + 1):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    tok = int(np.argmax(last_logits()))
    t1 = time.perf_counter()
    for _ in range(a.output_len - 1):
        llm.eval([tok])
        tok = int(np.argmax(last_logits()))
    t2 = time.perf_counter()
    if rep > 0:
        prefill.append(a.input_len / (t1 - t0))
        decode.append((a.output_len - 1) / (t2 - t1))

print(json.dumps({"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
                  "prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode)}))
