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
    after_previous_kernel();
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

// The same product on the tensor cores, for k a multiple of 32: a block takes 16 output columns
// (the M side of mma.m16n8k16), the rows of x are its N side (up to 8; missing rows are zeros),
// and its W warps (the host's choice, never by the number of rows) take one segment of
// consecutive k-blocks of 32 each (`segment_begin`), whose sums are added in warp order at the
// end. A lane reads 16 bytes of each of its two columns and 16 bytes of its row of x per
// k-block: the 32 k of a block are permuted alike on both sides (lane t holds k 8t..8t+7, which
// the mma sees as its k 2t, 2t+1, 2t+8, 2t+9 of two steps), which leaves the product unchanged.
// Four k-blocks of loads are in flight per warp. Every row's sum over k is taken in the same
// order whatever the number of rows, and gemm_mma below takes it in that order too, for any
// number of rows: a segment's chain of mma from zero, the segments' sums added in order.
#define GEMV_MMA_COLS 16
#define GEMV_MMA_MAX_WARPS 16
#ifndef GEMV_MMA_UNROLL  // a variant may set these (scripts/flash-bench/gemv_bench.cu)
#define GEMV_MMA_UNROLL 4
#endif
#ifndef GEMV_MMA_MIN_BLOCKS  // the launch bounds' blocks an SM (1: no cap on registers)
#define GEMV_MMA_MIN_BLOCKS 1
#endif

__device__ __forceinline__ void mma_m16n8k16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The first k-block of segment s of `segments` over `blocks` k-blocks: a split fixed by k alone.
__device__ __forceinline__ int segment_begin(int s, int segments, int blocks) {
    return s * blocks / segments;
}

// One k-block of 32: two mma steps over the lane's 8 k.
__device__ __forceinline__ void gemv_mma_block(float* c, uint4 wa, uint4 wb, uint4 xv) {
    mma_m16n8k16(c, wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
    mma_m16n8k16(c, wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
}

// What a product does around its wait on the kernel before, before its first read of x:
// nothing, or (StreamNorm) make x itself. `early` runs before the wait, the call after it.
struct NoPrologue {
    __device__ __forceinline__ void early() const {}
    __device__ __forceinline__ void operator()() const {}
};

// x's row stride in shared memory where a product makes its own x: 64 bytes past the row, so
// that the two rows a quarter warp reads (lanes g and g + 1) fall in different banks.
#define GEMV_X_PAD 32

// add_rms_norm's output for `rows` rows of the residual stream whose branch is already added
// (no residual, no write-back), made by every block of the product that reads it, into shared
// memory as that product's x: the norm's launch, its wait and the product's read of its output
// leave the step's chain. The block's threads stand in for the norm's 1,024 (thread i for
// i, i + blockDim, ...), so each sum of squares is taken in the norm's order (each of its
// threads' pieces, its warps' butterflies, then the butterfly of the 32 warps' sums) and each
// value scaled as it scales it (the prelude's add_squares and norm_piece): the norm's bits. The weight, which no kernel writes, is copied
// into shared memory before the wait; after it, every row's sums are taken at once (one
// round trip for the stream, two barriers whatever the rows). The host takes this only where
// the norm's fast path would (d a multiple of 4, at most 4 pieces a thread) and blockDim
// divides 1,024.
struct StreamNorm {
    const float* stream;
    const float* weight;
    bf16* x;
    float* w_smem;
    int stride, rows, d;
    float eps;
    __device__ __forceinline__ void early() const {
        for (int c = threadIdx.x; c < (d >> 2); c += blockDim.x)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(w_smem + 4 * c)),
                         "l"(weight + 4 * c));
        asm volatile("cp.async.commit_group;\n" ::);
    }
    __device__ __forceinline__ void operator()() const {
        __shared__ float partial[GEMV_MAX_ROWS][32];
        __shared__ float scales[GEMV_MAX_ROWS];
        int pieces = d >> 2, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        for (int r = 0; r < rows; r++) {
            const float4* xr = reinterpret_cast<const float4*>(stream + (size_t)r * d);
            for (int i = threadIdx.x; i < NORM_THREADS; i += blockDim.x) {
                float ss = 0.0f;
#pragma unroll
                for (int j = 0; j < NORM_PIECES; j++) {
                    int c = i + j * NORM_THREADS;
                    if (c >= pieces) continue;
                    ss = add_squares(ss, xr[c]);
                }
                ss = warp_sum(ss);
                if (lane == 0) partial[r][i >> 5] = ss;
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncthreads();
        if (warp < rows) {
            float total = warp_sum(partial[warp][lane]);
            if (lane == 0) scales[warp] = rsqrtf(total / (float)d + eps);
        }
        __syncthreads();
        const float4* w4 = reinterpret_cast<const float4*>(w_smem);
        for (int r = 0; r < rows; r++) {
            const float4* xr = reinterpret_cast<const float4*>(stream + (size_t)r * d);
            float scale = scales[r];
            uint2* out = reinterpret_cast<uint2*>(x + (size_t)r * stride);
            for (int c = threadIdx.x; c < pieces; c += blockDim.x) out[c] = norm_piece(xr[c], scale, w4[c]);
        }
        __syncthreads();
    }
};

// What a form that makes its x as the stream's norm reads: the stream (rows x k, f32) and the
// norm's weight and epsilon.
struct NormIn {
    const float* stream;
    const float* weight;
    float eps;
};

extern __shared__ __align__(16) unsigned char gemv_dynamic_smem[];

// The end of every form's sum: each warp's chains for C groups, added in warp order (the
// segments' order) by warp i for group i. Warp i < C returns true with group i's sums in s.
template <int C>
__device__ __forceinline__ bool gemv_mma_finish(const float (&c)[C][4], float* s) {
    __shared__ float part[GEMV_MMA_MAX_WARPS][32][4 * C];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int i = 0; i < C; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) part[warp][lane][4 * i + e] = c[i][e];
    __syncthreads();
    if (warp >= C) return false;
#pragma unroll
    for (int e = 0; e < 4; e++) s[e] = 0.0f;
    for (int v = 0; v < warps; v++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[e] += part[v][lane][4 * warp + e];
    return true;
}

// One block's product for C groups of two columns per lane group (the mma's M rows g and g + 8;
// group i's weight rows are rows ra[i] and rb[i] of w: any two, which lets a caller pair the
// columns its epilogue needs together). Each warp takes its segment of k for every group, one
// read of x serving all of them. Warp i < C returns true with group i's sums in s: s[0], s[1] the
// first column for rows 2t and 2t + 1, s[2], s[3] the second column for the same rows; the other
// warps return false. Every caller and every C thus sums over k in the same order.
template <int C, class P = NoPrologue>
__device__ __forceinline__ bool gemv_mma_groups(const bf16* __restrict__ x, int xs, const bf16* __restrict__ w,
                                                const int (&ra)[C], const int (&rb)[C], int rows, int k, float* s,
                                                const P& prologue = P()) {
    constexpr int U = GEMV_MMA_UNROLL;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int g = lane >> 2, t = lane & 3;
    const uint4* wa[C];
    const uint4* wb[C];
#pragma unroll
    for (int i = 0; i < C; i++) {
        wa[i] = reinterpret_cast<const uint4*>(w + (size_t)ra[i] * k) + t;
        wb[i] = reinterpret_cast<const uint4*>(w + (size_t)rb[i] * k) + t;
    }
    bool has_row = g < rows;
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(has_row ? g : 0) * xs) + t;
    uint4 zero = make_uint4(0, 0, 0, 0);
    int blocks = k >> 5;
    float c[C][4];
#pragma unroll
    for (int i = 0; i < C; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) c[i][e] = 0.0f;
    int b = segment_begin(warp, warps, blocks), end = segment_begin(warp + 1, warps, blocks);
    uint4 va[C][U], vb[C][U];
    // The weights are no earlier kernel's output: the first round of them is asked for before
    // waiting on the kernel that writes x, so a short product's reads overlap that kernel's end.
    bool loaded = b + U <= end;
    if (loaded) {
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int i = 0; i < C; i++) {
                int chunk = (b + u) * 4;
                va[i][u] = load_streaming(wa[i] + chunk);
                vb[i][u] = load_streaming(wb[i] + chunk);
            }
    }
    prologue.early();
    after_previous_kernel();
    prologue();
    for (; b + U <= end; b += U) {
        uint4 vx[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int chunk = (b + u) * 4;
            if (!loaded) {
#pragma unroll
                for (int i = 0; i < C; i++) {
                    va[i][u] = load_streaming(wa[i] + chunk);
                    vb[i][u] = load_streaming(wb[i] + chunk);
                }
            }
            vx[u] = has_row ? xr[chunk] : zero;
        }
        loaded = false;
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int i = 0; i < C; i++) gemv_mma_block(c[i], va[i][u], vb[i][u], vx[u]);
    }
    for (; b < end; b++) {
        int chunk = b * 4;
#pragma unroll
        for (int i = 0; i < C; i++)
            gemv_mma_block(c[i], load_streaming(wa[i] + chunk), load_streaming(wb[i] + chunk),
                           has_row ? xr[chunk] : zero);
    }
    return gemv_mma_finish<C>(c, s);
}

