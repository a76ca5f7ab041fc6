// The grammar's mask on the logits: one packed u32 word per 32 tokens (bit t % 32 of word
// t / 32), a cleared bit sets the logit to -inf. mask_rows[r] is the mask row of logits row r,
// or -1 for a row without a constraint (it is skipped). Grid: (rows, ceil(vocab / blockDim)).
extern "C" __global__ void apply_bitmask(float* logits, const u32* masks, const int* mask_rows,
                                         int vocab, int words) {
    int r = blockIdx.x;
    int m = mask_rows[r];
    if (m < 0) return;
    int t = blockIdx.y * blockDim.x + threadIdx.x;
    if (t >= vocab) return;
    u32 word = masks[(size_t)m * words + (t >> 5)];
    if (!((word >> (t & 31)) & 1u)) logits[(size_t)r * vocab + t] = NEG_INF;
}

// Greedy: the index of each row's largest logit, the lowest index among equals (as the CPU
// sampler's argmax). One block per row.
extern "C" __global__ void argmax(const float* logits, int vocab, u32* out) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float v = NEG_INF;
    int idx = 0x7fffffff;
    for (int t = threadIdx.x; t < vocab; t += blockDim.x) {
        float x = row[t];
        if (x > v) { v = x; idx = t; }
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
        if (lane == 0) out[blockIdx.x] = idx == 0x7fffffff ? 0u : (u32)idx;
    }
}
