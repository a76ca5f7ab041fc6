// Paged attention on tensor cores, for every row of a flattened batch: decode tokens, prefill
// chunks against their cached prefix, speculative checks. One kernel computes all of them, so a
// token's output does not depend on which of these it arrived as, nor on the batch around it.
//
// Rows. A sequence's query tokens times the query heads of one KV head (its GQA group) make
// rows, token-major: row r is token r / group, head r % group. A block takes 64 consecutive rows
// of one sequence and one KV head (an "item" from the host), so the heads of a group share
// every read of a K or V tile; each of its 4 warps owns 16 rows. Decode (one token, a group of
// 1 to 8 heads) fills one warp; the others help load (and on Hopper take part in the mma).
//
// Keys. Tiles of 64 keys at absolute positions 64i, loaded through the block table (blocks of 16
// tokens, each sequence's row padded to a multiple of 4 entries) into shared memory by cp.async,
// two stages deep. Scores are bf16 mma (wgmma on Hopper, else mma.sync m16n8k16: the same bits)
// with f32 accumulation; the online softmax runs in base 2; the probabilities, rounded to bf16, multiply
// V on the tensor cores too. A row ignores keys past its position (causal), and a tile with
// none of its keys leaves its state exactly as it was, so where a row's tile ends does not
// matter.
//
// Partitions. Keys are also cut into fixed partitions at absolute positions: FA_SMALL keys each
// below FA_SMALL_KEYS, FA_PART keys each after (`fa_part_of`, `fa_part_start`). A split block
// walks one partition, so its chain of tiles sets the latency of a short context decoding alone
// (few blocks, the GPU mostly idle); long contexts have partitions enough to fill the GPU, and
// large ones keep their merge short. Each partition's (max, sum, unnormalized values) is
// computed from scratch and folded into the row's total, partition after partition, by `fold`.
// A block either walks all partitions itself (whole mode: `partials` null) or computes one
// (split mode: blockIdx.z, for few rows over long contexts) and writes it for flash_merge, which
// folds them in the same order with the same arithmetic: the two modes give the same bits. A
// token's records follow those of the tokens before it (`part_bases`, from the host), so the
// scratch holds the partitions the step's rows reach, not every row times the longest context.
#define FA_BLOCK 16  // tokens per KV block: the host sends only such caches here
#define FA_WARPS 4
#define FA_THREADS (32 * FA_WARPS)
#define FA_ROWS (16 * FA_WARPS)
#define FA_KEYS 64
#define FA_PART 512
#define FA_SMALL 128
#define FA_SMALL_KEYS 1024

// The partition of the key at absolute position `key`, and where partition `z` starts. The host
// (attention.rs) numbers partitions the same way.
__host__ __device__ __forceinline__ int fa_part_of(int key) {
    return key < FA_SMALL_KEYS ? key / FA_SMALL : FA_SMALL_KEYS / FA_SMALL + (key - FA_SMALL_KEYS) / FA_PART;
}

__host__ __device__ __forceinline__ int fa_part_start(int z) {
    const int small = FA_SMALL_KEYS / FA_SMALL;
    return z < small ? z * FA_SMALL : FA_SMALL_KEYS + (z - small) * FA_PART;
}

// 16 bytes global -> shared; bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most one group is still in flight.
__device__ __forceinline__ void cp_async_wait_one() {
    asm volatile("cp.async.wait_group 1;\n" ::);
}

