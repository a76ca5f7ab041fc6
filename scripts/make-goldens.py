#!/usr/bin/env python3
"""Golden outputs of llama.cpp (through llama-cpp-python) on the default model, for
tests/reference.rs. Regenerate with:

    $(scripts/setup-peers) scripts/make-goldens.py > tests/golden/llamacpp-smollm2.json

Records, for each prompt: the prompt tokens, the greedy continuation (64 tokens, end of
generation ignored), the top-5 log-probabilities at every generated position, and llama.cpp's
disagreement with itself: the same sequence scored token by token (n_batch=1) instead of in
one batch moves its log-probabilities by `self_spread` at most. On this Q4_1 model that spread
is far from zero (activations of magnitude ~2,500 are quantized to 8 bits, so an ulp anywhere
can flip a rounding), and it is what bounds any agreement with another implementation.
Also: for each tricky string, its tokens; for chat prompts, the template rendered by jinja2
(as transformers renders it).
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
TOP = 5

PROMPTS = [
    {"name": "capital", "text": "The capital of France is"},
    {"name": "code", "text": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'},
    {"name": "invoice", "text": "Invoice #4821\nDate: 2024-03-15\nBill to: Acme Corp, 12 Main St.\n"
        "Total due: $1,234.56\n\nExtracted JSON:\n{\"invoice_number\": \""},
    {"name": "chat_colors", "chat": "List three colors of the rainbow."},
    {"name": "chat_extract", "chat": "Extract the name and email from: 'Contact Jane Doe at "
        "jane.doe@example.com for details.' Answer in JSON."},
    {"name": "counting", "text": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"},
    {"name": "alphabet", "text": "The alphabet: A, B, C, D, E, F,"},
    {"name": "weekdays", "text": "Monday, Tuesday, Wednesday,"},
    {"name": "imports", "text": "import numpy as np\nimport pandas as pd\n\ndef load_csv(path):\n"},
    {"name": "jsonl", "text": '{"name": "Alice", "age": 30, "city": "Paris"}\n{"name": "Bob", "age": 25, "city": '},
    {"name": "html", "text": "<!DOCTYPE html>\n<html>\n<head>\n<title>"},
    {"name": "chat_translate", "chat": "Translate to French: Good morning, how are you?"},
    # Continuations without near-ties: copying and sequences (induction over the paged context).
    {"name": "evens", "text": "2, 4, 6, 8, 10, 12, 14, 16,"},
    {"name": "countdown", "text": "100, 99, 98, 97, 96, 95,"},
    {"name": "repeat_fox", "text": "The quick brown fox jumps over the lazy dog. " * 3},
    {"name": "copy_list", "text": "apple banana cherry date elderberry fig grape\n" * 2 + "apple"},
    {"name": "json_lines", "text": '{"id": 1, "ok": true}\n{"id": 2, "ok": true}\n{"id": 3, "ok": true}\n'},
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


def load(n_batch: int):
    # f32 K/V and no flash attention: llama.cpp's attention then runs in f32 as Quarry's CPU
    # backend does (its default f16 cache adds its own rounding on top).
    return llama_cpp.Llama(model_path=str(MODEL), n_ctx=2048, n_batch=n_batch, n_ubatch=n_batch,
                           n_threads=2, logits_all=True, verbose=False, flash_attn=False,
                           type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)


def rows_logprobs(llm, start: int, n: int) -> np.ndarray:
    return np.stack([log_softmax(np.array(llm.scores[start + i], dtype=np.float64)) for i in range(n)])


def main() -> None:
    llm, token_by_token = load(512), load(1)
    template = llm.metadata["tokenizer.chat_template"]
    out = {
        "reference": f"llama-cpp-python {llama_cpp.__version__}",
        "settings": "n_ctx=2048 n_batch=512 n_threads=2 flash_attn=False type_k=type_v=F32",
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
        generated = []
        for _ in range(GEN_TOKENS):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            generated.append(tok)
            llm.eval([tok])
        lp = rows_logprobs(llm, len(tokens) - 1, GEN_TOKENS)
        # The same sequence, scored one token at a time.
        token_by_token.reset()
        token_by_token.eval(tokens + generated[:-1])
        lp1 = rows_logprobs(token_by_token, len(tokens) - 1, GEN_TOKENS)
        top = []
        spread = 0.0
        for i in range(GEN_TOKENS):
            best = np.argsort(-lp[i], kind="stable")[:TOP]
            top.append([[int(t), float(lp[i][t])] for t in best])
            spread = max(spread, float(np.abs(lp[i][best] - lp1[i][best]).max()))
        entry = {"name": p["name"], "chat": chat, "text": text, "prompt_tokens": tokens,
                 "greedy_tokens": generated, "self_spread": spread, "top_logprobs": top}
        if chat:
            entry["user"] = p["chat"]
        out["prompts"].append(entry)
        margins = [t[0][1] - t[1][1] for t in top]
        print(f"{p['name']}: self_spread {spread:.3f}, min margin {min(margins):.3f}", file=sys.stderr)
    for s in TRICKY:
        toks = llm.tokenize(s.encode(), add_bos=False, special=False)
        out["tokenization"].append({"text": s, "tokens": toks,
                                    "decoded": llm.detokenize(toks).decode("utf-8", "replace")})
    json.dump(out, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
