// Would one persistent kernel for a whole batch-1 decode step reach the roofline that a kernel
// per operation does not? A feasibility measurement for issue 29's batch-1 target, before any
// of it is built into the backend: the Llama-3.1-8B step's 15.0 GB of weights (32 layers of
// q|k|v, o, gate|up and down, then the head) streamed by one block an SM through a ring of
// shared memory, each block's chunks asked for `stages - 1` ahead of the one it multiplies,
// across the ends of products and layers, so that the reads go on while a block waits for the
// step's real dependencies (a counter per product in each layer): attention needs every q|k|v
// column, o every head's partitions (each block merges them itself), gate|up the residual
// stream after o (each block keeps its own copy of the stream and normalizes it), down every
// gate|up column, the next layer's q|k|v the stream after down. Attention is a plain CUDA-core
// decode over 128-key partitions of the real cache's size; ATTN_PAD_NS lengthens each of its
// items to the duration of the real kernel's, for the honest bound.
//
// It times the timing structure only: the sums are not the backend's bits (CUDA-core dot
// products, no RoPE, no norm weights), so nothing here can replace a kernel. Prints the card's
// copy bandwidth (bytes read plus written, as scripts/bench-gpu), the roofline, and the step's
// time against it for each variant: the ring's depth, with and without the waits.
//   nvcc -O3 -arch=sm_90a -std=c++17 mega_bench.cu -o /tmp/mega && /tmp/mega
#ifndef __CUDACC_RTC__
#include <algorithm>
#include <cmath>
#include <vector>
#include "bench_util.h"
#endif
#include "../../kernels/prelude.cuh"

#define D 4096
#define QKV_N 6144
#define INTER 14336
#define VOCAB 128256
#define LAYERS 32
#define KV_HEADS 8
#define HEAD_DIM 128
#define COLS 16
#define CHUNK_K 1024
#define CHUNK_BYTES (COLS * CHUNK_K * 2)
#define THREADS 512
#define PART_KEYS 128

// Tiles of 16 weight rows per product; a block takes every G-th tile of the step's sequence.
#define T_QKV (QKV_N / COLS)
#define T_O (D / COLS)
#define T_GU (INTER / 8)
#define T_DOWN (D / COLS)
#define T_LAYER (T_QKV + T_O + T_GU + T_DOWN)
#define T_HEAD ((VOCAB + COLS - 1) / COLS)
#define T_ALL (LAYERS * T_LAYER + T_HEAD)
#define LAYER_ELEMS ((size_t)(QKV_N + D + 2 * INTER) * D + (size_t)D * INTER)

enum Op { QKV, O, GU, DOWN, HEAD };

struct Params {
    const bf16* w;       // layers back to back (q|k|v, o, gate|up, down), then the head
    bf16* cache;         // [layer][position][kv head][k, v][128]
    float* qkv;          // [layer][6144]
    float* parts;        // [layer][32 heads][partitions][128 + 2]
    float* o_out;        // [layer][4096]
    bf16* act;           // [layer][14336]
    float* down_out;     // [layer][4096]
    float* logits;       // [vocab]
    unsigned* counters;  // [layer][5]: q|k|v tiles, attention items, o, gate|up, down
    const float* x0;     // the token's embedding
    int ctx;             // keys in the cache before this token
    int nparts;          // partitions of 128 keys over ctx + 1 keys
    long long pad_ns;    // each attention item lasts at least this long
    int wait;            // 0: no dependency waits (the stream alone)
    unsigned long long* stamps;  // [layer][5]: when each counter was completed (globaltimer)
    unsigned* error;     // set where a wait gave up (200 ms), so that a bug cannot hang the call
};

struct Tile {
    Op op;
    int layer, t, chunks;
};

