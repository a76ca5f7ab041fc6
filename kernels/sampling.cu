// What the sampler's options make of a row's scores before the draw, in one pass over every row
// that has any of them (block (b, y) takes row rows[b] and every gridDim.y-th stretch of
// blockDim.x tokens from the y-th), so that a batch is a few thousand blocks, not one per 256
// tokens of every row of the logits, twins included, once per option:
// - context-aware decoding where twins[r] >= 0: the row becomes (1 + w) * row - w * row
//   twins[r], with one_plus[r] = 1 + w and weight[r] = w as the host rounds them, each product
//   and the difference rounded as the engine's `contrast` rounds them. Twins are rows no listed
//   row is: they are read, never written;
// - the grammar's mask where mask_rows[r] >= 0: one packed u32 word per 32 tokens (bit t % 32 of
//   word t / 32) of mask row mask_rows[r]; a cleared bit sets the score to -inf;
// - the copy bias where bias_rows[r] >= 0: bias[r] added to the tokens that bias mask row
//   bias_rows[r] allows (a token the grammar refused stays -inf, as -inf + bias is).
// Where kept is not null, a masked row's shaped scores go to its row of kept as well: a
// pipelined draw's redraw reads them there after the next pass has overwritten the logits, and
// writing them here costs a row's write, where a copy afterwards read and wrote it again.
extern "C" __global__ void shape_scores(float* logits, const u32* rows, const int* twins, const float* one_plus,
                                        const float* weight, const u32* masks, const int* mask_rows,
                                        const u32* bias_masks, const int* bias_rows, const float* bias, int vocab,
                                        int words, float* kept) {
    after_previous_kernel();
    int r = rows[blockIdx.x], twin = twins[r], m = mask_rows[r], b = bias_rows[r];
    float* __restrict__ row = logits + (size_t)r * vocab;
    const float* __restrict__ other = twin >= 0 ? logits + (size_t)twin * vocab : nullptr;
    const u32* mask = m >= 0 ? masks + (size_t)m * words : nullptr;
    const u32* allow = b >= 0 ? bias_masks + (size_t)b * words : nullptr;
    float* __restrict__ keep = kept && mask ? kept + (size_t)r * vocab : nullptr;
    float op = other ? one_plus[r] : 0.0f, w = other ? weight[r] : 0.0f, add = allow ? bias[r] : 0.0f;
    int stride = gridDim.y * blockDim.x;
#pragma unroll 4
    for (int t = blockIdx.y * blockDim.x + threadIdx.x; t < vocab; t += stride) {
        float x = row[t];
        if (other) x = __fsub_rn(__fmul_rn(op, x), __fmul_rn(w, other[t]));
        if (mask && !((mask[t >> 5] >> (t & 31)) & 1u))
            x = NEG_INF;
        else if (allow && ((allow[t >> 5] >> (t & 31)) & 1u))
            x += add;
        row[t] = x;
        if (keep) keep[t] = x;
    }
}

// Penalties, one thread per (row, token): the repetition factor divides a positive logit and
// multiplies a negative one, then the sum of the additive penalties (frequency, presence, DRY)
// is added, in the CPU sampler's order. A token appears at most once per row.
// The value before the penalty goes to saved[i]: log-probabilities are of the logits before
// penalties, and a redraw starts again from them.
extern "C" __global__ void apply_penalties(float* logits, int vocab, const u32* rows, const u32* tokens,
                                           const float* factors, const float* adds, float* saved, int count) {
    after_previous_kernel();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float* v = logits + (size_t)rows[i] * vocab + tokens[i];
    float x = *v;
    saved[i] = x;
    float f = factors[i];
    if (f != 1.0f) x = x > 0.0f ? x / f : x * f;
    *v = x + adds[i];
}

// Puts back the values apply_penalties saved, for entries start..start + count.
extern "C" __global__ void restore_values(float* logits, int vocab, const u32* rows, const u32* tokens,
                                          const float* saved, int start, int count) {
    after_previous_kernel();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    i += start;
    logits[(size_t)rows[i] * vocab + tokens[i]] = saved[i];
}

// The larger of two (value, id) pairs; the lower id among equal values (the CPU's order).
__device__ __forceinline__ void better(float& v, int& idx, float ov, int oi) {
    if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
}