__device__ __forceinline__ void ldmatrix_x4(const bf16* p, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(const bf16* p, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}

// c += a * b: a 16x16 (rows x k), b 16x8 (k x cols), c 16x8 f32.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x, the hardware's approximation (flushing subnormals): deterministic, and every row's
// arithmetic in every kernel here goes through it alike.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats as bf16 (round to nearest even), lo in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The fold of one partition (max m, sum l, values a) into a row's total (M, L, A): the only
// arithmetic that joins partitions, in whole and split mode alike. Explicit roundings keep the
// compiler from contracting it differently in the two kernels. Returns the weights of the old
// total and of the partition; a first partition is taken as it is.
struct FoldWeights {
    float old_w, part_w;
    bool first;
};

__device__ __forceinline__ FoldWeights fold_scalars(float& M, float& L, float m, float l) {
    FoldWeights w;
    w.first = L == 0.0f;
    if (w.first) {
        M = m;
        L = l;
        w.old_w = 0.0f;
        w.part_w = 1.0f;
        return w;
    }
    float big = fmaxf(M, m);
    w.old_w = fast_exp2(__fsub_rn(M, big));
    w.part_w = fast_exp2(__fsub_rn(m, big));
    L = __fmaf_rn(L, w.old_w, __fmul_rn(l, w.part_w));
    M = big;
    return w;
}

__device__ __forceinline__ float fold_value(FoldWeights w, float total, float part) {
    return w.first ? part : __fmaf_rn(total, w.old_w, __fmul_rn(part, w.part_w));
}

// Hopper (sm_90a) multiplies on wgmma (the prelude's helpers); other cards on mma.sync (below).
// On wgmma, the scores and the values' product read B from shared memory by descriptor, A is
// this warp's 16 rows as the mma.sync A fragment and d is in the mma.sync C layout, so the
// fragments of every other step are those of the mma.sync path; and the sums come out the same
// bits as that path's chains of m16n8k16 (scripts/flash-bench compares them), so a row does not
// depend on which path computed it either. The block's 4 warps are one warpgroup of 64 rows,
// FA_ROWS.
#define FA_WGMMA HAS_WGMMA

// Where key r's 16-byte piece c of the head lies in a tile (in elements). For mma.sync, rows
// padded by 8 elements, so the 8 rows of an ldmatrix fall in distinct banks. For wgmma, its
// 128-byte swizzle: D / 64 panels of 64 dimensions, each 64 keys of 128 bytes, piece c of a
// panel's row r at r * 128 + (c ^ (r % 8)) * 16 bytes, so the 8 rows of a core matrix fall in
// distinct banks, for the mma and for the copies alike.
template <int D>
__device__ __forceinline__ int tile_offset(int r, int c) {
#if FA_WGMMA
    return (c / 8) * (FA_KEYS * 64) + r * 64 + ((c % 8) ^ (r & 7)) * 8;
#else
    return r * (D + 8) + c * 8;
#endif
}

// The tile's four KV blocks, `blocks`, come in one 16-byte read of the block table (the host pads
// each sequence's table to a multiple of four entries, and tiles start at multiples of 64 keys).
// A thread always copies the same 16-byte piece of a key's head, for every STEP-th key; STEP
// divides a KV block, so each pass lies in one block known at compile time and the loop
// unrolls to a few integer operations and two copies a pass. Offsets are 32-bit: the host keeps
// a layer's cache under 2^32 elements.
template <int D>
__device__ __forceinline__ void load_tile(bf16* ks, bf16* vs, const bf16* k_cache, const bf16* v_cache,
                                          uint4 blocks, u32 kv_size, int kv_head, int k0, int last) {
    constexpr int CHUNKS = D / 8;
    constexpr int STEP = FA_THREADS / CHUNKS;
    static_assert(FA_BLOCK % STEP == 0, "a pass of keys lies in one KV block");
    const u32 block_of[4] = {blocks.x, blocks.y, blocks.z, blocks.w};
    int c = threadIdx.x % CHUNKS, key = threadIdx.x / CHUNKS;
    u32 col = (u32)kv_head * D + c * 8;
#pragma unroll
    for (int p = 0; p < FA_KEYS / STEP; p++) {
        int r = p * STEP + key;
        u32 slot = block_of[p * STEP / FA_BLOCK] * FA_BLOCK + (p * STEP) % FA_BLOCK + key;
        // Keys past the block's last position may lie past the sequence: zeros, never read.
        bool in = k0 + r <= last;
        u32 off = in ? slot * kv_size + col : 0u;
        cp_async16(ks + tile_offset<D>(r, c), k_cache + off, in ? 16 : 0);
        cp_async16(vs + tile_offset<D>(r, c), v_cache + off, in ? 16 : 0);
    }
}

// The maximum (MAX) or sum of this thread's 16 values of row rr in a tile of scores, as a
// tree: dependent chains of 4 operations, not 16.
template <bool MAX>
__device__ __forceinline__ float row_reduce(const float (&s)[8][4], int rr) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = MAX ? fmaxf(s[j][2 * rr], s[j][2 * rr + 1]) : __fadd_rn(s[j][2 * rr], s[j][2 * rr + 1]);
#pragma unroll
    for (int w = 4; w > 0; w >>= 1)
#pragma unroll
        for (int j = 0; j < w; j++) v[j] = MAX ? fmaxf(v[j], v[j + w]) : __fadd_rn(v[j], v[j + w]);
    return v[0];
}