__device__ __forceinline__ Tile tile_of(int g) {
    Tile r;
    if (g >= LAYERS * T_LAYER) {
        r.op = HEAD; r.layer = LAYERS; r.t = g - LAYERS * T_LAYER; r.chunks = D / CHUNK_K;
        return r;
    }
    r.layer = g / T_LAYER;
    int t = g % T_LAYER;
    if (t < T_QKV) { r.op = QKV; r.t = t; r.chunks = D / CHUNK_K; }
    else if ((t -= T_QKV) < T_O) { r.op = O; r.t = t; r.chunks = D / CHUNK_K; }
    else if ((t -= T_O) < T_GU) { r.op = GU; r.t = t; r.chunks = D / CHUNK_K; }
    else { r.op = DOWN; r.t = t - T_GU; r.chunks = INTER / CHUNK_K; }
    return r;
}

// The weight row behind row `row` (0..15) of a tile.
__device__ __forceinline__ const bf16* tile_row(const bf16* w, Tile t, int row) {
    if (t.op == HEAD) return w + LAYERS * LAYER_ELEMS + (size_t)min(t.t * COLS + row, VOCAB - 1) * D;
    const bf16* l = w + t.layer * LAYER_ELEMS;
    switch (t.op) {
    case QKV: return l + (size_t)(t.t * COLS + row) * D;
    case O: return l + (size_t)QKV_N * D + (size_t)(t.t * COLS + row) * D;
    case GU: {
        // gate rows 8t..8t+7 then the same columns' up rows, so a tile can finish SiLU x up.
        int r = row < 8 ? t.t * 8 + row : INTER + t.t * 8 + row - 8;
        return l + (size_t)(QKV_N + D) * D + (size_t)r * D;
    }
    default: return l + (size_t)(QKV_N + D + 2 * INTER) * D + (size_t)(t.t * COLS + row) * INTER;
    }
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// Waits (the whole block) until `*c` reaches `target`.
__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ void wait_for(const Params& p, const unsigned* c, unsigned target) {
    if (p.wait && threadIdx.x == 0) {
        unsigned long long t0 = now();
        while (ld_acquire(c) < target) {
            __nanosleep(64);
            if (now() - t0 > 200000000ull) { atomicExch(p.error, 1u); break; }
        }
    }
    __syncthreads();
}

// Counts one finished piece of work of `target`, after every thread's writes; the last one
// stamps the time.
__device__ void signal(const Params& p, int counter, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(p.counters + counter, 1u) == target - 1) p.stamps[counter] = now();
    }
}

// x += branch; operand = bf16(x * rsqrt(mean(x^2) + eps)).
__device__ void add_norm(float* x, const float* branch, bf16* operand, float* red) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += THREADS) {
        float v = x[i] + (branch ? ld_cg(branch + i) : 0.0f);
        x[i] = v;
        ss += v * v;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < THREADS / 32; i++) total += red[i];
    float scale = rsqrtf(total / D + 1e-5f);
    for (int i = threadIdx.x; i < D; i += THREADS) operand[i] = f32_to_bf16(x[i] * scale);
    __syncthreads();
}