// gemv_mma_groups' sums for C groups walked one group at a time: a step is 4 k-blocks of one
// group (round r of the warp's segment, group i), and as soon as a step's mma have read its
// registers, the step after next is asked for into them: two steps in flight while one is
// multiplied. For a grid of C waves of gemv_mma (q|k|v on the 8B shape: 384 groups on
// 132 SMs), which then runs in one, with the registers of 2 steps where asking for all C groups
// at once would need C (and spills for 3). Each group's chain over k is gemv_mma's: the same bits.
// Its rows' offsets are kept as 32-bit numbers, not addresses: 3 groups' worth of addresses
// would cost the registers of half a step.
template <int C, class P = NoPrologue>
__device__ __forceinline__ bool gemv_mma_rolling(const bf16* __restrict__ x, int xs, const bf16* __restrict__ w,
                                                 const int (&ra)[C], const int (&rb)[C], int rows, int k,
                                                 float* s, const P& prologue = P()) {
    constexpr int U = GEMV_MMA_UNROLL;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int g = lane >> 2, t = lane & 3;
    // Each row's offset in 16-byte pieces, 32 bits wide (the host takes these forms only where
    // every piece of w has such an offset).
    const uint4* w4 = reinterpret_cast<const uint4*>(w) + t;
    u32 oa[C], ob[C];
#pragma unroll
    for (int i = 0; i < C; i++) {
        oa[i] = (u32)ra[i] * (u32)(k >> 3);
        ob[i] = (u32)rb[i] * (u32)(k >> 3);
    }
    bool has_row = g < rows;
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(has_row ? g : 0) * xs) + t;
    uint4 zero = make_uint4(0, 0, 0, 0);
    int blocks = k >> 5;
    float c[C][4];
