// Rotary embedding fused with the write of K and V into the paged cache, one block per token:
// the q heads are rotated and written as bf16 for attention ([tokens, heads * head_dim]), the k
// heads rotated and the v heads copied, as bf16, into the token's KV slot. The cache is
// slot-major, [slots, kv_heads * head_dim] per layer (block b holds slots b * block_size ..).
// The rotation's tables of cos and sin per (position, pair) are built on the host exactly as
// the CPU backend builds them. halves = 0: adjacent pairs (2j, 2j+1), GGUF llama; halves = 1:
// (j, j + half), qwen2 and HF llama.
extern "C" __global__ void rope_and_cache(const float* qkv, int width, const u32* positions, const float* cos_t,
                                          const float* sin_t, int heads, int kv_heads, int head_dim, int halves,
                                          const u32* slots, bf16* q_out, bf16* k_cache, bf16* v_cache) {
    after_previous_kernel();
    int half = head_dim / 2;
    size_t p = positions[blockIdx.x];
    const float* c = cos_t + p * half;
    const float* s = sin_t + p * half;
    const float* row = qkv + (size_t)blockIdx.x * width;
    int q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    bf16* q_row = q_out + (size_t)blockIdx.x * q_size;
    size_t slot = (size_t)slots[blockIdx.x] * kv_size;
    for (int i = threadIdx.x; i < (heads + kv_heads) * half; i += blockDim.x) {
        int h = i / half, j = i % half;
        int a = halves ? j : 2 * j;
        int b = halves ? j + half : 2 * j + 1;
        bf16* dst = h < heads ? q_row + h * head_dim : k_cache + slot + (h - heads) * head_dim;
        rotate_pair(row[h * head_dim + a], row[h * head_dim + b], c[j], s[j], dst + a, dst + b);
    }
    for (int i = threadIdx.x; i < kv_size; i += blockDim.x) {
        v_cache[slot + i] = f32_to_bf16(row[q_size + kv_size + i]);
    }
}

// Disaggregated serving (runtime/kv_link.rs): the keys and values of blocks ids.id[0..gridDim.x]
// over every layer, gathered into `staging` as [block][pool][block_elems] for one send, and
// scattered back by the receiver. `pools` holds each layer's K pool then its V pool, gridDim.y
// of them; a block is block_elems contiguous entries of a pool (a multiple of 8). The ids come
// by value: an upload would wait for the transfer stream's earlier work, on the engine's thread.
#define KV_PIECE_BLOCKS 960
struct KvIds {
    u32 id[KV_PIECE_BLOCKS];
};

extern "C" __global__ void kv_gather(KvIds ids, const u64* pools, int block_elems, bf16* staging) {
    after_previous_kernel();
    const uint4* src = reinterpret_cast<const uint4*>(reinterpret_cast<const bf16*>(pools[blockIdx.y]) +
                                                      (size_t)ids.id[blockIdx.x] * block_elems);
    uint4* dst = reinterpret_cast<uint4*>(staging + ((size_t)blockIdx.x * gridDim.y + blockIdx.y) * block_elems);
    for (int i = threadIdx.x; i < block_elems / 8; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void kv_scatter(KvIds ids, const u64* pools, int block_elems, const bf16* staging) {
    after_previous_kernel();
    const uint4* src =
        reinterpret_cast<const uint4*>(staging + ((size_t)blockIdx.x * gridDim.y + blockIdx.y) * block_elems);
    uint4* dst =
        reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(pools[blockIdx.y]) + (size_t)ids.id[blockIdx.x] * block_elems);
    for (int i = threadIdx.x; i < block_elems / 8; i += blockDim.x) dst[i] = src[i];
}