// One attention item: the 4 query heads of a KV head over one partition of 128 keys.
__device__ void attention_item(const Params& p, int layer, int item, float* smem_f) {
    unsigned long long t0 = now();
    int kvh = item / p.nparts, part = item % p.nparts;
    int k0 = part * PART_KEYS, k1 = min(p.ctx + 1, k0 + PART_KEYS), n = k1 - k0;
    float* q = smem_f;                   // [4][128]
    float* s = smem_f + 4 * HEAD_DIM;    // [4][128]
    const float* qs = p.qkv + (size_t)layer * QKV_N + kvh * 4 * HEAD_DIM;
    for (int i = threadIdx.x; i < 4 * HEAD_DIM; i += THREADS) q[i] = ld_cg(qs + i);
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bf16* base = p.cache + (size_t)layer * (p.ctx + 1) * KV_HEADS * 2 * HEAD_DIM;
    for (int key = warp; key < n; key += THREADS / 32) {
        const bf16* kr = base + ((size_t)(k0 + key) * KV_HEADS + kvh) * 2 * HEAD_DIM;
        float kv[4];
        for (int e = 0; e < 4; e++) kv[e] = bf16_to_f32(kr[lane * 4 + e]);
        for (int h = 0; h < 4; h++) {
            float d = 0.0f;
            for (int e = 0; e < 4; e++) d += q[h * HEAD_DIM + lane * 4 + e] * kv[e];
            d = warp_sum(d);
            if (lane == 0) s[h * PART_KEYS + key] = d * 0.08838834764f;
        }
    }
    __syncthreads();
    // Thread (h, d): the softmax of head h over the partition, then its output dimension d.
    int h = threadIdx.x / HEAD_DIM, d = threadIdx.x % HEAD_DIM;
    float m = NEG_INF;
    for (int key = 0; key < n; key++) m = fmaxf(m, s[h * PART_KEYS + key]);
    float l = 0.0f, o = 0.0f;
    for (int key = 0; key < n; key++) {
        float e = __expf(s[h * PART_KEYS + key] - m);
        l += e;
        o += e * bf16_to_f32(base[((size_t)(k0 + key) * KV_HEADS + kvh) * 2 * HEAD_DIM + HEAD_DIM + d]);
    }
    float* out = p.parts + (((size_t)layer * 32 + kvh * 4 + h) * p.nparts + part) * (HEAD_DIM + 2);
    out[d] = o;
    if (d == 0) { out[HEAD_DIM] = m; out[HEAD_DIM + 1] = l; }
    if (p.pad_ns)
        while ((long long)(now() - t0) < p.pad_ns) {}
    signal(p, layer * 5 + 1, KV_HEADS * p.nparts);
}

// Every head's partitions folded into o's operand.
__device__ void merge(const Params& p, int layer, bf16* operand) {
    for (int i = threadIdx.x; i < D; i += THREADS) {
        int h = i / HEAD_DIM, d = i % HEAD_DIM;
        const float* rec = p.parts + ((size_t)layer * 32 + h) * p.nparts * (HEAD_DIM + 2);
        float m = NEG_INF;
        for (int q = 0; q < p.nparts; q++) m = fmaxf(m, ld_cg(rec + q * (HEAD_DIM + 2) + HEAD_DIM));
        float o = 0.0f, l = 0.0f;
        for (int q = 0; q < p.nparts; q++) {
            const float* r = rec + q * (HEAD_DIM + 2);
            float f = __expf(ld_cg(r + HEAD_DIM) - m);
            o += f * ld_cg(r + d);
            l += f * ld_cg(r + HEAD_DIM + 1);
        }
        operand[i] = f32_to_bf16(o / l);
    }
    __syncthreads();
}