#pragma unroll
    for (int i = 0; i < C; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) c[i][e] = 0.0f;
    int b0 = segment_begin(warp, warps, blocks), end = segment_begin(warp + 1, warps, blocks);
    int rounds = (end - b0) / U, steps = rounds * C;
    // Step st is group st % C of round st / C, in buffer st % 2. A pass is 2C steps (two
    // rounds), so within it each step's group, buffer and round are known when compiled and
    // the buffers stay in registers.
    uint4 va[2][U], vb[2][U], vx[U];
    auto load = [&](int buf, int i, u32 piece) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            va[buf][u] = load_streaming(w4 + (oa[i] + piece + 4 * u));
            vb[buf][u] = load_streaming(w4 + (ob[i] + piece + 4 * u));
        }
    };
    // The weights are no earlier kernel's output: the first two steps are asked for before
    // waiting on the kernel that writes x.
    if (steps > 0) load(0, 0, b0 * 4);
    if (steps > 1) load(1, 1 % C, (b0 + (1 / C) * U) * 4);
    prologue.early();
    after_previous_kernel();
    prologue();
    for (int s0 = 0; s0 < steps; s0 += 2 * C) {
        u32 pass = (b0 + (s0 / C) * U) * 4;  // the pass's first piece
#pragma unroll
        for (int j = 0; j < 2 * C; j++) {
            if (j < C || s0 + C < steps) {
                if (j % C == 0) {
#pragma unroll
                    for (int u = 0; u < U; u++) vx[u] = has_row ? xr[pass + (j / C) * U * 4 + 4 * u] : zero;
                }
#pragma unroll
                for (int u = 0; u < U; u++) gemv_mma_block(c[j % C], va[j % 2][u], vb[j % 2][u], vx[u]);
                if (s0 + j + 2 < steps) load(j % 2, (j + 2) % C, pass + ((j + 2) / C) * U * 4);
            }
        }
    }
    for (int b = b0 + rounds * U; b < end; b++) {
        u32 piece = b * 4;
        uint4 v = has_row ? xr[piece] : zero;
#pragma unroll
        for (int i = 0; i < C; i++)
            gemv_mma_block(c[i], load_streaming(w4 + (oa[i] + piece)), load_streaming(w4 + (ob[i] + piece)), v);
    }
    return gemv_mma_finish<C>(c, s);
}

// The plain product, blocks of C groups of 16 columns (rows of w): y[r, n] = sum_k x[r, k] w[n, k].
// ADD: y[r, n] += the product instead: the down projection adding its branch into the residual
// stream, whose last writer (the norm before gate|up) ran two kernels back, so its values are
// read before the wait and the end costs no round trip more.
template <int C, bool ROLL = false, bool ADD = false>
__device__ __forceinline__ void gemv_mma_cols(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                              float* __restrict__ y, int rows, int n, int k) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    int ra[C], rb[C];
#pragma unroll
    for (int i = 0; i < C; i++) {
        // Columns past n read the last one; their sums are never written.
        int ca = (blockIdx.x * C + i) * GEMV_MMA_COLS + g;
        ra[i] = min(ca, n - 1);
        rb[i] = min(ca + 8, n - 1);
    }
    // Warp i finishes group i (warp 0 alone where there is one group).
    int group = C == 1 ? 0 : min((int)(threadIdx.x >> 5), C - 1);
    int ca = (blockIdx.x * C + group) * GEMV_MMA_COLS + g, cb = ca + 8;
    float before[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (ADD && (int)(threadIdx.x >> 5) < C) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int row = 2 * t + (e & 1), col = e < 2 ? ca : cb;
            if (row < rows && col < n) before[e] = y[(size_t)row * n + col];
        }
    }
    float s[4];
    bool mine;
    if constexpr (ROLL)
        mine = gemv_mma_rolling<C>(x, k, w, ra, rb, rows, k, s);
    else
        mine = gemv_mma_groups<C>(x, k, w, ra, rb, rows, k, s);
    if (!mine) return;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        int row = 2 * t + (e & 1), col = e < 2 ? ca : cb;
        if (row < rows && col < n) y[(size_t)row * n + col] = ADD ? before[e] + s[e] : s[e];
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_MMA_MAX_WARPS * 32, GEMV_MMA_MIN_BLOCKS)
    gemv_mma(const bf16* __restrict__ x, const bf16* __restrict__ w, float* __restrict__ y, int rows, int n, int k) {
    gemv_mma_cols<1>(x, w, y, rows, n, k);
}

// The same products adding into y (`Gemm::gemv_mma_add`: the down projection into the stream).
extern "C" __global__ void __launch_bounds__(GEMV_MMA_MAX_WARPS * 32, GEMV_MMA_MIN_BLOCKS)
    gemv_mma_add(const bf16* __restrict__ x, const bf16* __restrict__ w, float* __restrict__ y, int rows, int n,
                 int k) {
    gemv_mma_cols<1, false, true>(x, w, y, rows, n, k);
}

extern "C" __global__ void __launch_bounds__(GEMV_MMA_MAX_WARPS * 32, 1)
    gemv_mma_two_groups_add(const bf16* __restrict__ x, const bf16* __restrict__ w, float* __restrict__ y,
                            int rows, int n, int k) {
    gemv_mma_cols<2, false, true>(x, w, y, rows, n, k);
}

extern "C" __global__ void __launch_bounds__(GEMV_MMA_MAX_WARPS * 32, 1)
    gemv_mma_three_groups_add(const bf16* __restrict__ x, const bf16* __restrict__ w, float* __restrict__ y,
                              int rows, int n, int k) {
    gemv_mma_cols<3, true, true>(x, w, y, rows, n, k);
}

