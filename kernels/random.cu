// Deterministic random weights (--load-format dummy): a hash of (seed, index) mapped to a
// uniform value in [-scale, scale], so any shape fills in place, in parallel, the same on
// every run and every GPU.
__device__ __forceinline__ u32 mix(u64 x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return (u32)x;
}

extern "C" __global__ void fill_uniform_bf16(bf16* out, u64 n, u64 seed, float scale) {
    after_previous_kernel();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float u = (float)(mix(seed * 0x9e3779b97f4a7c15ULL + i) >> 8) * (1.0f / 16777216.0f);
        out[i] = f32_to_bf16((2.0f * u - 1.0f) * scale);
    }
}
