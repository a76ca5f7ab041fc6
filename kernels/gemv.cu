// y[r, n] = sum_k x[r, k] * w[n, k] for a few rows (rows <= GEMV_MAX_ROWS): the product of a
// small batch, bound by reading the weights once. One warp per output column: its lanes read the
// weight row in 16-byte pieces (8 bf16), four pieces in flight per lane, each piece used for
// every row of x (x stays in L1). The weights are read once per step, so they bypass L1 and ask
// L2 for whole 256-byte sectors.
// k must be a multiple of 8 and the rows 16-byte aligned (the host checks).
#define GEMV_MAX_ROWS 8

__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
    uint4 v;
#if __CUDA_ARCH__ >= 800
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#else
    v = *p;
#endif
    return v;
}

__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ void gemv_piece(uint4 wv, const uint4* xr, int chunks, int c, int rows,
                                           float* acc) {
    float wf[8];
    unpack8(wv, wf);
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) {
        if (r < rows) {
            float xf[8];
            unpack8(xr[(size_t)r * chunks + c], xf);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[r] += wf[i] * xf[i];
        }
    }
}

extern "C" __global__ void gemv_bf16(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                     float* __restrict__ y, int rows, int n, int k) {
    int col = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (col >= n) return;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)col * k);
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    int chunks = k >> 3;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) acc[r] = 0.0f;
    int c = lane;
    for (; c + 96 < chunks; c += 128) {
        uint4 w0 = load_streaming(wr + c), w1 = load_streaming(wr + c + 32);
        uint4 w2 = load_streaming(wr + c + 64), w3 = load_streaming(wr + c + 96);
        gemv_piece(w0, xr, chunks, c, rows, acc);
        gemv_piece(w1, xr, chunks, c + 32, rows, acc);
        gemv_piece(w2, xr, chunks, c + 64, rows, acc);
        gemv_piece(w3, xr, chunks, c + 96, rows, acc);
    }
    for (; c < chunks; c += 32) gemv_piece(load_streaming(wr + c), xr, chunks, c, rows, acc);
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) {
        if (r < rows) {
            float s = warp_sum(acc[r]);
            if (lane == 0) y[(size_t)r * n + col] = s;
        }
    }
}
