// Paged attention for a flattened batch that mixes prefill chunks and decode tokens. One block
// per (query token, head); the token at position p attends to positions 0..=p of its own
// sequence, read through the sequence's block table. Each warp takes every n-th key with an
// online softmax; the warps' partial results are merged at the end. head_dim <= 256.
#define MAX_DIMS_PER_LANE 8
#define MAX_WARPS 8

extern "C" __global__ void paged_attention(const float* qkv, int width, bf16* out,
                                           const bf16* k_cache, const bf16* v_cache,
                                           const u32* token_seq, const u32* positions,
                                           const u32* block_tables, int max_blocks, int block_size,
                                           int num_heads, int num_kv_heads, int head_dim, float scale) {
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

    float q[MAX_DIMS_PER_LANE], acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int k = 0; k < MAX_DIMS_PER_LANE; k++) {
        int d = lane + 32 * k;
        q[k] = d < head_dim ? q_row[d] * scale : 0.0f;
        acc[k] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = warp; j < len; j += warps) {
        size_t slot = (size_t)table[j / block_size] * block_size + j % block_size;
        const bf16* k_row = k_cache + slot * kv_size + kv_head * head_dim;
        const bf16* v_row = v_cache + slot * kv_size + kv_head * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < MAX_DIMS_PER_LANE; k++) {
            int d = lane + 32 * k;
            if (d < head_dim) s += q[k] * bf16_to_f32(k_row[d]);
        }
        s = warp_sum(s);
        float m_new = fmaxf(m, s);
        float correction = expf(m - m_new);
        float p = expf(s - m_new);
        l = l * correction + p;
#pragma unroll
        for (int k = 0; k < MAX_DIMS_PER_LANE; k++) {
            int d = lane + 32 * k;
            if (d < head_dim) acc[k] = acc[k] * correction + p * bf16_to_f32(v_row[d]);
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
    // Warp 0 merges: every warp saw key 0 or nothing, and warp 0 always saw key 0.
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
