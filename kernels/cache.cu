// Writes each token's k and v into its KV slot. The cache is slot-major, [slots, kv_heads *
// head_dim] per layer (block b holds slots b * block_size ..), the layout paged FlashAttention
// kernels read.
extern "C" __global__ void reshape_and_cache(const float* qkv, int width, int k_offset, int v_offset,
                                             int kv_size, const u32* slots, bf16* k_cache, bf16* v_cache) {
    const float* row = qkv + (size_t)blockIdx.x * width;
    size_t base = (size_t)slots[blockIdx.x] * kv_size;
    for (int i = threadIdx.x; i < kv_size; i += blockDim.x) {
        k_cache[base + i] = f32_to_bf16(row[k_offset + i]);
        v_cache[base + i] = f32_to_bf16(row[v_offset + i]);
    }
}