template <int STAGES>
__global__ void __launch_bounds__(THREADS, 1) mega_step(Params p) {
    const int stages = STAGES;
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* ring = smem;
    float* x = reinterpret_cast<float*>(smem + (size_t)stages * CHUNK_BYTES);   // [4096]
    bf16* operand = reinterpret_cast<bf16*>(x + D);                            // [14336]
    float* scratch = reinterpret_cast<float*>(operand + INTER);                // [1024]
    float* red = scratch + 1024;                                               // [32]
    int G = gridDim.x, b = blockIdx.x;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    // The producer's place in this block's stream of chunks, and the consumer's.
    int pg = b, pc = 0;
    auto issue = [&](int stage) {
        if (pg < T_ALL) {
            Tile t = tile_of(pg);
            unsigned char* dst = ring + (size_t)stage * CHUNK_BYTES;
            for (int piece = threadIdx.x; piece < CHUNK_BYTES / 16; piece += THREADS) {
                int row = piece >> 7, off = piece & 127;
                const bf16* src = tile_row(p.w, t, row) + pc * CHUNK_K + off * 8;
                cp_async16(dst + row * (CHUNK_K * 2) + off * 16, src);
            }
            if (++pc == t.chunks) { pc = 0; pg += G; }
        }
        cp_commit();
    };
    for (int s = 0; s < stages - 1; s++) issue(s);

    for (int i = threadIdx.x; i < D; i += THREADS) x[i] = p.x0[i];
    __syncthreads();
    add_norm(x, nullptr, operand, red);

    int phase_layer = 0;
    Op phase = QKV;
    float acc = 0.0f;
    int i = 0;
    for (int g = b; g < T_ALL; g += G) {
        Tile t = tile_of(g);
        if (t.op != phase || t.layer != phase_layer) {
            // Entering the next product: its operand, once what it reads is complete.
            unsigned* c = p.counters + t.layer * 5;
            if (t.op == O) {
                if (b < KV_HEADS * p.nparts) {
                    wait_for(p, c + 0, T_QKV);
                    attention_item(p, t.layer, b, scratch);
                }
                wait_for(p, c + 1, KV_HEADS * p.nparts);
                merge(p, t.layer, operand);
            } else if (t.op == GU) {
                wait_for(p, c + 2, T_O);
                add_norm(x, p.o_out + t.layer * D, operand, red);
            } else if (t.op == DOWN) {
                wait_for(p, c + 3, T_GU);
                for (int j = threadIdx.x; j < INTER; j += THREADS) operand[j] = ((volatile bf16*)p.act)[(size_t)t.layer * INTER + j];
                __syncthreads();
            } else {  // QKV of the next layer, or the head after the last
                wait_for(p, p.counters + (t.layer - 1) * 5 + 4, T_DOWN);
                add_norm(x, p.down_out + (t.layer - 1) * D, operand, red);
            }
            phase = t.op;
            phase_layer = t.layer;
        }
        for (int c = 0; c < t.chunks; c++, i++) {
            cp_wait<STAGES - 2>();  // this chunk has landed, the next ones need not have
            __syncthreads();
            issue((i + stages - 1) % stages);
            const uint4* wr = reinterpret_cast<const uint4*>(ring + (size_t)(i % stages) * CHUNK_BYTES + warp * CHUNK_K * 2);
            const uint4* xr = reinterpret_cast<const uint4*>(operand + c * CHUNK_K);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                uint4 wv = wr[j * 32 + lane], xv = xr[j * 32 + lane];
                float wf[8], xf[8];
                u32 ws[4] = {wv.x, wv.y, wv.z, wv.w}, xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    wf[2 * e] = __uint_as_float(ws[e] << 16); wf[2 * e + 1] = __uint_as_float(ws[e] & 0xffff0000u);
                    xf[2 * e] = __uint_as_float(xs[e] << 16); xf[2 * e + 1] = __uint_as_float(xs[e] & 0xffff0000u);
                }
#pragma unroll
                for (int e = 0; e < 8; e++) acc += wf[e] * xf[e];
            }
        }
        // The tile's 16 sums, one a warp.
        float sum = warp_sum(acc);
        acc = 0.0f;
        int col = t.t * COLS + warp;
        int c = t.layer * 5;
        if (t.op == GU) {
            if (lane == 0 && warp >= 8) scratch[warp - 8] = sum;
            __syncthreads();
            if (lane == 0 && warp < 8) p.act[(size_t)t.layer * INTER + t.t * 8 + warp] = f32_to_bf16(silu_times(sum, scratch[warp]));
            signal(p, c + 3, T_GU);
        } else if (lane == 0) {
            if (t.op == QKV) {
                p.qkv[(size_t)t.layer * QKV_N + col] = sum;
                // k and v of this token into the cache, at position ctx.
                if (col >= D) {
                    int kvcol = col - D, which = kvcol / (KV_HEADS * HEAD_DIM), h = (kvcol / HEAD_DIM) % KV_HEADS;
                    p.cache[(((size_t)t.layer * (p.ctx + 1) + p.ctx) * KV_HEADS + h) * 2 * HEAD_DIM + which * HEAD_DIM + kvcol % HEAD_DIM] = f32_to_bf16(sum);
                }
            } else if (t.op == O) p.o_out[(size_t)t.layer * D + col] = sum;
            else if (t.op == DOWN) p.down_out[(size_t)t.layer * D + col] = sum;
            else if (col < VOCAB) p.logits[col] = sum;
        }
        if (t.op == QKV) signal(p, c + 0, T_QKV);
        else if (t.op == O) signal(p, c + 2, T_O);
        else if (t.op == DOWN) signal(p, c + 4, T_DOWN);
        else if (t.op == HEAD) __syncthreads();
    }
    cp_wait<0>();
}

