// Paged attention for a flattened batch that mixes prefill chunks and decode tokens. One block
// per (query token, head); the token at position p attends to positions 0..=p of its own
// sequence, read through the sequence's block table. Each warp takes tiles of 32 keys: a lane
// scores one key over the whole head (q from shared memory), the warp updates its online
// softmax once per tile, then the lanes (one per group of dimensions) add the tile's values.
// The warps' partial results are merged at the end. head_dim <= 256.
#define MAX_DIMS_PER_LANE 8
#define MAX_WARPS 8
#define MAX_HEAD_DIM 256

extern "C" __global__ void paged_attention(const float* qkv, int width, bf16* out,
                                           const bf16* k_cache, const bf16* v_cache,
                                           const u32* token_seq, const u32* positions,
                                           const u32* block_tables, int max_blocks, int block_size,
                                           int num_heads, int num_kv_heads, int head_dim, float scale) {
    __shared__ float q_s[MAX_HEAD_DIM];
    __shared__ float warp_m[MAX_WARPS];
    __shared__ float warp_l[MAX_WARPS];
    __shared__ float warp_acc[MAX_WARPS][MAX_DIMS_PER_LANE * 32];
    int t = blockIdx.x, h = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int kv_head = h / (num_heads / num_kv_heads);
    int kv_size = num_kv_heads * head_dim;
    int len = (int)positions[t] + 1;
    const u32* table = block_tables + (size_t)token_seq[t] * max_blocks;
    const float* q_row = qkv + (size_t)t * width + h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = q_row[d] * scale;
    __syncthreads();

    float acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int k = 0; k < MAX_DIMS_PER_LANE; k++) acc[k] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    bool vectors = (head_dim & 7) == 0;
    for (int base = warp * 32; base < len; base += warps * 32) {
        int j = base + lane;
        u64 slot = 0;
        float s = NEG_INF;
        if (j < len) {
            slot = (u64)table[j / block_size] * block_size + j % block_size;
            const bf16* k_row = k_cache + slot * kv_size + kv_head * head_dim;
            float dot = 0.0f;
            if (vectors) {
                // Eight bf16 at a time: rows start at multiples of 8 elements (16 bytes).
                for (int d = 0; d < head_dim; d += 8) {
                    uint4 raw = *reinterpret_cast<const uint4*>(k_row + d);
                    u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        dot += q_s[d + 2 * i] * __uint_as_float(w[i] << 16);
                        dot += q_s[d + 2 * i + 1] * __uint_as_float(w[i] & 0xffff0000u);
                    }
                }
            } else {
                for (int d = 0; d < head_dim; d++) dot += q_s[d] * bf16_to_f32(k_row[d]);
            }
            s = dot;
        }
        float m_new = fmaxf(m, warp_max(s));
        float correction = expf(m - m_new);
        float p = j < len ? expf(s - m_new) : 0.0f;
        l = l * correction + warp_sum(p);
#pragma unroll
        for (int k = 0; k < MAX_DIMS_PER_LANE; k++) acc[k] *= correction;
        int n = len - base < 32 ? len - base : 32;
#pragma unroll 4
        for (int i = 0; i < n; i++) {
            float pi = __shfl_sync(0xffffffffu, p, i);
            u64 slot_i = __shfl_sync(0xffffffffu, slot, i);
            const bf16* v_row = v_cache + slot_i * kv_size + kv_head * head_dim;
#pragma unroll
            for (int k = 0; k < MAX_DIMS_PER_LANE; k++) {
                int d = lane + 32 * k;
                if (d < head_dim) acc[k] += pi * bf16_to_f32(v_row[d]);
            }
        }
        m = m_new;
    }
    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
    }
#pragma unroll
    for (int k = 0; k < MAX_DIMS_PER_LANE; k++) warp_acc[warp][lane + 32 * k] = acc[k];
    __syncthreads();
    // Warp 0 merges; a warp that saw no key has l = 0 and weighs nothing.
    if (warp == 0) {
        float big = warp_m[0];
        for (int w = 1; w < warps; w++) big = fmaxf(big, warp_m[w]);
        float total = 0.0f;
        float merged[MAX_DIMS_PER_LANE];
#pragma unroll
        for (int k = 0; k < MAX_DIMS_PER_LANE; k++) merged[k] = 0.0f;
        for (int w = 0; w < warps; w++) {
            float f = warp_l[w] > 0.0f ? expf(warp_m[w] - big) : 0.0f;
            total += warp_l[w] * f;
#pragma unroll
            for (int k = 0; k < MAX_DIMS_PER_LANE; k++) merged[k] += warp_acc[w][lane + 32 * k] * f;
        }
        bf16* o = out + (size_t)t * num_heads * head_dim + h * head_dim;
#pragma unroll
        for (int k = 0; k < MAX_DIMS_PER_LANE; k++) {
            int d = lane + 32 * k;
            if (d < head_dim) o[d] = f32_to_bf16(merged[k] / total);
        }
    }
}
