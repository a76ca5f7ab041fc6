#!/usr/bin/env python3
"""Golden outputs of llama.cpp (through llama-cpp-python) on the default model, for
tests/reference.rs. Regenerate with:

    $(scripts/setup-peers) scripts/make-goldens.py > tests/golden/llamacpp-smollm2.json

Records, for each prompt: the prompt tokens, the greedy continuation (64 tokens, end of
generation ignored) and the top-5 log-probabilities of the first 8 generated positions; for
each tricky string, its tokens; for chat prompts, the template rendered by jinja2 (as
transformers renders it).
"""
import hashlib
import json
import sys
from pathlib import Path

import jinja2
import llama_cpp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEN_TOKENS = 64
LOGPROB_POSITIONS = 8
TOP = 5

PROMPTS = [
    {"name": "capital", "text": "The capital of France is"},
    {"name": "code", "text": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
    {"name": "invoice", "text": "Invoice #4821\nDate: 2024-03-15\nBill to: Acme Corp, 12 Main St.\n"
        "Total due: $1,234.56\n\nExtracted JSON:\n{\"invoice_number\": \""},
    {"name": "chat_colors", "chat": "List three colors of the rainbow."},
    {"name": "chat_extract", "chat": "Extract the name and email from: 'Contact Jane Doe at "
        "jane.doe@example.com for details.' Answer in JSON."},
]

TRICKY = [
    "Hello, world!",
    "  leading spaces and   runs of    whitespace\t\ttabs\n\n\nnewlines  ",
    "Numbers: 1234567890 3.14159 -42 1e-10 0x1F",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b\\"c"}, "e": {}}',
    "Unicode: café naïve 日本語 한국어 emoji 🎉👍🏽 Ελληνικά",
    "<|im_start|>user pretend special<|im_end|>",
    "mixed CASE words DON'T it's we'll they've",
    "\r\n windows\r\nlines\u00a0nbsp",
    "   ",
]


def render_chat(template: str, user: str) -> str:
    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
    return env.from_string(template).render(
        messages=[{"role": "user", "content": user}], add_generation_prompt=True)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def main() -> None:
    llm = llama_cpp.Llama(model_path=str(MODEL), n_ctx=2048, n_batch=512, n_threads=2,
                          logits_all=True, verbose=False)
    template = llm.metadata["tokenizer.chat_template"]
    out = {
        "reference": f"llama-cpp-python {llama_cpp.__version__}",
        "command": "$(scripts/setup-peers) scripts/make-goldens.py > tests/golden/llamacpp-smollm2.json",
        "model_sha256": hashlib.sha256(MODEL.read_bytes()).hexdigest(),
        "gen_tokens": GEN_TOKENS,
        "prompts": [],
        "tokenization": [],
    }
    for p in PROMPTS:
        chat = "chat" in p
        text = render_chat(template, p["chat"]) if chat else p["text"]
        tokens = llm.tokenize(text.encode(), add_bos=True, special=chat)
        llm.reset()
        llm.eval(tokens)
        generated, top = [], []
        for i in range(GEN_TOKENS):
            logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            tok = int(np.argmax(logits))
            if i < LOGPROB_POSITIONS:
                lp = log_softmax(logits)
                best = np.argsort(-lp, kind="stable")[:TOP]
                top.append([[int(t), float(lp[t])] for t in best])
            generated.append(tok)
            llm.eval([tok])
        entry = {"name": p["name"], "chat": chat, "text": text, "prompt_tokens": tokens,
                 "greedy_tokens": generated, "top_logprobs": top}
        if chat:
            entry["user"] = p["chat"]
        out["prompts"].append(entry)
    for s in TRICKY:
        toks = llm.tokenize(s.encode(), add_bos=False, special=False)
        out["tokenization"].append({"text": s, "tokens": toks,
                                    "decoded": llm.detokenize(toks).decode("utf-8", "replace")})
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
