"""Seeded random models saved by transformers, with the logits and greedy continuations
transformers computes for them: the reference for tests/gpu_transformers.rs.

  python3 scripts/peers/transformers_reference.py OUT_DIR

writes OUT_DIR/llama and OUT_DIR/qwen2, each a model directory (config.json,
model.safetensors, bf16) plus reference.json: {"prompts": [{"ids", "last_logits",
"bf16_logits", "greedy"}]}. The reference is the saved bf16 weights computed in float32
(last_logits, greedy); bf16_logits are transformers' own bf16 computation of the same
weights, whose distance from the float32 logits is the spread bf16 arithmetic itself allows.
The vocabulary is the default model's (49,152), so its tokenizer can be added to the
directories (quarry export-tokenizer).
"""
import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=640, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
             rms_norm_eps=1e-5, initializer_range=0.1)
MODELS = {
    # The llama has its own head, the qwen2 ties it to the embedding (both paths are read).
    "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1000000.0, tie_word_embeddings=True)),
}
GREEDY = 16


def main():
    out = sys.argv[1]
    for name, (config_cls, model_cls, extra) in MODELS.items():
        torch.manual_seed(0)
        config = config_cls(**SHAPE, **extra)
        model = model_cls(config).to(device="cuda", dtype=torch.bfloat16).eval()
        d = os.path.join(out, name)
        model.save_pretrained(d)
        exact = model_cls(config).to(device="cuda", dtype=torch.float32).eval()
        exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        g = torch.Generator().manual_seed(1)
        prompts = []
        for n in (1, 5, 37, 150, 700):
            ids = torch.randint(0, SHAPE["vocab_size"], (1, n), generator=g).cuda()
            with torch.inference_mode():
                logits = exact(ids).logits[0, -1].float().tolist()
                bf16 = model(ids).logits[0, -1].float().tolist()
                gen = exact.generate(ids, do_sample=False, max_new_tokens=GREEDY, min_new_tokens=GREEDY,
                                     pad_token_id=0, eos_token_id=None)
            prompts.append({"ids": ids[0].tolist(), "last_logits": logits, "bf16_logits": bf16,
                            "greedy": gen[0, n:].tolist()})
        with open(os.path.join(d, "reference.json"), "w") as f:
            json.dump({"model": name, "transformers": __import__("transformers").__version__,
                       "prompts": prompts}, f)
        print(f"{name}: {d}")


if __name__ == "__main__":
    main()
