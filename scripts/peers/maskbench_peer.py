#!/usr/bin/env python3
"""MaskBench for a peer grammar engine (llguidance), the same protocol as quarry-grammar's
`maskbench` example, so the two SUMMARY lines compare directly.

For each schema: compile (timed); for each test instance, serialize it as Python's json.dumps
does (", " and ": " separators, non-ASCII kept), tokenize canonically with the fixture
tokenizer, then before each token compute the mask (timed) and check the token is in it;
after the last token, check EOS is allowed. A valid instance must pass every check; an
invalid one must fail one. A schema passes when it compiles and every instance behaves.

  python maskbench_peer.py CORPUS.jsonl.gz --tokenizer FIXTURE.json [--limit N]
      [--whitespace flexible|compact]
"""
import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import llguidance
from tokenizers import Tokenizer


def percentile(xs, q):
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("corpus")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--every", type=int, default=1, help="take every Nth schema")
    p.add_argument("--whitespace", choices=["flexible", "compact"], default="flexible")
    a = p.parse_args()

    eos_name = Path(a.tokenizer).with_suffix(".eos").read_text().strip()
    hf = Tokenizer.from_file(a.tokenizer)
    eos = hf.token_to_id(eos_name)
    lltok = llguidance.LLTokenizer(a.tokenizer, eos_token=eos)
    if a.whitespace == "flexible":
        options = {"whitespace_flexible": True}
    else:
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    words = (lltok.vocab_size + 31) // 32
    mask = np.zeros(words, dtype=np.int32)

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
            grammar = llguidance.LLMatcher.grammar_from_json_schema(entry["schema"], defaults=options)
            matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
            if matcher.is_error():
                continue
            compile_ms.append((time.perf_counter() - t0) * 1e3)
            compiled += 1
            ok = True
            for test in entry["tests"]:
                text = json.dumps(test["data"], ensure_ascii=False)
                ids = hf.encode(text, add_special_tokens=False).ids + [eos]
                m = matcher.deep_copy()
                accepted = True
                for tok in ids:
                    t = time.perf_counter_ns()
                    m.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
                    mask_us.append((time.perf_counter_ns() - t) / 1e3)
                    if not (mask[tok >> 5] >> (tok & 31)) & 1 or not m.consume_token(tok):
                        accepted = False
                        break
                if test["valid"] and not accepted:
                    valid_rejected += 1
                    ok = False
                elif not test["valid"] and accepted:
                    invalid_accepted += 1
                    ok = False
            passing += ok
    print(f"SUMMARY engine=llguidance-{llguidance.__name__ and '1.9.1'}-{a.whitespace} schemas={schemas} "
          f"compiled={compiled} passing={passing} invalid_accepted={invalid_accepted} "
          f"valid_rejected={valid_rejected} mask_mean_us={statistics.fmean(mask_us) if mask_us else 0:.2f} "
          f"mask_p50_us={percentile(mask_us, 0.5):.2f} mask_p99_us={percentile(mask_us, 0.99):.2f} "
          f"mask_max_us={max(mask_us, default=0):.2f} compile_p50_ms={percentile(compile_ms, 0.5):.3f} "
          f"compile_p99_ms={percentile(compile_ms, 0.99):.3f}")


if __name__ == "__main__":
    main()
