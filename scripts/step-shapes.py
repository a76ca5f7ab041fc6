#!/usr/bin/env python3
"""Sets each kind of forward in a QUARRY_CUDA_TIMING_STEPS log against decode steps of as many rows.

    QUARRY_CUDA_TIMING=step QUARRY_CUDA_TIMING_STEPS=steps.tsv quarry bench throughput ...
    scripts/step-shapes.py steps.tsv

Kinds: decode (every sequence one token), mixed (some sequence several, at most --prefill-from
tokens: jump-forward's known tokens, speculative checks) and prefill. For each mixed or prefill
step, "as decode" is the median span of the decode steps (same pass) whose token count is
within --near of its own; the table says how much longer the kind's steps took than that.
"""
import argparse
import statistics
from collections import defaultdict


def kind(longest, prefill_from):
    if longest <= 1:
        return "decode"
    return "mixed" if longest < prefill_from else "prefill"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log")
    ap.add_argument("--prefill-from", type=int, default=64)
    ap.add_argument("--near", type=float, default=0.08, help="relative token-count window")
    a = ap.parse_args()
    passes = defaultdict(list)
    with open(a.log) as f:
        next(f)
        for line in f:
            p, tokens, seqs, longest, graph, span, idle = line.split("\t")
            passes[int(p)].append(
                (int(tokens), int(seqs), int(longest), graph == "1", float(span), float(idle))
            )
    for p, steps in sorted(passes.items()):
        decode = sorted((t, span) for t, _, l, _, span, _ in steps if l <= 1)
        print(f"pass {p}: {len(steps)} forwards")
        print(f"  {'kind':8} {'steps':>5} {'graph':>5} {'tokens':>8} {'span ms':>9} {'idle ms':>8} {'as decode':>9} {'matched':>7} {'over':>6}")
        for k in ("decode", "mixed", "prefill"):
            rows = [s for s in steps if kind(s[2], a.prefill_from) == k]
            if not rows:
                continue
            span = sum(s[4] for s in rows)
            idle = sum(s[5] for s in rows if s[5] == s[5])
            matched, actual, predicted = 0, 0.0, 0.0
            if k != "decode":
                for t, _, _, _, s, _ in rows:
                    near = [d for n, d in decode if abs(n - t) <= a.near * t]
                    if near:
                        matched += 1
                        actual += s
                        predicted += statistics.median(near)
            over = f"{actual / predicted:6.3f}" if predicted else "     -"
            print(
                f"  {k:8} {len(rows):5} {sum(s[3] for s in rows):5} {sum(s[0] for s in rows):8}"
                f" {span:9.1f} {idle:8.1f} {predicted:9.1f} {matched:7} {over}"
            )


if __name__ == "__main__":
    main()
