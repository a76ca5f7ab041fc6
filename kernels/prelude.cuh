// Shared by every kernel file (prepended before NVRTC compiles it). bf16 is carried as its bit
// pattern: the conversions are two lines, and NVRTC then needs no CUDA headers at all.
typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF (__int_as_float(0xff800000))

// Programmatic dependent launch (sm_90 on; src/runtime/cuda/launcher.rs): a kernel may be started
// while the one before it in the stream is still running, so that its launch and the reads that
// depend on no earlier kernel (weights) overlap that kernel's end. Every kernel calls this before
// it touches memory an earlier kernel writes or reads (activations, the KV cache, logits,
// scratch): it waits for the earlier kernels to finish and their writes to be visible, then lets
// the next kernel start. Launched without the attribute, or before sm_90, it costs nothing.
__device__ __forceinline__ void after_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf16_to_f32(bf16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest even, as torch and half::bf16 do; NaN stays NaN.
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// SiLU(gate) * up: one expression for the kernel that applies it alone and the GEMV that applies
// it to its own sums, so the two give the same bits.
__device__ __forceinline__ float silu_times(float gate, float up) {
    return gate / (1.0f + expf(-gate)) * up;
}

// One rotary pair (x0, x1) turned by the angle whose cosine and sine are c and s; shared by the
// rope kernel and the GEMV that rotates its own sums, for the same bits.
__device__ __forceinline__ void rotate_pair(float x0, float x1, float c, float s, bf16* a, bf16* b) {
    *a = f32_to_bf16(x0 * c - x1 * s);
    *b = f32_to_bf16(x0 * s + x1 * c);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Maximum (MAX) or sum over the whole block (at most 1024 threads); every thread gets it.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float r = lane < (int)((blockDim.x + 31) >> 5) ? partial[lane] : (MAX ? NEG_INF : 0.0f);
        r = MAX ? warp_max(r) : warp_sum(r);
        if (lane == 0) total = r;
    }
    __syncthreads();
    return total;
}

__device__ __forceinline__ float block_max(float v) {
    return block_reduce<true>(v);
}

__device__ __forceinline__ float block_sum(float v) {
    return block_reduce<false>(v);
}