template <int D>
__device__ __forceinline__ void flash_attention(const bf16* __restrict__ q, bf16* __restrict__ out,
                                                const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                                const u32* __restrict__ items, const u32* __restrict__ positions,
                                                const u32* __restrict__ block_tables, int max_blocks, int num_heads,
                                                int num_kv_heads, float scale_log2,
                                                float* __restrict__ partials, const u32* __restrict__ part_bases) {
    constexpr int STRIDE = D + 8;  // a 16-byte pad puts the 8 rows of an ldmatrix in distinct banks
    constexpr int TILE = FA_KEYS * STRIDE;
    constexpr int NT = D / 8;   // 8-wide column tiles of the output
    constexpr int KC = D / 16;  // 16-wide chunks of a head
    extern __shared__ __align__(1024) unsigned char fa_smem[];  // the swizzle repeats every 1024 bytes
    bf16* stages = reinterpret_cast<bf16*>(fa_smem);                                 // [2][K, V]
    // [warps][16][RUN_STRIDE]: 8 floats of pad put a thread group's float2s in distinct banks.
    constexpr int RUN_STRIDE = D + 8;
    float* running = reinterpret_cast<float*>(fa_smem + 4 * TILE * sizeof(bf16));

    // Items come in sequence order, later rows with more keys: the heaviest start first.
    const u32* item = items + 4 * (gridDim.x - 1 - blockIdx.x);
    int seq = item[0], token0 = item[1], row0 = item[2], row_end = item[3];
    int kv_head = blockIdx.y;
    int group = num_heads / num_kv_heads;
    int rows_here = min(FA_ROWS, row_end - row0);
    int last = positions[token0 + (row0 + rows_here - 1) / group];
    bool split = partials != nullptr;
    int z_begin = split ? (int)blockIdx.z : 0;
    int z_end = split ? z_begin + 1 : fa_part_of(last) + 1;
    if (fa_part_start(z_begin) > last) return;
    u32 kv_size = (u32)num_kv_heads * D;
    const u32* table = block_tables + (size_t)seq * max_blocks;
    int first_key = fa_part_start(z_begin);
    int end_key = min(fa_part_start(z_end), last + 1);
    int tiles = (end_key - first_key + FA_KEYS - 1) / FA_KEYS;
    // A tile's KV blocks are read from the table a tile ahead of its copy, so the copy never
    // waits on that read.
    auto blocks_of = [&](int k0) { return *reinterpret_cast<const uint4*>(table + k0 / FA_BLOCK); };
    // Keys before the sequence's first position in this step were written by earlier steps,
    // which are done once this kernel runs: the kernel before it (the one writing this step's
    // keys and the queries) started only after everything before it had ended. Such a first
    // tile is copied before the wait, so its read overlaps that kernel's end.
    auto load_first = [&]() {
        load_tile<D>(stages, stages + TILE, k_cache, v_cache, blocks_of(first_key), kv_size, kv_head, first_key, last);
    };
    bool early = first_key + FA_KEYS <= (int)positions[token0];
    if (early) load_first();
    // Only now wait for the kernel before (the items, positions and tables are uploads, which
    // no kernel writes): a split grid is as deep as the longest context, and under programmatic
    // launch every one of a short row's empty partitions would otherwise sit out that kernel's
    // end holding an SM slot and its shared memory (64 decoders beside one 8k document: 16
    // partitions a row, 14 of them empty).
    after_previous_kernel();

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    // A warpgroup's mma needs every warp, rows or not (missing rows are masked out).
    bool warp_active = FA_WGMMA || row0 + warp * 16 < row_end;
    // This thread's two rows: g and g + 8 of its warp's sixteen.
    int tok[2], head[2], pos[2];
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        int r = row0 + warp * 16 + g + 8 * rr;
        tok[rr] = -1;
        head[rr] = 0;
        pos[rr] = -1;
        if (r < row_end) {
            tok[rr] = token0 + r / group;
            head[rr] = kv_head * group + r % group;
            pos[rr] = positions[tok[rr]];
        }
    }
    // The earliest position among the warp's rows (-1 where a row is missing).
    int warp_min_pos = min(pos[0], pos[1]);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) warp_min_pos = min(warp_min_pos, __shfl_xor_sync(0xffffffffu, warp_min_pos, o));
    // The rows' queries as A fragments, for the whole kernel.
    u32 qf[KC][4];
    size_t q_stride = (size_t)num_heads * D;
