// Paged attention for a flattened batch that mixes prefill chunks and decode tokens, for heads
// the tensor-core kernel (flash_attention.cu) does not take. One block
// per (query token, head, partition of the keys); the token at position p attends to positions
// 0..=p of its own sequence, read through the sequence's block table. Each warp takes tiles of
// 32 keys: a lane scores one key over the whole head (q from shared memory), the warp updates
// its online softmax once per tile, then the lanes (one per group of dimensions) add the tile's
// values. The warps' partial results are merged at the end. head_dim <= 256.
//
// With one partition (gridDim.z == 1) the block writes the output. A few decode tokens over a
// long context would leave most of the GPU idle that way, so the host then splits the keys into
// partitions of part_keys each (flash-decoding): each block writes its running max, its sum of
// weights and its unnormalized values to `partials`, and attention_merge combines them.
#define MAX_DIMS_PER_LANE 8
#define MAX_WARPS 8
#define MAX_HEAD_DIM 256

// q (f32, shared memory) against eight bf16 of a key: rows start at multiples of 8 elements.
__device__ __forceinline__ float dot8(const float* q, uint4 raw) {
    u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        dot += q[2 * i] * __uint_as_float(w[i] << 16);
        dot += q[2 * i + 1] * __uint_as_float(w[i] & 0xffff0000u);
    }
    return dot;
}

// Four 16-byte loads in flight at a time: all sixteen of a 128-wide head would hold 64 registers
// and cost prefill blocks their occupancy.
template <int D>
__device__ __forceinline__ float dot_row(const float* q, const bf16* k_row) {
    const uint4* k = reinterpret_cast<const uint4*>(k_row);
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < D / 8; c += 4) {
        uint4 r0 = k[c], r1 = k[c + 1], r2 = k[c + 2], r3 = k[c + 3];
        dot += dot8(q + 8 * c, r0) + dot8(q + 8 * c + 8, r1) + dot8(q + 8 * c + 16, r2) + dot8(q + 8 * c + 24, r3);
    }
    return dot;
}

extern "C" __global__ void paged_attention(const bf16* q, bf16* out,
                                           const bf16* k_cache, const bf16* v_cache,
                                           const u32* token_seq, const u32* positions,
                                           const u32* block_tables, int max_blocks, int block_size,
                                           int num_heads, int num_kv_heads, int head_dim, float scale,
                                           int part_keys, float* partials) {
    after_previous_kernel();
    __shared__ float q_s[MAX_HEAD_DIM];
    __shared__ float warp_m[MAX_WARPS];
    __shared__ float warp_l[MAX_WARPS];
    __shared__ float warp_acc[MAX_WARPS][MAX_DIMS_PER_LANE * 32];
    int t = blockIdx.x, h = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int kv_head = h / (num_heads / num_kv_heads);
    int kv_size = num_kv_heads * head_dim;
    int len = (int)positions[t] + 1;
    int begin = blockIdx.z * part_keys;
    int end = min(len, begin + part_keys);
    const u32* table = block_tables + (size_t)token_seq[t] * max_blocks;
    const bf16* q_row = q + ((size_t)t * num_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = bf16_to_f32(q_row[d]) * scale;
    __syncthreads();

    float acc[MAX_DIMS_PER_LANE];
#pragma unroll
    for (int k = 0; k < MAX_DIMS_PER_LANE; k++) acc[k] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    bool vectors = (head_dim & 7) == 0;
    for (int base = begin + warp * 32; base < end; base += warps * 32) {
        int j = base + lane;
        u64 slot = 0;
        float s = NEG_INF;
        if (j < end) {
            slot = (u64)table[j / block_size] * block_size + j % block_size;
            const bf16* k_row = k_cache + slot * kv_size + kv_head * head_dim;
            float dot = 0.0f;
            // Common head sizes are unrolled whole, so every load of the row is in flight at once.
            if (head_dim == 128) {
                dot = dot_row<128>(q_s, k_row);
            } else if (head_dim == 64) {
                dot = dot_row<64>(q_s, k_row);
            } else if (vectors) {
                for (int d = 0; d < head_dim; d += 8) dot += dot8(q_s + d, *reinterpret_cast<const uint4*>(k_row + d));
            } else {
                for (int d = 0; d < head_dim; d++) dot += q_s[d] * bf16_to_f32(k_row[d]);
            }
            s = dot;
        }
        float m_new = fmaxf(m, warp_max(s));
        float correction = expf(m - m_new);
        float p = j < end ? expf(s - m_new) : 0.0f;
        l = l * correction + warp_sum(p);
#pragma unroll
        for (int k = 0; k < MAX_DIMS_PER_LANE; k++) acc[k] *= correction;
        int n = end - base < 32 ? end - base : 32;
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
        if (gridDim.z == 1) {
            bf16* o = out + (size_t)t * num_heads * head_dim + h * head_dim;
#pragma unroll
            for (int k = 0; k < MAX_DIMS_PER_LANE; k++) {
                int d = lane + 32 * k;
                if (d < head_dim) o[d] = f32_to_bf16(merged[k] / total);
            }
        } else {
            // An empty partition (past the token's position) records total = 0.
            float* rec = partials + (((size_t)t * num_heads + h) * gridDim.z + blockIdx.z) * (head_dim + 2);
            if (lane == 0) {
                rec[0] = big;
                rec[1] = total;
            }
#pragma unroll
            for (int k = 0; k < MAX_DIMS_PER_LANE; k++) {
                int d = lane + 32 * k;
                if (d < head_dim) rec[2 + d] = merged[k];
            }
        }
    }
}

// Combines the partitions of paged_attention: one block per (query token, head). The records'
// maxima and sums are read once, in parallel, into shared memory.
#define MAX_PARTS 1024
extern "C" __global__ void attention_merge(const float* partials, bf16* out, int parts, int num_heads,
                                           int head_dim) {
    after_previous_kernel();
    __shared__ float weight[MAX_PARTS];
    __shared__ float big_s, total_s;
    int t = blockIdx.x, h = blockIdx.y;
    const float* recs = partials + ((size_t)t * num_heads + h) * parts * (head_dim + 2);
    for (int z = threadIdx.x; z < parts; z += blockDim.x) {
        const float* rec = recs + (size_t)z * (head_dim + 2);
        weight[z] = rec[1] > 0.0f ? rec[0] : NEG_INF;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float big = NEG_INF;
        for (int z = 0; z < parts; z++) big = fmaxf(big, weight[z]);
        big_s = big;
    }
    __syncthreads();
    // Each partition's factor; a partition that saw no key weighs nothing.
    for (int z = threadIdx.x; z < parts; z += blockDim.x) {
        const float* rec = recs + (size_t)z * (head_dim + 2);
        weight[z] = rec[1] > 0.0f ? expf(rec[0] - big_s) : 0.0f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int z = 0; z < parts; z++) total += weight[z] * recs[(size_t)z * (head_dim + 2) + 1];
        total_s = total;
    }
    __syncthreads();
    bf16* o = out + (size_t)t * num_heads * head_dim + h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll 4
        for (int z = 0; z < parts; z++) v += recs[(size_t)z * (head_dim + 2) + 2 + d] * weight[z];
        o[d] = f32_to_bf16(v / total_s);
    }
}