// The same product for a grid of two waves of gemv_mma (o and down on the 8B shape: 256 groups of
// 16 columns on 132 SMs): a block takes two groups, so the grid is one wave, and each warp asks
// for its segment of both groups' rows at once, twice gemv_mma's k-blocks in flight. The same bits.
extern "C" __global__ void __launch_bounds__(GEMV_MMA_MAX_WARPS * 32, 1)
    gemv_mma_two_groups(const bf16* __restrict__ x, const bf16* __restrict__ w, float* __restrict__ y, int rows,
                        int n, int k) {
    gemv_mma_cols<2>(x, w, y, rows, n, k);
}

// The same product for a grid of three waves of gemv_mma (q|k|v's plain product on the 8B shape):
// blocks of three groups walked in turn (gemv_mma_rolling), one wave. The same bits.
extern "C" __global__ void __launch_bounds__(GEMV_MMA_MAX_WARPS * 32, 1)
    gemv_mma_three_groups(const bf16* __restrict__ x, const bf16* __restrict__ w, float* __restrict__ y, int rows,
                          int n, int k) {
    gemv_mma_cols<3, true>(x, w, y, rows, n, k);
}

// The gate|up product with SiLU(gate) * up applied to its sums: a lane group's two columns are
// gate j and up j (w is [gate; up], inter rows each), and the block writes the down projection's
// bf16 input, as gemv_mma then silu_mul would, without the [gate | up] round trip or a launch.
extern "C" __global__ void __launch_bounds__(GEMV_MMA_MAX_WARPS * 32, GEMV_MMA_MIN_BLOCKS)
    gemv_mma_silu(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ out, int rows,
                  int inter, int k) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int j = blockIdx.x * (GEMV_MMA_COLS / 2) + g, jr = min(j, inter - 1);
    float s[4];
    int gate[1] = {jr}, up[1] = {inter + jr};
    if (!gemv_mma_groups<1>(x, k, w, gate, up, rows, k, s)) return;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        int row = 2 * t + e;
        if (row < rows && j < inter) out[(size_t)row * inter + j] = f32_to_bf16(silu_times(s[e], s[2 + e]));
    }
}

// The q|k|v product with the rest of kernels/cache.cu's work on its sums: qwen2's bias added,
// q and k rotated, q written as attention's bf16 input and k and v into the token's KV slot. A
// lane group's two columns are a rotary pair of a q or k head (adjacent or half a head apart, as
// `halves` says), or two neighbouring columns of v; pairs are numbered q and k heads first, then
// v. A block takes C groups of 8 pairs (gemv_mma_rolling's walk where C > 1). Arguments after k
// are rope_and_cache's. NORM: x is not read but made by the block as the residual stream's norm
// (StreamNorm, `norm`): the attention norm runs inside the product that reads it.
struct RopePair {
    int p, h, j, a, b, ca, cb;
    bool real, rotated;
};

__device__ __forceinline__ RopePair rope_pair(int p, int heads, int kv_heads, int head_dim, int halves) {
    int half = head_dim / 2;
    int rotated = (heads + kv_heads) * half, pairs = rotated + kv_heads * half;
    RopePair r;
    r.real = p < pairs;
    r.p = min(p, pairs - 1);
    r.h = r.p / half;
    r.j = r.p - r.h * half;
    r.a = halves ? r.j : 2 * r.j;
    r.b = halves ? r.j + half : 2 * r.j + 1;
    r.rotated = r.p < rotated;
    if (r.rotated) {
        r.ca = r.h * head_dim + r.a;
        r.cb = r.h * head_dim + r.b;
    } else {
        r.ca = (heads + kv_heads) * head_dim + 2 * (r.p - rotated);
        r.cb = r.ca + 1;
    }
    return r;
}

template <int C, bool NORM>
__device__ __forceinline__ void gemv_mma_rope_groups(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                     int rows, int k, const float* bias, const u32* positions,
                                                     const float* cos_t, const float* sin_t, int heads,
                                                     int kv_heads, int head_dim, int halves, const u32* slots,
                                                     bf16* q_out, bf16* k_cache, bf16* v_cache, NormIn norm) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int half = head_dim / 2, kv_size = kv_heads * head_dim;
    int ra[C], rb[C];