#pragma unroll
    for (int c = 0; c < KC; c++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int rr = e & 1, dim = c * 16 + 2 * t + (e >> 1) * 8;
            qf[c][e] = tok[rr] < 0 ? 0u
                                   : *reinterpret_cast<const u32*>(q + tok[rr] * q_stride + head[rr] * D + dim);
        }
    }

    float M[2] = {NEG_INF, NEG_INF}, L[2] = {0.0f, 0.0f};  // the total of partitions folded so far
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};  // the current partition's
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][e] = 0.0f;
    float* run = running + (size_t)warp * 16 * RUN_STRIDE;

    if (!early) load_first();
    cp_async_commit();
    uint4 upcoming = tiles > 1 ? blocks_of(first_key + FA_KEYS) : make_uint4(0, 0, 0, 0);
    for (int i = 0; i < tiles; i++) {
        int k0 = first_key + i * FA_KEYS;
        if (i + 1 < tiles) {
            bf16* next = stages + ((i + 1) & 1) * 2 * TILE;
            load_tile<D>(next, next + TILE, k_cache, v_cache, upcoming, kv_size, kv_head, k0 + FA_KEYS, last);
            if (i + 2 < tiles) upcoming = blocks_of(k0 + 2 * FA_KEYS);
        }
        cp_async_commit();
        cp_async_wait_one();
#if FA_WGMMA
        // cp.async writes through the generic proxy; wgmma reads K and V through the async one.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
        __syncthreads();
        if (warp_active) {
            const bf16* ks = stages + (i & 1) * 2 * TILE;
            const bf16* vs = ks + TILE;
            float s[8][4];
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] = 0.0f;
#if FA_WGMMA
            // Chunk c of the head: panel c / 4, 32 bytes into its rows per 16 dimensions.
            wgmma_pin(s);
            wgmma_fence();
#pragma unroll
            for (int c = 0; c < KC; c++)
                wgmma_n64<0>(s, qf[c], smem_desc_sw128(ks + (c / 4) * FA_KEYS * 64 + (c % 4) * 16, 16, 1024));
            wgmma_commit_and_wait();
            wgmma_pin(s);
#else
            int mi = lane >> 3;
#pragma unroll
            for (int c = 0; c < KC; c++) {
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    u32 b0, b1, b2, b3;
                    int key = np * 16 + (mi >> 1) * 8 + (lane & 7);
                    ldmatrix_x4(ks + key * STRIDE + c * 16 + (mi & 1) * 8, b0, b1, b2, b3);
                    mma_bf16(s[2 * np], qf[c], b0, b1);
                    mma_bf16(s[2 * np + 1], qf[c], b2, b3);
                }
            }