// The block's best (value, id), for every thread.
__device__ void block_best(float& v, int& idx) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) { bv[warp] = v; bi[warp] = idx; }
    __syncthreads();
    v = lane < warps ? bv[lane] : NEG_INF;
    idx = lane < warps ? bi[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) better(v, idx, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, idx, o));
}

// Log-probabilities as the CPU sampler reports them: of the logits after the mask and the copy
// bias, before penalties and temperature. Block b takes logits row rows[b] and writes record b of
// 1 + 2 * MAX_TOP floats: log Z, then the n best (id as bits, logit), best first.
#define MAX_TOP 32
extern "C" __global__ void logprob_stats(const float* logits, const u32* rows, int vocab, int n, float* out) {
    after_previous_kernel();
    __shared__ int chosen[MAX_TOP];
    const float* row = logits + (size_t)rows[blockIdx.x] * vocab;
    float* rec = out + (size_t)blockIdx.x * (1 + 2 * MAX_TOP);
    float m = NEG_INF;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) m = fmaxf(m, row[t]);
    int unused = 0;
    block_best(m, unused);
    float sum = 0.0f;
    if (m > NEG_INF) {
        for (int t = threadIdx.x; t < vocab; t += blockDim.x) sum += expf(row[t] - m);
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) rec[0] = m + logf(sum);
    for (int k = 0; k < n && k < MAX_TOP; k++) {
        float v = NEG_INF;
        int idx = 0x7fffffff;
        for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
            bool taken = false;
            for (int j = 0; j < k; j++) taken |= chosen[j] == t;
            if (!taken) better(v, idx, row[t], t);
        }
        block_best(v, idx);
        if (threadIdx.x == 0) {
            chosen[k] = idx;
            rec[1 + 2 * k] = __uint_as_float((u32)idx);
            rec[2 + 2 * k] = v;
        }
        __syncthreads();
    }
}

// values[i] = the logit of the token out[token_at[i]] drew in row rows[i] (after penalties: the
// host puts back the saved value where the token had one).
extern "C" __global__ void chosen_values(const float* logits, int vocab, const u32* rows, const u32* token_at,
                                         const u32* out, float* values, int count) {
    after_previous_kernel();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    values[i] = logits[(size_t)rows[i] * vocab + out[token_at[i]]];
}

// Greedy: the index of each listed row's largest logit, the lowest index among equals (as the
// CPU sampler's argmax). Block b takes row rows[b] and writes out[rows[b]]. At batch 1 this one
// block reading a 128k-entry row sits between the head and the next step: a row whose width is a
// multiple of 4 is read in 16-byte pieces, four a thread in flight, each thread's indices
// rising so that its first best is its lowest.
__device__ __forceinline__ void argmax_take(float4 q, int at, float& v, int& idx) {
    if (q.x > v) { v = q.x; idx = at; }
    if (q.y > v) { v = q.y; idx = at + 1; }
    if (q.z > v) { v = q.z; idx = at + 2; }
    if (q.w > v) { v = q.w; idx = at + 3; }
}

extern "C" __global__ void argmax(const float* logits, const u32* rows, int vocab, u32* out) {
    after_previous_kernel();
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const u32 r = rows[blockIdx.x];
    const float* row = logits + (size_t)r * vocab;
    float v = NEG_INF;
    int idx = 0x7fffffff;
    if ((vocab & 3) == 0) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
        int n4 = vocab >> 2, step = blockDim.x, c = threadIdx.x;
        for (; c + 3 * step < n4; c += 4 * step) {
            float4 q[4];
#pragma unroll
            for (int u = 0; u < 4; u++) q[u] = row4[c + u * step];
#pragma unroll
            for (int u = 0; u < 4; u++) argmax_take(q[u], 4 * (c + u * step), v, idx);
        }
        for (; c < n4; c += step) argmax_take(row4[c], 4 * c, v, idx);
    } else {
        for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
            float x = row[t];
            if (x > v) { v = x; idx = t; }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { best_v[warp] = v; best_i[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        int warps = (blockDim.x + 31) >> 5;
        v = lane < warps ? best_v[lane] : NEG_INF;
        idx = lane < warps ? best_i[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, o);
            int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
        }
        if (lane == 0) out[r] = idx == 0x7fffffff ? 0u : (u32)idx;
    }
}