#pragma unroll
    for (int i = 0; i < C; i++) {
        RopePair r = rope_pair((blockIdx.x * C + i) * (GEMV_MMA_COLS / 2) + g, heads, kv_heads, head_dim, halves);
        ra[i] = r.ca;
        rb[i] = r.cb;
    }
    // The pair this warp finishes (warp i < C: group i).
    int mine_at = (blockIdx.x * C + min((int)(threadIdx.x >> 5), C - 1)) * (GEMV_MMA_COLS / 2) + g;
    RopePair r = rope_pair(mine_at, heads, kv_heads, head_dim, halves);
    // What the sums are finished with (the bias, the rotation's angles, the slots: weights,
    // tables and uploads, which no kernel writes) is read before the product, by the warp that
    // finishes them, so that the blocks of the last wave end without two more round trips
    // (position, then angle) after their last mma.
    float bias_a = 0.0f, bias_b = 0.0f, cos_r[2] = {1.0f, 1.0f}, sin_r[2] = {0.0f, 0.0f};
    u32 slot_r[2] = {0, 0};
    if ((threadIdx.x >> 5) < C && r.real) {
        if (bias) {
            bias_a = bias[r.ca];
            bias_b = bias[r.cb];
        }
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int row = 2 * t + e;
            if (row >= rows) continue;
            slot_r[e] = slots[row];
            if (r.rotated) {
                size_t at = (size_t)positions[row] * half + r.j;
                cos_r[e] = cos_t[at];
                sin_r[e] = sin_t[at];
            }
        }
    }
    float s[4];
    bool mine;
    if constexpr (NORM) {
        // x, rows of k + GEMV_X_PAD, then the norm's weight, in dynamic shared memory.
        bf16* xs = reinterpret_cast<bf16*>(gemv_dynamic_smem);
        float* ws = reinterpret_cast<float*>(xs + (size_t)rows * (k + GEMV_X_PAD));
        StreamNorm make{norm.stream, norm.weight, xs, ws, k + GEMV_X_PAD, rows, k, norm.eps};
        if constexpr (C == 1)
            mine = gemv_mma_groups<1>(xs, k + GEMV_X_PAD, w, ra, rb, rows, k, s, make);
        else
            mine = gemv_mma_rolling<C>(xs, k + GEMV_X_PAD, w, ra, rb, rows, k, s, make);
    } else if constexpr (C == 1) {
        mine = gemv_mma_groups<1>(x, k, w, ra, rb, rows, k, s);
    } else {
        mine = gemv_mma_rolling<C>(x, k, w, ra, rb, rows, k, s);
    }
    if (!mine) return;
    r = rope_pair(mine_at, heads, kv_heads, head_dim, halves);
    if (!r.real) return;
    int q_size = heads * head_dim;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        int row = 2 * t + e;
        if (row >= rows) continue;
        float x0 = s[e], x1 = s[2 + e];
        if (bias) {
            x0 += bias_a;
            x1 += bias_b;
        }
        size_t slot = (size_t)slot_r[e] * kv_size;
        if (r.rotated) {
            bf16* dst = r.h < heads ? q_out + (size_t)row * q_size + r.h * head_dim
                                    : k_cache + slot + (r.h - heads) * head_dim;
            rotate_pair(x0, x1, cos_r[e], sin_r[e], dst + r.a, dst + r.b);
        } else {
            bf16* dst = v_cache + slot + (r.ca - (heads + kv_heads) * head_dim);
            dst[0] = f32_to_bf16(x0);
            dst[1] = f32_to_bf16(x1);
        }
    }
}

#define GEMV_ROPE_PARAMS                                                                                         \
    const bf16 *__restrict__ x, const bf16 *__restrict__ w, int rows, int k, const float *bias,                    \
        const u32 *positions, const float *cos_t, const float *sin_t, int heads, int kv_heads, int head_dim,     \
        int halves, const u32 *slots, bf16 *q_out, bf16 *k_cache, bf16 *v_cache
#define GEMV_ROPE_ARGS \
    x, w, rows, k, bias, positions, cos_t, sin_t, heads, kv_heads, head_dim, halves, slots, q_out, k_cache, v_cache
#define GEMV_ROPE_KERNEL(NAME, C)                                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_MMA_MAX_WARPS * 32, GEMV_MMA_MIN_BLOCKS)                  \
        NAME(GEMV_ROPE_PARAMS) {                                                                                 \
        gemv_mma_rope_groups<C, false>(GEMV_ROPE_ARGS, {});                                                      \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(GEMV_MMA_MAX_WARPS * 32, GEMV_MMA_MIN_BLOCKS)                  \
        NAME##_norm(GEMV_ROPE_PARAMS, const float* norm_stream, const float* norm_weight, float eps) {           \
        gemv_mma_rope_groups<C, true>(GEMV_ROPE_ARGS, {norm_stream, norm_weight, eps});                          \
    }
// Each with a form (NAME_norm) that makes its x as the residual stream's norm (StreamNorm).
GEMV_ROPE_KERNEL(gemv_mma_rope, 1)
// For a grid of three waves of gemv_mma_rope (the 8B shape's 384 groups on 132 SMs): one wave.
GEMV_ROPE_KERNEL(gemv_mma_rope_three, 3)

// y[r, n] = sum_k x[r, k] * w[n, k] for any number of rows, with gemv_mma's bits: the batch-
// invariant product (`--batch-invariant`), where a row's result must not depend on whether its
// batch took the GEMV (up to 8 rows) or this kernel. A block computes 128 columns (rows of w)
// for ROWS rows of x, two k-blocks of 32 a stage copied into shared memory by cp.async, STAGES
// deep; each warp holds 64 columns x 32 rows. The sum over k is taken exactly as gemv_mma takes
// it: each of the `segments` segments of k-blocks (gemv_mma's warps) is a chain of mma from
// zero, over the same permutation of k within a block, and the segments' sums are added in
// order. Any other split of k rounds differently; the tiling of rows and columns does not
// matter, so the host may choose it by shape.
#define GEMM_COLS 128
#define GEMM_KB 2
// 16-byte pieces of one row (of w or x) in a stage.
#define GEMM_ROW_PIECES (GEMM_KB * 4)

__device__ __forceinline__ void gemm_copy16(uint4* dst, const void* src) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}

// Where piece p of a stage's row r lies: odd rows swap their halves, so that the 8 lanes of a
// quarter-warp, reading two rows' same 64 bytes, hit 32 different banks.
__device__ __forceinline__ int gemm_piece(int r, int p) {
    return r * GEMM_ROW_PIECES + (p ^ ((r & 1) << 2));
}