#endif
            // Element e of column tile j: row g + 8 * (e >> 1), key k0 + 8j + 2t + (e & 1). Tiles
            // wholly before every row of the warp skip the causal mask (the same values result).
            // The maxima are taken on the raw scores (scaling by a positive constant keeps their
            // order) and scaled once; each probability is one fused multiply-add and an exp2.
            if (k0 + FA_KEYS - 1 > warp_min_pos) {
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (k0 + 8 * j + 2 * t + (e & 1) > pos[e >> 1]) s[j][e] = NEG_INF;
            }
            float tile_max[2] = {row_reduce<true>(s, 0), row_reduce<true>(s, 1)};
            float corr[2], base[2];
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                float mx = fmaxf(tile_max[rr], __shfl_xor_sync(0xffffffffu, tile_max[rr], 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                float m_new = fmaxf(m[rr], __fmul_rn(mx, scale_log2));
                // No key yet: nothing to correct, and every p is exp2(-inf) = 0.
                bool none = m_new == NEG_INF;
                corr[rr] = none ? 1.0f : fast_exp2(__fsub_rn(m[rr], m_new));
                base[rr] = none ? 0.0f : m_new;
                m[rr] = m_new;
            }
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] = fast_exp2(__fmaf_rn(s[j][e], scale_log2, -base[e >> 1]));
#pragma unroll
            for (int rr = 0; rr < 2; rr++) l[rr] = __fmaf_rn(l[rr], corr[rr], row_reduce<false>(s, rr));
            // Once the rows' maxima settle, the correction is 1 and leaves the values as they
            // are, and a partition's first tile finds them zero: the warp skips it together.
            if (k0 != fa_part_start(fa_part_of(k0)) && __any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    acc[j][0] = __fmul_rn(acc[j][0], corr[0]);
                    acc[j][1] = __fmul_rn(acc[j][1], corr[0]);
                    acc[j][2] = __fmul_rn(acc[j][2], corr[1]);
                    acc[j][3] = __fmul_rn(acc[j][3], corr[1]);
                }
            }
            // The scores' accumulator layout is the A fragment layout of P for 16 keys at a time.
#if FA_WGMMA
            // V is N-major here: 16 keys a step (2048 bytes), panels of 64 dimensions apart.
            u32 pa[4][4];
#pragma unroll
            for (int kc = 0; kc < 4; kc++) {
                pa[kc][0] = pack_bf16x2(s[2 * kc][0], s[2 * kc][1]);
                pa[kc][1] = pack_bf16x2(s[2 * kc][2], s[2 * kc][3]);
                pa[kc][2] = pack_bf16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
                pa[kc][3] = pack_bf16x2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
            }
            wgmma_pin(acc);
            wgmma_fence();
#pragma unroll
            for (int kc = 0; kc < 4; kc++) {
                u64 desc = smem_desc_sw128(vs + kc * 16 * 64, FA_KEYS * 128, 1024);
                if constexpr (D == 128)
                    wgmma_n128<1>(acc, pa[kc], desc);
                else
                    wgmma_n64<1>(acc, pa[kc], desc);
            }
            wgmma_commit_and_wait();
            wgmma_pin(acc);
#else
#pragma unroll
            for (int kc = 0; kc < 4; kc++) {
                u32 pa[4] = {pack_bf16x2(s[2 * kc][0], s[2 * kc][1]), pack_bf16x2(s[2 * kc][2], s[2 * kc][3]),
                             pack_bf16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                             pack_bf16x2(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
                for (int dp = 0; dp < D / 16; dp++) {
                    u32 b0, b1, b2, b3;
                    int key = kc * 16 + (mi & 1) * 8 + (lane & 7);
                    ldmatrix_x4_trans(vs + key * STRIDE + dp * 16 + (mi >> 1) * 8, b0, b1, b2, b3);
                    mma_bf16(acc[2 * dp], pa, b0, b1);
                    mma_bf16(acc[2 * dp + 1], pa, b2, b3);
                }
            }
#endif
        }
        __syncthreads();

        bool partition_ends = i + 1 == tiles || fa_part_start(fa_part_of(k0) + 1) == k0 + FA_KEYS;
        if (partition_ends && warp_active) {
            int z = fa_part_of(k0);
            float lp[2];
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                float v = __fadd_rn(l[rr], __shfl_xor_sync(0xffffffffu, l[rr], 1));
                lp[rr] = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
            }
            if (split) {
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    if (pos[rr] < fa_part_start(z)) continue;  // no key of this partition
                    float* rec = partials + ((size_t)(part_bases[tok[rr]] + z) * num_heads + head[rr]) * (D + 2);
                    if (t == 0) {
                        rec[0] = m[rr];
                        rec[1] = lp[rr];
                    }
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        rec[2 + 8 * j + 2 * t] = acc[j][2 * rr];
                        rec[2 + 8 * j + 2 * t + 1] = acc[j][2 * rr + 1];
                    }
                }
            } else {
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    if (lp[rr] == 0.0f) continue;  // no key of this partition
                    FoldWeights w = fold_scalars(M[rr], L[rr], m[rr], lp[rr]);
                    float2* row = reinterpret_cast<float2*>(run + (g + 8 * rr) * RUN_STRIDE + 2 * t);
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        float2 v = w.first ? make_float2(0.0f, 0.0f) : row[4 * j];
                        v.x = fold_value(w, v.x, acc[j][2 * rr]);
                        v.y = fold_value(w, v.y, acc[j][2 * rr + 1]);
                        row[4 * j] = v;
                    }
                }
            }
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                m[rr] = NEG_INF;
                l[rr] = 0.0f;
            }
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[j][e] = 0.0f;
        }
    }

    if (!split && warp_active) {
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            if (tok[rr] < 0) continue;
            const float2* row = reinterpret_cast<const float2*>(run + (g + 8 * rr) * RUN_STRIDE + 2 * t);
            u32* o = reinterpret_cast<u32*>(out + tok[rr] * q_stride + head[rr] * D + 2 * t);
            float inv = __frcp_rn(L[rr]);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                float2 v = row[4 * j];
                o[4 * j] = pack_bf16x2(__fmul_rn(v.x, inv), __fmul_rn(v.y, inv));
            }
        }
    }
}