// The drawn token's probability under the temperature-1 softmax of its row's final scores (the
// mask, bias and penalties applied; not the draw's temperature or cuts), and how many tokens
// those scores allow: the engine sampler's TokenConfidence. Block b: row rows[b], whose token
// is out[token_at[b]]; records[2b] = the probability, records[2b + 1] = the count (as bits).
extern "C" __global__ void drawn_confidence(const float* logits, int vocab, const u32* rows, const u32* token_at,
                                            const u32* out, float* records) {
    after_previous_kernel();
    const float* row = logits + (size_t)rows[blockIdx.x] * vocab;
    float m = NEG_INF, c = 0.0f;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
        float v = row[t];
        m = fmaxf(m, v);
        if (v > NEG_INF) c += 1.0f;
    }
    m = block_max(m);
    float z = 0.0f;
    if (m > NEG_INF)
        for (int t = threadIdx.x; t < vocab; t += blockDim.x)
            if (row[t] > NEG_INF) z += expf(row[t] - m);
    z = block_sum(z);
    c = block_sum(c);
    if (threadIdx.x == 0) {
        float v = row[out[token_at[blockIdx.x]]];
        records[2 * blockIdx.x] = (v > NEG_INF && z > 0.0f) ? expf(v - m) / z : 0.0f;
        records[2 * blockIdx.x + 1] = __uint_as_float((u32)c);
    }
}

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): a counter-based
// generator, so a request's draw depends only on its seed and its output index, never on
// which other requests share the batch.
__device__ __forceinline__ uint4 philox(uint4 ctr, uint2 key) {
    for (int i = 0; i < 10; i++) {
        u32 hi0 = __umulhi(0xD2511F53u, ctr.x), lo0 = 0xD2511F53u * ctr.x;
        u32 hi1 = __umulhi(0xCD9E8D57u, ctr.z), lo1 = 0xCD9E8D57u * ctr.z;
        uint4 next;
        next.x = hi1 ^ ctr.y ^ key.x;
        next.y = lo1;
        next.z = hi0 ^ ctr.w ^ key.y;
        next.w = lo0;
        ctr = next;
        key.x += 0x9E3779B9u;
        key.y += 0xBB67AE85u;
    }
    return ctr;
}

// A uniform draw in [0, 1) for (seed, counter).
__device__ __forceinline__ float philox_uniform(u64 seed, u64 counter) {
    uint4 ctr;
    ctr.x = (u32)counter;
    ctr.y = (u32)(counter >> 32);
    ctr.z = 0u;
    ctr.w = 0u;
    uint2 key;
    key.x = (u32)seed;
    key.y = (u32)(seed >> 32);
    uint4 r = philox(ctr, key);
    return (float)(r.x >> 8) * (1.0f / 16777216.0f);
}

// Per row: temperature (> 0), top_k (0: all), top_p (1: all), min_p (0: none), seed, counter.
struct SampleParams {
    float temperature;
    int top_k;
    float top_p;
    float min_p;
    u64 seed;
    u64 counter;
};

#define SAMPLE_THREADS 1024

// Sum and count over the block of the weights at or above `cut`.
__device__ void kept_totals(const float* row, int vocab, float max, float inv_t, float cut, float* sum, int* count) {
    __shared__ float s_sum[32];
    __shared__ int s_count[32];
    float s = 0.0f;
    int c = 0;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
        float w = expf((row[t] - max) * inv_t);
        if (w > 0.0f && w >= cut) { s += w; c++; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
        c += __shfl_xor_sync(0xffffffffu, c, o);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { s_sum[warp] = s; s_count[warp] = c; }
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x >> 5;
        s = lane < warps ? s_sum[lane] : 0.0f;
        c = lane < warps ? s_count[lane] : 0;
        for (int o = 16; o > 0; o >>= 1) {
            s += __shfl_xor_sync(0xffffffffu, s, o);
            c += __shfl_xor_sync(0xffffffffu, c, o);
        }
        if (lane == 0) { s_sum[0] = s; s_count[0] = c; }
    }
    __syncthreads();
    *sum = s_sum[0];
    *count = s_count[0];
    __syncthreads();
}