template <int ROWS, int STAGES>
__device__ __forceinline__ void gemm_mma_tile(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                              float* __restrict__ y, int rows, int n, int k, int segments) {
    constexpr int THREADS = ROWS * 2;  // 2 x ROWS / 32 warps of 64 x 32
    constexpr int STAGE_PIECES = (GEMM_COLS + ROWS) * GEMM_ROW_PIECES;
    extern __shared__ uint4 gemm_smem[];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int row0 = blockIdx.x * ROWS, col0 = blockIdx.y * GEMM_COLS;
    int wc = (warp & 1) * 64, wr = (warp >> 1) * 32;
    int blocks = k >> 5, stages = (blocks + GEMM_KB - 1) / GEMM_KB;
    after_previous_kernel();
    // A thread copies the same 16-byte piece (p) of PER_THREAD rows of each stage, ROW_STEP rows
    // apart: their addresses are taken once. Rows past the ends copy the last
    // ones: their sums are never written, and an mma's output element depends on its own row
    // and column only.
    constexpr int PER_THREAD = STAGE_PIECES / THREADS, ROW_STEP = THREADS / GEMM_ROW_PIECES;
    int p = threadIdx.x % GEMM_ROW_PIECES, r0 = threadIdx.x / GEMM_ROW_PIECES;
    const bf16* src[PER_THREAD];
    int dst[PER_THREAD];
#pragma unroll
    for (int i = 0; i < PER_THREAD; i++) {
        int r = r0 + i * ROW_STEP;
        src[i] = (r < GEMM_COLS ? w + (size_t)min(col0 + r, n - 1) * k
                                : x + (size_t)min(row0 + r - GEMM_COLS, rows - 1) * k) +
                 (p / 4) * 32 + (p % 4) * 8;
        dst[i] = gemm_piece(r, p);
    }
    auto load = [&](int st, int slot) {
        if (st * GEMM_KB + p / 4 >= blocks) return;
        uint4* stage = gemm_smem + slot * STAGE_PIECES;
#pragma unroll
        for (int i = 0; i < PER_THREAD; i++) gemm_copy16(stage + dst[i], src[i] + (size_t)st * GEMM_KB * 32);
    };
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < stages) load(st, st);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    float acc[4][4][4], tot[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = tot[i][j][e] = 0.0f;
    // The segment being summed and its end; segments ending at 0 (k shorter than `segments`
    // k-blocks) add their zero first, as gemv_mma's idle warps do.
    int seg = 0, seg_end = segment_begin(1, segments, blocks);
    auto close_segments = [&](int done) {
        while (seg < segments && seg_end <= done) {
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        tot[i][j][e] += acc[i][j][e];
                        acc[i][j][e] = 0.0f;
                    }
            seg++;
            seg_end = segment_begin(seg + 1, segments, blocks);
        }
    };
    close_segments(0);
    // The slot of shared memory stage st is in, and the one stage st + STAGES - 1 goes to.
    int slot = 0, next = STAGES - 1;
    for (int st = 0; st < stages; st++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        __syncthreads();
        if (st + STAGES - 1 < stages) load(st + STAGES - 1, next);
        asm volatile("cp.async.commit_group;\n" ::);
        next = next + 1 == STAGES ? 0 : next + 1;
        const uint4* s = gemm_smem + slot * STAGE_PIECES;
        slot = slot + 1 == STAGES ? 0 : slot + 1;
#pragma unroll
        for (int kl = 0; kl < GEMM_KB; kl++) {
            int kb = st * GEMM_KB + kl;
            if (kb >= blocks) break;
            int piece = kl * 4 + t;
            uint4 wa[4], wb[4], xv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                wa[i] = s[gemm_piece(wc + 16 * i + g, piece)];
                wb[i] = s[gemm_piece(wc + 16 * i + g + 8, piece)];
            }
#pragma unroll
            for (int j = 0; j < 4; j++) xv[j] = s[gemm_piece(GEMM_COLS + wr + 8 * j + g, piece)];
            // gemv_mma_block's two steps, each over all 16 tiles: the same operations on each
            // accumulator in the same order, but 16 independent mma between dependent ones.
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    mma_m16n8k16(acc[i][j], wa[i].x, wb[i].x, wa[i].y, wb[i].y, xv[j].x, xv[j].y);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    mma_m16n8k16(acc[i][j], wa[i].z, wb[i].z, wa[i].w, wb[i].w, xv[j].z, xv[j].w);
            if (kb + 1 >= seg_end) close_segments(kb + 1);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int col = col0 + wc + 16 * i + g + (e < 2 ? 0 : 8), row = row0 + wr + 8 * j + 2 * t + (e & 1);
                if (row < rows && col < n) y[(size_t)row * n + col] = tot[i][j][e];
            }
}

// 128 columns x 64 rows a block (4 warps), four stages: shared memory 96 KB, so two blocks fit
// an SM (their registers too).
extern "C" __global__ void __launch_bounds__(128)
    gemm_mma(const bf16* __restrict__ x, const bf16* __restrict__ w, float* __restrict__ y, int rows, int n, int k,
             int segments) {
    gemm_mma_tile<64, 4>(x, w, y, rows, n, k, segments);
}

// 128 x 128 a block (8 warps), five stages (160 KB): one block an SM, each of its bytes copied
// from L2 used for twice the products of gemm_mma's, for batches of many rows.
extern "C" __global__ void __launch_bounds__(256)
    gemm_mma_wide(const bf16* __restrict__ x, const bf16* __restrict__ w, float* __restrict__ y, int rows, int n,
                  int k, int segments) {
    gemm_mma_tile<128, 5>(x, w, y, rows, n, k, segments);
}

