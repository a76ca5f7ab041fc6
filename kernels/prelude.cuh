// Shared by every kernel file (prepended before NVRTC compiles it). bf16 is carried as its bit
// pattern: the conversions are two lines, and NVRTC then needs no CUDA headers at all.
typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define NEG_INF (__int_as_float(0xff800000))

// Programmatic dependent launch (sm_90 on; src/runtime/cuda/launcher.rs): a kernel may be started
// while the one before it in the stream is still running, so that its launch and the reads that
// depend on no earlier kernel (weights) overlap that kernel's end. Every kernel calls this before
// it reads what the kernel just before it writes, or writes what that kernel reads or writes
// (activations, this step's KV slots, logits, scratch): it waits for that kernel to finish and
// its writes to be visible, then lets the next kernel start. What only kernels further back
// wrote may be read before it: a kernel starts once the one before has passed this call, so
// everything before that one has finished. Launched without the attribute, or before sm_90, it
// costs nothing.
__device__ __forceinline__ void after_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The same, but the next kernel may start before this one waits: for a short kernel whose
// successor reads nothing before its own wait but weights (flash_merge, then the o projection,
// whose first weights are then read while attention runs). That successor is the one kernel
// started before the kernels two back have finished, so it must not use the rule above.
__device__ __forceinline__ void let_next_start_then_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
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

// add_rms_norm's arithmetic (kernels/norm.cu), which a kernel that makes the norm's output itself
// (gemv.cu's StreamNorm) shares so that its bits are the norm's: a block of NORM_THREADS (the
// host's ROW_THREADS), each thread summing the squares of at most NORM_PIECES pieces of 4 in
// order, and each piece scaled, then weighted, into 4 bf16.
#define NORM_THREADS 1024
#define NORM_PIECES 4

__device__ __forceinline__ float add_squares(float ss, float4 a) {
    ss += a.x * a.x;
    ss += a.y * a.y;
    ss += a.z * a.z;
    ss += a.w * a.w;
    return ss;
}

__device__ __forceinline__ uint2 norm_piece(float4 v, float scale, float4 w) {
    uint2 packed;
    packed.x = (u32)f32_to_bf16(v.x * scale * w.x) | ((u32)f32_to_bf16(v.y * scale * w.y) << 16);
    packed.y = (u32)f32_to_bf16(v.z * scale * w.z) | ((u32)f32_to_bf16(v.w * scale * w.w) << 16);
    return packed;
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// Hopper's warpgroup-wide asynchronous mma (wgmma), on sm_90a (which the host asks NVRTC for on
// compute capability 9.0; kernels::Kernels::wgmma says whether it did). Four warps, one
// warpgroup, multiply 64 rows of A, each warp's 16 as the mma.sync A fragment in registers, by B
// read from shared memory by descriptor; d is in the mma.sync C layout, a fragment per 8 columns.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HAS_WGMMA 1
#else
#define HAS_WGMMA 0
#endif

#if HAS_WGMMA
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most N committed groups of this warpgroup's mma are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void wgmma_commit_and_wait() {
    wgmma_commit();
    wgmma_wait<0>();
}

// Keeps the compiler from moving reads or writes of accumulators across an asynchronous mma.
template <int N>
__device__ __forceinline__ void wgmma_pin(float (&d)[N][4]) {
#pragma unroll
    for (int j = 0; j < N; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[j][e])::"memory");
}

// A matrix in shared memory in the 128-byte swizzle: 8-row groups sbo bytes apart, panels of
// 128-byte rows lbo bytes apart (where the layout has more than one along the operand's width).
__device__ __forceinline__ u64 smem_desc_sw128(const void* p, u32 lbo, u32 sbo) {
    return (u64)((smem_u32(p) & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}

// d += a * b for 64 rows and N columns of 16 k; TNSP_B: b is stored N-major (k rows of N).
template <int TNSP_B>
__device__ __forceinline__ void wgmma_n64(float (&d)[8][4], const u32* a, u64 desc) {
    asm volatile(
        "{\n .reg .pred acc;\n setp.ne.b32 acc, %37, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, acc, 1, 1, %38;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1), "n"(TNSP_B));
}

template <int TNSP_B>
__device__ __forceinline__ void wgmma_n128(float (&d)[16][4], const u32* a, u64 desc) {
    asm volatile(
        "{\n .reg .pred acc;\n setp.ne.b32 acc, %69, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, acc, 1, 1, %70;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
          "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
          "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
          "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]),
          "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
          "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1), "n"(TNSP_B));
}

#endif
