"""Where a batch-1 decode step's GPU time goes, kernel by kernel, from kernel_trace.c's lines
(start end gridX gridY gridZ blockX graph-node name). Steps start at the `embedding` kernel; the
decode steps are those with the most common kernel count. The 8B shape's products are told
apart by kernel and grid, o and down (both 256 blocks of gemv_mma) by what precedes them."""
import collections
import statistics
import sys

D, QKV, INTER, VOCAB = 4096, 6144, 14336, 128256
BYTES = {"q|k|v": QKV * D * 2, "o": D * D * 2, "gate|up": 2 * INTER * D * 2, "down": D * INTER * 2,
         "head": VOCAB * D * 2}

def steps(path):
    rows = []
    for line in open(path):
        f = line.split(maxsplit=7)
        if len(f) < 8:
            continue
        rows.append((int(f[0]), int(f[1]), int(f[2]), f[7].strip()))
    rows.sort()
    out, cur = [], []
    for r in rows:
        if r[3] == "embedding" and cur:
            out.append(cur)
            cur = []
        cur.append(r)
    if cur:
        out.append(cur)
    if len(out) < 5:
        # No embedding kernel to mark a step: a gap of 20 us with nothing running does.
        out, cur, reach = [], [], 0
        for r in rows:
            if cur and r[0] > reach + 20000:
                out.append(cur)
                cur = []
            cur.append(r)
            reach = max(reach, r[1])
        if cur:
            out.append(cur)
    return out

def label(step):
    names, prev = [], ""
    for start, end, grid, name in step:
        if name.startswith("gemv_mma_rope"):
            n = "q|k|v"
        elif name.startswith("gemv_mma_silu"):
            n = "gate|up"
        elif name.startswith("gemv_mma"):
            n = "head" if grid > 1000 else ("o" if prev == "merge" or prev == "attention" else "down")
        elif name.startswith("flash_attention"):
            n = "attention"
        elif name.startswith("flash_merge"):
            n = "merge"
        elif name.startswith("add_rms_norm"):
            n = "norm"
        else:
            n = name[:40]
        names.append(n)
        prev = n
    return names

def main():
    path, copy = sys.argv[1], float(sys.argv[2])
    all_steps = steps(path)
    if not all_steps:
        sys.exit("step_table: no kernels traced")
    common = collections.Counter(len(s) for s in all_steps).most_common(1)[0][0]
    decode = [s for s in all_steps if len(s) == common][2:]  # the first ones warm up
    print(f"{len(all_steps)} steps traced, {len(decode)} decode steps of {common} kernels used")
    own, exposed, count = collections.defaultdict(list), collections.defaultdict(list), collections.Counter()
    spans = []
    for s in decode:
        names = label(s)
        reach = s[0][0]
        spans.append((max(e for _, e, _, _ in s) - s[0][0]) / 1e3)
        per_own, per_exp = collections.Counter(), collections.Counter()
        for (start, end, _, _), n in zip(s, names):
            per_own[n] += (end - start) / 1e3
            per_exp[n] += max(0, end - max(start, reach)) / 1e3
            reach = max(reach, end)
            count[n] += 1
        for n in per_own:
            own[n].append(per_own[n])
            exposed[n].append(per_exp[n])
    span = statistics.median(spans)
    print(f"GPU span of a decode step: median {span:.1f} us")
    print(f"{'kernel':<22}{'launches':>9}{'own us':>10}{'exposed us':>12}{'share':>7}  bandwidth own / exposed")
    for n in sorted(own, key=lambda n: -statistics.median(exposed[n])):
        o, e, c = statistics.median(own[n]), statistics.median(exposed[n]), count[n] // len(decode)
        line = f"{n:<22}{c:>9}{o:>10.1f}{e:>12.1f}{100 * e / span:>6.1f}%"
        if n in BYTES and copy > 0:
            b = BYTES[n] * c
            line += f"  {b / (o * 1e3) / copy:6.0%} / {b / (e * 1e3) / copy:6.0%}"
        print(line)

main()
