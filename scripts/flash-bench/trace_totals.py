#!/usr/bin/env python3
"""Each kernel's launches and GPU time in a kernel_trace.c trace, pass by pass.

    KERNEL_TRACE_COPIES=/tmp/copies.txt scripts/flash-bench/step-trace quarry bench throughput ...
    scripts/flash-bench/trace_totals.py /tmp/kernel-trace.txt --copies /tmp/copies.txt --split 154

The trace is cut into passes where the device idles longer than --gap ms; --split N cuts a pass
that holds more than N `embedding` launches (one a forward) after its N-th, for two passes run
back to back (`bench throughput --workload extract`: the constrained pass's forwards, then the
unconstrained one's). With --copies, each pass's copies by kind (1 host to device, 2 device to
host, 8 within the device): how many, their bytes and their time.
"""
import argparse
import collections


def passes(kernels, gap_ms, split):
    out, cur, end = [], [], 0
    for k in kernels:
        if cur and k[0] - end > gap_ms * 1e6:
            out.append(cur)
            cur = []
        cur.append(k)
        end = max(end, k[1])
    out.append(cur)
    if split:
        cut = []
        for p in out:
            forwards = [i for i, k in enumerate(p) if k[2].startswith("embedding")]
            cut += [p[: forwards[split]], p[forwards[split]:]] if len(forwards) > split else [p]
        out = cut
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--copies")
    ap.add_argument("--gap", type=float, default=50.0, help="idle ms that ends a pass")
    ap.add_argument("--split", type=int, default=0)
    ap.add_argument("--min-ms", type=float, default=300.0, help="passes shorter than this are left out")
    ap.add_argument("--top", type=int, default=28)
    a = ap.parse_args()
    kernels = []
    with open(a.trace) as f:
        for line in f:
            p = line.split(maxsplit=7)
            kernels.append((int(p[0]), int(p[1]), p[7].split("(")[0].strip()))
    kernels.sort()
    copies = []
    if a.copies:
        with open(a.copies) as f:
            copies = [tuple(map(int, line.split())) for line in f]
    for i, p in enumerate(passes(kernels, a.gap, a.split)):
        lo, hi = p[0][0], max(k[1] for k in p)
        if (hi - lo) / 1e6 < a.min_ms:
            continue
        forwards = sum(1 for k in p if k[2].startswith("embedding"))
        print(f"pass {i}: {len(p)} kernels over {(hi - lo) / 1e6:.0f} ms, {forwards} forwards")
        totals = collections.defaultdict(lambda: [0, 0.0])
        for start, end, name in p:
            totals[name][0] += 1
            totals[name][1] += (end - start) / 1e6
        for name, (n, ms) in sorted(totals.items(), key=lambda x: -x[1][1])[: a.top]:
            print(f"  {name[:44]:44} {n:7} {ms:9.1f} ms")
        by_kind = collections.defaultdict(lambda: [0, 0, 0.0])
        for start, end, size, kind in copies:
            if lo <= start < hi:
                t = by_kind[kind]
                t[0] += 1
                t[1] += size
                t[2] += (end - start) / 1e6
        for kind, (n, size, ms) in sorted(by_kind.items()):
            print(f"  copies of kind {kind}: {n}, {size / 1e6:.1f} MB, {ms:.1f} ms")


if __name__ == "__main__":
    main()
