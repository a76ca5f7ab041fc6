"""The GPU peer for scripts/gpu-check: transformers on the same shape as quarry's dummy
weights (random bf16 weights, seeded), in the same run. Prints one JSON object.

  python3 scripts/peers/transformers_gpu.py --config llama-3.1-8b \
      --num-prompts 256 --input-len 512 --output-len 128
"""
import argparse
import json
import sys
import time

import torch
from transformers import CompileConfig, LogitsProcessorList, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

SHAPES = {
    "llama-3.1-8b": (LlamaConfig, LlamaForCausalLM, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=8192)),
    "qwen2.5-7b": (Qwen2Config, Qwen2ForCausalLM, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768)),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=256, help="requests per generate call")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled batch-1 path")
    args = ap.parse_args()

    config_cls, model_cls, shape = SHAPES[args.config]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = model_cls(config_cls(**shape)).eval()
    gen = dict(do_sample=False, min_new_tokens=args.output_len, max_new_tokens=args.output_len,
               pad_token_id=0, eos_token_id=None)
    vocab = shape["vocab_size"]
    g = torch.Generator().manual_seed(1)

    def prompts(n):
        return torch.randint(0, vocab, (n, args.input_len), generator=g).cuda()

    # Batch-1 decode: the time between the first and the last generated token over the tokens
    # between (a logits processor notes the clock at every step, after the step's work is done),
    # after warm-ups, so one generate length serves (a static cache is sized by it). Two paths:
    # eager generate with its default cache, and the fastest one transformers has for one
    # stream, a static cache with the forward compiled under torch.compile(mode="reduce-overhead")
    # (CUDA graphs).
    one = prompts(1)

    class Clock:
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    def decode_ms(m, extra, warmups):
        with torch.inference_mode():
            for _ in range(warmups):
                m.generate(one, **{**gen, **extra})
            clock = Clock()
            m.generate(one, **{**gen, **extra}, logits_processor=LogitsProcessorList([clock]))
        t = clock.times
        return (t[-1] - t[0]) * 1000 / max(len(t) - 1, 1)

    eager_ms = decode_ms(model, {}, 1)
    compiled_ms, compiled_error = None, None
    if not args.no_compile:
        # generate compiles its own decoding step when the cache is static (prefill stays eager).
        try:
            t0 = time.perf_counter()
            compiled = {"cache_implementation": "static",
                        "compile_config": CompileConfig(mode="reduce-overhead", fullgraph=True)}
            compiled_ms = decode_ms(model, compiled, 3)
            print(f"compiled path ready after {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        except Exception as e:  # the eager numbers still stand
            compiled_error = f"{type(e).__name__}: {e}"[:500]

    # Throughput: every request in batches of --batch, equal lengths (no padding).
    out_tokens = 0
    with torch.inference_mode():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for start in range(0, args.num_prompts, args.batch):
            n = min(args.batch, args.num_prompts - start)
            ids = prompts(n)
            out = model.generate(ids, **gen)
            out_tokens += (out.shape[1] - ids.shape[1]) * n
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    print(json.dumps({
        "engine": f"transformers {__import__('transformers').__version__} (eager generate, batch {args.batch})",
        "config": args.config,
        "decode_ms_per_token": min(x for x in (eager_ms, compiled_ms) if x is not None),
        "eager_decode_ms_per_token": eager_ms, "compiled_decode_ms_per_token": compiled_ms,
        "compiled_error": compiled_error,
        "num_prompts": args.num_prompts, "output_tokens": out_tokens, "seconds": seconds,
        "output_tok_s": out_tokens / seconds,
    }))


if __name__ == "__main__":
    main()