template __global__ void mega_step<3>(Params);
template __global__ void mega_step<4>(Params);
template __global__ void mega_step<5>(Params);

#ifndef __CUDACC_RTC__
__global__ void fill(bf16* w, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)(i * 2654435761u) ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        w[i] = f32_to_bf16(((h >> 8) / 16777216.0f - 0.5f) * 0.03f);
    }
}

static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

struct Run { float ms; float phase_us[5]; unsigned error; };

template <int S>
static Run run(Params p, int sms) {
    size_t smem = (size_t)S * CHUNK_BYTES + D * 4 + INTER * 2 + 1024 * 4 + 32 * 4;
    CK(cudaFuncSetAttribute(mega_step<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int per = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, mega_step<S>, THREADS, smem));
    if (per < 1) { printf("stages %d: no block fits an SM\n", S); exit(1); }
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    std::vector<float> ts;
    std::vector<unsigned long long> st(LAYERS * 5);
    double phase[5] = {0};
    int phases = 0;
    void* args[] = {&p};
    for (int r = 0; r < 12; r++) {
        CK(cudaMemset(p.counters, 0, LAYERS * 5 * 4));
        CK(cudaMemset(p.stamps, 0, LAYERS * 5 * 8));
        cudaEventRecord(a);
        CK(cudaLaunchCooperativeKernel((void*)mega_step<S>, sms, THREADS, args, smem, 0));
        cudaEventRecord(b);
        CK(cudaEventSynchronize(b));
        float ms; cudaEventElapsedTime(&ms, a, b);
        if (r >= 2) ts.push_back(ms);
        CK(cudaMemcpy(st.data(), p.stamps, st.size() * 8, cudaMemcpyDeviceToHost));
        // A layer's products and attention, each from the completion of what it follows.
        for (int l = 1; l < LAYERS && r >= 2; l++, phases++) {
            unsigned long long* s = &st[l * 5];
            phase[0] += ((double)s[0] - (double)st[(l - 1) * 5 + 4]) / 1e3;
            for (int k = 1; k < 5; k++) phase[k] += ((double)s[k] - (double)s[k - 1]) / 1e3;
        }
    }
    Run out;
    out.ms = median(ts);
    for (int k = 0; k < 5; k++) out.phase_us[k] = phases ? phase[k] / phases : 0;
    CK(cudaMemcpy(&out.error, p.error, 4, cudaMemcpyDeviceToHost));
    return out;
}