#define GW_COLS 128
#define GW_THREADS 256

// The block's 4-byte word (pair of k) that the GEMV's mma sees as word o of a k-block.
__device__ __forceinline__ int gemv_word(int o) {
    int m = o >> 3, j = o & 7;
    return 4 * (j & 3) + 2 * m + (j >> 2);
}


#if HAS_WGMMA
// gemm_mma on Hopper's wgmma: the same sums (each segment's chain of m16n8k16 steps from zero,
// the segments added in order), so the same bits, at the rate of the asynchronous warpgroup mma.
// A block is two warpgroups, each 64 columns (rows of w) by ROWS rows of x; a stage holds two
// k-blocks of 32. The w tile is read into registers as the GEMV reads it from memory (lane t's 16
// bytes of a row, k 8t..8t+7 of the block), so its fragments are the GEMV's. wgmma reads x from
// shared memory by descriptor, in the order of k the mma sees (word o = 8m + j of a block, j < 8,
// is step m's k pair j, which the GEMV's lanes fill with the block's word gemv_word(o)): x is
// copied into place 4 bytes at a time, in the 128-byte swizzle.

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src));
}

template <int ROWS>
__device__ __forceinline__ void wgmma_rows(float (&d)[ROWS / 8][4], const u32* a, u64 desc) {
    if constexpr (ROWS == 128)
        wgmma_n128<0>(d, a, desc);
    else
        wgmma_n64<0>(d, a, desc);
}