// Temperature, min-p, top-k and top-p as the CPU sampler applies them, on masked logits, then
// one seeded draw. Each filter keeps the tokens whose weight exp((logit - max) / T) reaches a
// threshold, found by bisection over the weight (the CPU sorts instead, and breaks a tie that
// straddles the k-th place by token id; here such ties are dropped together). The draw walks
// the kept tokens in id order. One block of SAMPLE_THREADS per row; a row whose every logit is
// -inf gets token 0. Block b draws from logits row rows[b] (rows null: row b) into out[b].
extern "C" __global__ void sample_rows(const float* logits, const u32* rows, int vocab, const SampleParams* params,
                                       u32* out) {
    after_previous_kernel();
    __shared__ float chunk_sums[SAMPLE_THREADS];
    const float* row = logits + (size_t)(rows ? rows[blockIdx.x] : blockIdx.x) * vocab;
    SampleParams p = params[blockIdx.x];
    float inv_t = 1.0f / p.temperature;

    float m = NEG_INF;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) m = fmaxf(m, row[t]);
    m = block_max(m);
    if (m == NEG_INF) {
        if (threadIdx.x == 0) out[blockIdx.x] = 0;
        return;
    }

    // min-p: the best token weighs 1.
    float cut = p.min_p;
    float total;
    int count;
    kept_totals(row, vocab, m, inv_t, cut, &total, &count);
    if (p.top_k > 0 && count > p.top_k) {
        // The smallest cut that keeps at most k tokens.
        float lo = cut, hi = 1.0f;
        for (int i = 0; i < 40; i++) {
            float mid = 0.5f * (lo + hi);
            float s; int c;
            kept_totals(row, vocab, m, inv_t, mid, &s, &c);
            if (c > p.top_k) lo = mid; else hi = mid;
        }
        cut = hi;
        kept_totals(row, vocab, m, inv_t, cut, &total, &count);
    }
    if (p.top_p < 1.0f) {
        // The largest cut whose kept weight still reaches top_p of the total.
        float want = p.top_p * total;
        float lo = cut, hi = 1.0f;
        for (int i = 0; i < 40; i++) {
            float mid = 0.5f * (lo + hi);
            float s; int c;
            kept_totals(row, vocab, m, inv_t, mid, &s, &c);
            if (s >= want) lo = mid; else hi = mid;
        }
        cut = lo;
        kept_totals(row, vocab, m, inv_t, cut, &total, &count);
    }

    // The draw: each thread sums a contiguous chunk, a scan over the chunks finds the one that
    // holds the target, and its thread walks it.
    __shared__ int s_owner;
    __shared__ float s_rest;
    int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    int start = threadIdx.x * chunk;
    int end = start + chunk < vocab ? start + chunk : vocab;
    float s = 0.0f;
    for (int t = start; t < end; t++) {
        float w = expf((row[t] - m) * inv_t);
        if (w > 0.0f && w >= cut) s += w;
    }
    chunk_sums[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float target = philox_uniform(p.seed, p.counter) * total;
        float acc = 0.0f;
        int owner = -1;
        float rest = 3.0e38f; // past every weight: rounding left the target beyond the total
        for (int i = 0; i < (int)blockDim.x; i++) {
            if (chunk_sums[i] <= 0.0f) continue;
            owner = i;
            if (target < acc + chunk_sums[i]) {
                rest = target - acc;
                break;
            }
            acc += chunk_sums[i];
        }
        s_owner = owner;
        s_rest = rest;
    }
    __syncthreads();
    if ((int)threadIdx.x == s_owner) {
        float rest = s_rest;
        u32 last = 0;
        for (int t = start; t < end; t++) {
            float w = expf((row[t] - m) * inv_t);
            if (w > 0.0f && w >= cut) {
                last = t;
                if (rest < w) break;
                rest -= w;
            }
        }
        out[blockIdx.x] = last;
    }
}

// Philox outputs as they are, for the known-answer test.
extern "C" __global__ void philox_raw(const u32* ctr_key, u32* out) {
    after_previous_kernel();
    uint4 ctr;
    ctr.x = ctr_key[0];
    ctr.y = ctr_key[1];
    ctr.z = ctr_key[2];
    ctr.w = ctr_key[3];
    uint2 key;
    key.x = ctr_key[4];
    key.y = ctr_key[5];
    uint4 r = philox(ctr, key);
    out[0] = r.x;
    out[1] = r.y;
    out[2] = r.z;
    out[3] = r.w;
}