int main(int argc, char** argv) {
    int ctx = argc > 1 ? atoi(argv[1]) : 576;
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    size_t cb = (size_t)1 << 30; void *s0, *s1; CK(cudaMalloc(&s0, cb)); CK(cudaMalloc(&s1, cb));
    std::vector<float> ct;
    for (int r = 0; r < 7; r++) { cudaEventRecord(a); CK(cudaMemcpy(s1, s0, cb, cudaMemcpyDeviceToDevice)); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); ct.push_back(ms); }
    double bw = 2.0 * cb / median(ct) / 1e6;  // GB/s
    CK(cudaFree(s0)); CK(cudaFree(s1));
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));

    size_t welems = LAYERS * LAYER_ELEMS + (size_t)VOCAB * D;
    size_t celems = (size_t)LAYERS * (ctx + 1) * KV_HEADS * 2 * HEAD_DIM;
    int nparts = (ctx + 1 + PART_KEYS - 1) / PART_KEYS;
    Params p = {};
    bf16 *w, *cache;
    CK(cudaMalloc(&w, welems * 2)); CK(cudaMalloc(&cache, celems * 2));
    fill<<<1024, 256>>>(w, welems, 1); fill<<<1024, 256>>>(cache, celems, 2);
    CK(cudaDeviceSynchronize());
    p.w = w; p.cache = cache; p.ctx = ctx; p.nparts = nparts;
    CK(cudaMalloc(&p.qkv, (size_t)LAYERS * QKV_N * 4));
    CK(cudaMalloc(&p.parts, (size_t)LAYERS * 32 * nparts * (HEAD_DIM + 2) * 4));
    CK(cudaMalloc(&p.o_out, (size_t)LAYERS * D * 4));
    CK(cudaMalloc(&p.act, (size_t)LAYERS * INTER * 2));
    CK(cudaMalloc(&p.down_out, (size_t)LAYERS * D * 4));
    CK(cudaMalloc(&p.logits, (size_t)VOCAB * 4));
    unsigned* counters; CK(cudaMalloc(&counters, LAYERS * 5 * 4)); p.counters = counters;
    CK(cudaMalloc(&p.stamps, LAYERS * 5 * 8));
    CK(cudaMalloc(&p.error, 4)); CK(cudaMemset(p.error, 0, 4));
    std::vector<float> hx(D); for (auto& v : hx) { unsigned short u = rbf(); unsigned f = (unsigned)u << 16; memcpy(&v, &f, 4); }
    float* x0; CK(cudaMalloc(&x0, D * 4)); CK(cudaMemcpy(x0, hx.data(), D * 4, cudaMemcpyHostToDevice)); p.x0 = x0;

    double gb = welems * 2.0 / 1e9, roof = welems * 2.0 / bw / 1e6;
    printf("%s, %d SMs: copy %.0f GB/s; the step reads %.2f GB of weights: %.3f ms at that rate; context %d keys (%d partitions)\n",
           prop.name, sms, bw, gb, roof, ctx, nparts);
    printf("per layer at the copy rate: q|k|v %.1f us, o %.1f, gate|up %.1f, down %.1f\n",
           (double)QKV_N * D * 2 / bw / 1e3, (double)D * D * 2 / bw / 1e3, 2.0 * INTER * D * 2 / bw / 1e3, (double)D * INTER * 2 / bw / 1e3);
    struct V { int stages, wait; long long pad; } vs[] = {{3, 0, 0}, {5, 0, 0}, {3, 1, 0}, {4, 1, 0}, {5, 1, 0}, {5, 1, 6000}, {5, 1, 9000}, {4, 1, 6000}};
    for (auto v : vs) {
        p.wait = v.wait; p.pad_ns = v.pad;
        Run r = v.stages == 3 ? run<3>(p, sms) : v.stages == 4 ? run<4>(p, sms) : run<5>(p, sms);
        printf("stages %d, %-17s attention at least %4.1f us: %.3f ms a step, %.3fx the roofline", v.stages,
               v.wait ? "waits," : "no waits (stream),", v.pad / 1e3, r.ms, r.ms / roof);
        if (v.wait) printf("; a layer from what each follows: q|k|v %.1f us, attention %.1f, o %.1f, gate|up %.1f, down %.1f",
                           r.phase_us[0], r.phase_us[1], r.phase_us[2], r.phase_us[3], r.phase_us[4]);
        printf("%s\n", r.error ? "  (A WAIT GAVE UP: not a valid time)" : "");
        CK(cudaMemset(p.error, 0, 4));
    }
    std::vector<float> lg(VOCAB);
    CK(cudaMemcpy(lg.data(), p.logits, VOCAB * 4, cudaMemcpyDeviceToHost));
    int finite = 0; for (float v : lg) finite += std::isfinite(v);
    printf("logits finite: %d of %d\n", finite, VOCAB);
    return 0;
}
#endif