// PERMUTED: x was written in that order already (permute_k32), and is copied 16 bytes at a time.
template <int ROWS, int STAGES, bool PERMUTED>
__device__ __forceinline__ void gemm_wgmma_tile(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                float* __restrict__ y, int rows, int n, int k, int segments) {
    constexpr int W_BYTES = GW_COLS * 128, STAGE_BYTES = W_BYTES + ROWS * 128;
    // Stage st + AHEAD is copied while st is multiplied, into the slot of st - 2: a warpgroup
    // leaves at most the last stage's mma (a group per k-block) running into the next.
    constexpr int AHEAD = STAGES - 2;
    constexpr int X_PER_THREAD = ROWS * 32 / GW_THREADS;
    extern __shared__ __align__(1024) unsigned char gw_smem[];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    int row0 = blockIdx.x * ROWS, col0 = blockIdx.y * GW_COLS;
    int blocks = k >> 5, stages = (blocks + 1) / 2;
    // A thread copies 16-byte piece wp of w rows wr0 + 32i and word xo of x rows xr0 + 8i, every
    // stage: their offsets are taken once (32-bit: the host keeps operands under 2^32 elements).
    // Rows past the ends copy the last ones; their sums are never written.
    int wp = tid & 7, wr0 = tid >> 3, xo = tid & 31, xr0 = tid >> 5;
    u32 wsrc[4], xsrc[X_PER_THREAD];
#pragma unroll
    for (int i = 0; i < 4; i++) wsrc[i] = (u32)min(col0 + wr0 + 32 * i, n - 1) * k + (wp >> 2) * 32 + (wp & 3) * 8;
#pragma unroll
    for (int i = 0; i < X_PER_THREAD; i++)
        xsrc[i] = (u32)min(row0 + xr0 + 8 * i, rows - 1) * k + (xo >> 4) * 32 + gemv_word(xo & 15) * 2;
    int wdst = wr0 * 128 + ((wp ^ ((wr0 & 1) << 2)) << 4);
    int xdst = W_BYTES + xr0 * 128 + (((xo >> 2) ^ (xr0 & 7)) << 4) + (xo & 3) * 4;
    auto load_w = [&](int st) {
        unsigned char* s = gw_smem + (st % STAGES) * STAGE_BYTES;
        if (2 * st + (wp >> 2) < blocks) {
#pragma unroll
            for (int i = 0; i < 4; i++)
                gemm_copy16(reinterpret_cast<uint4*>(s + wdst + i * 32 * 128), w + wsrc[i] + (u32)st * 64);
        }
    };
    // Permuted, x is copied as w is: piece wp of rows wr0 + 32i.
    constexpr int XP_PER_THREAD = ROWS * 8 / GW_THREADS;
    u32 xpsrc[XP_PER_THREAD];
#pragma unroll
    for (int i = 0; i < XP_PER_THREAD; i++)
        xpsrc[i] = (u32)min(row0 + wr0 + 32 * i, rows - 1) * k + (wp >> 2) * 32 + (wp & 3) * 8;
    int xpdst = W_BYTES + wr0 * 128 + ((wp ^ (wr0 & 7)) << 4);
    auto load_x = [&](int st) {
        unsigned char* s = gw_smem + (st % STAGES) * STAGE_BYTES;
        if (PERMUTED) {
            if (2 * st + (wp >> 2) < blocks) {
#pragma unroll
                for (int i = 0; i < XP_PER_THREAD; i++)
                    gemm_copy16(reinterpret_cast<uint4*>(s + xpdst + i * 32 * 128), x + xpsrc[i] + (u32)st * 64);
            }
        } else if (2 * st + (xo >> 4) < blocks) {
#pragma unroll
            for (int i = 0; i < X_PER_THREAD; i++) cp_async4(s + xdst + i * 8 * 128, x + xsrc[i] + (u32)st * 64);
        }
    };
    // The weights are no earlier kernel's output: the first stages of them are asked for before
    // waiting on the kernel that writes x (they join the first stage's group of copies).
#pragma unroll
    for (int st = 0; st < AHEAD; st++)
        if (st < stages) load_w(st);
    after_previous_kernel();
#pragma unroll
    for (int st = 0; st < AHEAD; st++) {
        if (st < stages) load_x(st);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    // This warp's 16 columns of the warpgroup's 64: rows fr and fr + 8 of the w tile.
    int fr = (warp >> 2) * 64 + (warp & 3) * 16 + g;
    int wa_at = fr * 128, wb_at = (fr + 8) * 128, swap = (g & 1) << 2;
    float acc[ROWS / 8][4], tot[ROWS / 8][4];
#pragma unroll
    for (int j = 0; j < ROWS / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = tot[j][e] = 0.0f;
    int seg = 0, seg_end = segment_begin(1, segments, blocks);
    auto close_segments = [&](int done) {
        while (seg < segments && seg_end <= done) {
#pragma unroll
            for (int j = 0; j < ROWS / 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    tot[j][e] += acc[j][e];
                    acc[j][e] = 0.0f;
                }
            seg++;
            seg_end = segment_begin(seg + 1, segments, blocks);
        }
    };
    close_segments(0);
    for (int st = 0; st < stages; st++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(AHEAD - 1));
        // cp.async writes through the generic proxy; wgmma reads through the async one.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (st + AHEAD < stages) {
            load_w(st + AHEAD);
            load_x(st + AHEAD);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        const unsigned char* s = gw_smem + (st % STAGES) * STAGE_BYTES;
#pragma unroll
        for (int kl = 0; kl < 2; kl++) {
            int kb = 2 * st + kl;
            if (kb >= blocks) break;
            uint4 wa = *reinterpret_cast<const uint4*>(s + wa_at + (((kl * 4 + t) ^ swap) << 4));
            uint4 wb = *reinterpret_cast<const uint4*>(s + wb_at + (((kl * 4 + t) ^ swap) << 4));
            u32 a0[4] = {wa.x, wb.x, wa.y, wb.y}, a1[4] = {wa.z, wb.z, wa.w, wb.w};
            wgmma_pin(acc);
            wgmma_fence();
            wgmma_rows<ROWS>(acc, a0, smem_desc_sw128(s + W_BYTES + kl * 64, 16, 1024));
            wgmma_rows<ROWS>(acc, a1, smem_desc_sw128(s + W_BYTES + kl * 64 + 32, 16, 1024));
            wgmma_commit();
            wgmma_pin(acc);
            if (kb + 1 >= seg_end) {
                wgmma_wait<0>();
                wgmma_pin(acc);
                close_segments(kb + 1);
            }
        }
        wgmma_wait<2>();
    }
    wgmma_wait<0>();
    wgmma_pin(acc);
    int c = col0 + fr;
#pragma unroll
    for (int j = 0; j < ROWS / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int col = c + (e < 2 ? 0 : 8), row = row0 + 8 * j + 2 * t + (e & 1);
            if (row < rows && col < n) y[(size_t)row * n + col] = tot[j][e];
        }
}
#endif

// 128 columns x 64 rows a block, four stages of 24 KB: two blocks an SM. The _p forms read x
// as permute_k32 leaves it.
#if HAS_WGMMA
#define GEMM_WGMMA_KERNEL(NAME, ROWS, STAGES, BLOCKS, PERMUTED)                                                     \
    extern "C" __global__ void __launch_bounds__(GW_THREADS, BLOCKS)                                                \
        NAME(const bf16* __restrict__ x, const bf16* __restrict__ w, float* __restrict__ y, int rows, int n, int k, \
             int segments) {                                                                                        \
        gemm_wgmma_tile<ROWS, STAGES, PERMUTED>(x, w, y, rows, n, k, segments);                                     \
    }
#else
#define GEMM_WGMMA_KERNEL(NAME, ROWS, STAGES, BLOCKS, PERMUTED)                                                     \
    extern "C" __global__ void NAME(const bf16* x, const bf16* w, float* y, int rows, int n, int k, int segments) { \
        after_previous_kernel();                                                                                    \
    }
#endif
GEMM_WGMMA_KERNEL(gemm_wgmma, 64, 4, 2, false)
GEMM_WGMMA_KERNEL(gemm_wgmma_p, 64, 4, 2, true)
// 128 x 128 a block, six stages of 32 KB: one block an SM.
GEMM_WGMMA_KERNEL(gemm_wgmma_wide, 128, 6, 1, false)
GEMM_WGMMA_KERNEL(gemm_wgmma_wide_p, 128, 6, 1, true)

// xp = x with the 4-byte words of each 32-k block in the order the GEMV's mma sees them
// (gemv_word), for the wgmma product to copy 16 bytes at a time. A thread writes one 16-byte
// piece; rows x k elements, k a multiple of 32.
extern "C" __global__ void permute_k32(const bf16* __restrict__ x, bf16* __restrict__ xp, int rows, int k) {
    after_previous_kernel();
    size_t piece = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (piece >= (size_t)rows * k / 8) return;
    size_t block = piece / 4;
    int p = piece % 4;
    const u32* src = reinterpret_cast<const u32*>(x) + block * 16;
    uint4 v;
    v.x = src[gemv_word(4 * p)];
    v.y = src[gemv_word(4 * p + 1)];
    v.z = src[gemv_word(4 * p + 2)];
    v.w = src[gemv_word(4 * p + 3)];
    reinterpret_cast<uint4*>(xp)[piece] = v;
}