#define FLASH_ENTRY(D)                                                                                          \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_d##D(                              \
        const bf16* q, bf16* out, const bf16* k_cache, const bf16* v_cache, const u32* items,                 \
        const u32* positions, const u32* block_tables, int max_blocks, int num_heads, int num_kv_heads,        \
        float scale_log2, float* partials, const u32* part_bases) {                                             \
        flash_attention<D>(q, out, k_cache, v_cache, items, positions, block_tables, max_blocks, num_heads,    \
                           num_kv_heads, scale_log2, partials, part_bases);                                     \
    }
FLASH_ENTRY(64)
FLASH_ENTRY(128)

// Folds the partitions split mode wrote, in order, with `fold`: one block per (token, head),
// one thread per dimension of the head. The records are read MERGE_AHEAD at a time before they
// are folded, so a long context's partitions are not one dependent read after another.
#define MERGE_AHEAD 8
extern "C" __global__ void flash_merge(const float* __restrict__ partials, const u32* __restrict__ positions,
                                       const u32* __restrict__ part_bases, bf16* __restrict__ out, int num_heads,
                                       int head_dim) {
    int tok = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    // Positions and bases are uploads, which no kernel writes: read before the wait, they leave
    // the records' reads the only round trip after it.
    int parts = fa_part_of((int)positions[tok]) + 1;
    // Partition p's record of this head: part_bases[tok] + p in the step's numbering.
    const size_t stride = (size_t)num_heads * (head_dim + 2);
    const float* recs = partials + ((size_t)part_bases[tok] * num_heads + head) * (head_dim + 2);
    // The o projection follows: its blocks start now and read their first weights while
    // attention and this merge run (H200: the step's span 0.9% shorter, "Reads before the wait").
    let_next_start_then_wait();
    if (d >= head_dim) return;
    float M = NEG_INF, L = 0.0f, A = 0.0f;
    for (int p0 = 0; p0 < parts; p0 += MERGE_AHEAD) {
        float m[MERGE_AHEAD], l[MERGE_AHEAD], a[MERGE_AHEAD];
#pragma unroll
        for (int u = 0; u < MERGE_AHEAD; u++) {
            if (p0 + u < parts) {
                const float* rec = recs + (size_t)(p0 + u) * stride;
                m[u] = rec[0];
                l[u] = rec[1];
                a[u] = rec[2 + d];
            }
        }
#pragma unroll
        for (int u = 0; u < MERGE_AHEAD; u++) {
            if (p0 + u < parts) {
                FoldWeights w = fold_scalars(M, L, m[u], l[u]);
                A = fold_value(w, A, a[u]);
            }
        }
    }
    out[((size_t)tok * num_heads + head) * head_dim + d] = f32_to_bf16(__fmul_rn(A, __frcp_rn(L)));
}
