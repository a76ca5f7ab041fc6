#!/usr/bin/env python3
"""MaskBench for a peer grammar engine (llguidance, xgrammar or outlines-core), the same
protocol as quarry-grammar's `maskbench` example, so the SUMMARY lines compare directly.

For each schema: compile (timed); for each test instance, serialize it as Python's json.dumps
does (", " and ": " separators, non-ASCII kept), tokenize canonically with the fixture
tokenizer, then before each token compute the mask (timed) and check the token is in it;
after the last token, check EOS is allowed. A valid instance must pass every check; an
invalid one must fail one. A schema passes when it compiles and every instance behaves.

  python maskbench_peer.py CORPUS.jsonl.gz --tokenizer FIXTURE.json [--limit N] [--every N]
      [--engine llguidance|xgrammar|outlines-core] [--whitespace flexible|compact]

"flexible" admits any whitespace between tokens (llguidance: whitespace_flexible; xgrammar:
any_whitespace; outlines-core: its default whitespace pattern); "compact" fixes the
separators to the ones the corpus instances use.
"""
import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


def percentile(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def byte_decoder():
    """GPT-2's byte-level alphabet reversed: token text back to the bytes it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class Llguidance:
    def __init__(self, fixture, eos, whitespace):
        import llguidance

        self.name = f"llguidance-1.9.1-{whitespace}"
        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(fixture, eos_token=eos)
        if whitespace == "flexible":
            self.options = {"whitespace_flexible": True}
        else:
            self.options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        self.words = (self.tok.vocab_size + 31) // 32
        self.mask = np.zeros(self.words, dtype=np.int32)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)
        matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        return None if matcher.is_error() else matcher

    def start(self, compiled):
        return compiled.deep_copy()

    def fill(self, m):
        m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.words * 4)

    def allowed(self, tok):
        return (self.mask[tok >> 5] >> (tok & 31)) & 1

    def accept(self, m, tok):
        return m.consume_token(tok)


class Xgrammar:
    def __init__(self, fixture, eos, whitespace):
        import transformers
        import xgrammar

        self.name = f"xgrammar-0.2.8-{whitespace}"
        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=fixture)
        size = Tokenizer.from_file(fixture).get_vocab_size(True)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=size, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.flexible = whitespace == "flexible"
        self.mask = np.zeros((1, (size + 31) // 32), dtype=np.int32)

    def compile(self, schema):
        try:
            if self.flexible:
                return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
            return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        except Exception:
            return None

    def start(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m):
        m.fill_next_token_bitmask(self.mask)

    def allowed(self, tok):
        return (self.mask[0, tok >> 5] >> (tok & 31)) & 1

    def accept(self, m, tok):
        return m.accept_token(tok)


class OutlinesCore:
    def __init__(self, fixture, eos, whitespace):
        import outlines_core

        self.name = f"outlines-core-0.2.14-{whitespace}"
        self.oc = outlines_core
        hf = Tokenizer.from_file(fixture)
        decode = byte_decoder()
        special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        tokens = {}
        for text, i in hf.get_vocab(True).items():
            if i in special:
                continue
            try:
                tokens.setdefault(bytes(decode[c] for c in text), []).append(i)
            except KeyError:
                continue
        self.vocab = outlines_core.Vocabulary(eos, tokens)
        self.eos = eos
        self.whitespace = None if whitespace == "flexible" else r"[ ]?"
        self.size = hf.get_vocab_size(True)
        self.mask = np.zeros((self.size + 31) // 32, dtype=np.int32)

    def compile(self, schema):
        try:
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), self.whitespace)
            return self.oc.Index(regex, self.vocab)
        except Exception:
            return None

    def start(self, index):
        return self.oc.Guide(index)

    def fill(self, g):
        g.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)

    def allowed(self, tok):
        return (self.mask[tok >> 5] >> (tok & 31)) & 1

    def accept(self, g, tok):
        # EOS is allowed only in a final state, and the guide has no transition for it.
        if tok == self.eos:
            return True
        try:
            g.advance(tok)
            return True
        except Exception:
            return False


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("corpus")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--every", type=int, default=1, help="take every Nth schema")
    p.add_argument("--engine", choices=sorted(ENGINES), default="llguidance")
    p.add_argument("--whitespace", choices=["flexible", "compact"], default="flexible")
    a = p.parse_args()

    eos_name = Path(a.tokenizer).with_suffix(".eos").read_text().strip()
    hf = Tokenizer.from_file(a.tokenizer)
    eos = hf.token_to_id(eos_name)
    engine = ENGINES[a.engine](a.tokenizer, eos, a.whitespace)

    schemas = compiled = passing = invalid_accepted = valid_rejected = 0
    mask_us, compile_ms = [], []
    with gzip.open(a.corpus, "rt") as f:
        for i, line in enumerate(f):
            if i % a.every:
                continue
            if a.limit and schemas >= a.limit:
                break
            entry = json.loads(line)
            schemas += 1
            t0 = time.perf_counter()
            grammar = engine.compile(entry["schema"])
            if grammar is None:
                continue
            compile_ms.append((time.perf_counter() - t0) * 1e3)
            compiled += 1
            ok = True
            for test in entry["tests"]:
                text = json.dumps(test["data"], ensure_ascii=False)
                ids = hf.encode(text, add_special_tokens=False).ids + [eos]
                m = engine.start(grammar)
                accepted = True
                for tok in ids:
                    t = time.perf_counter_ns()
                    engine.fill(m)
                    mask_us.append((time.perf_counter_ns() - t) / 1e3)
                    if not engine.allowed(tok) or not engine.accept(m, tok):
                        accepted = False
                        break
                if test["valid"] and not accepted:
                    valid_rejected += 1
                    ok = False
                elif not test["valid"] and accepted:
                    invalid_accepted += 1
                    ok = False
            passing += ok
    print(f"SUMMARY engine={engine.name} schemas={schemas} "
          f"compiled={compiled} passing={passing} invalid_accepted={invalid_accepted} "
          f"valid_rejected={valid_rejected} mask_mean_us={statistics.fmean(mask_us) if mask_us else 0:.2f} "
          f"mask_p50_us={percentile(mask_us, 0.5):.2f} mask_p99_us={percentile(mask_us, 0.99):.2f} "
          f"mask_max_us={max(mask_us, default=0):.2f} compile_p50_ms={percentile(compile_ms, 0.5):.3f} "
          f"compile_p99_ms={percentile(compile_ms, 0.99):.3f}")


if __name__ == "__main__":
    main()
