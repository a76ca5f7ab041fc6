// The tensor-core GEMV alone, on the GPU machine, without the Rust build: times a variant of
// kernels/gemv.cu (GEMV_SRC, a path from this folder) on the 8B shape's projections at 1, 2
// and 8 rows, launched back to back with programmatic dependent launch as a step launches
// them (NOPDL=1: without), weights rotating among copies larger than L2; prints GB/s against the card's copy
// bandwidth (bytes read plus written) measured here, and writes each product for bit checks.
// BEHIND_US=N: each product follows a kernel of 16 blocks that runs N us without touching memory
// (as a short decode's attention does before the o projection); the time printed is then the
// product's exposed time, the pair's less that kernel's alone. MIDDLE=1|2 puts a short kernel
// between them (as flash_merge); GATE=1 queues each timing's launches behind a 200 us kernel.
//   nvcc -O3 -arch=sm_90 -std=c++17 -DGEMV_SRC='"../../kernels/gemv.cu"' gemv_bench.cu
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "bench_util.h"
#include "../../kernels/prelude.cuh"
#include GEMV_SRC

// Lets the next kernel start at once, then waits `ns` of the GPU's clock.
__global__ void spin(long long ns) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while ((long long)(t - t0) < ns);
}

// A short kernel between the spin and the product (MIDDLE=1 or 2), as flash_merge sits between
// attention and the output projection: 2 lets the product start before it waits.
__global__ void middle(int early) {
    if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (!early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

static float median_ms(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main(int argc, char** argv) {
    rng = 7;
    int warps = argc > 1 ? atoi(argv[1]) : 8;
    const char* dump = argc > 2 ? argv[2] : nullptr;
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    cudaStream_t stream; CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // The copy bandwidth, as scripts/bench-gpu measures it.
    size_t cb = (size_t)1 << 30; void *s0, *s1; CK(cudaMalloc(&s0, cb)); CK(cudaMalloc(&s1, cb));
    std::vector<float> ct;
    for (int r = 0; r < 7; r++) { cudaEventRecord(a); CK(cudaMemcpy(s1, s0, cb, cudaMemcpyDeviceToDevice)); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); ct.push_back(ms); }
    double bw = 2.0 * cb / median_ms(ct) / 1e6;
    CK(cudaFree(s0)); CK(cudaFree(s1));
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    // GATE=1: the timed launches queue behind a kernel of 200 us, so that the first of them
    // waits on the GPU, not on the host's launch (as in a captured graph).
    bool gate = getenv("GATE") && atoi(getenv("GATE"));
    printf("copy %.0f GB/s, %d warps a block, %d SMs%s\n", bw, warps, sms, gate ? ", launches queued behind a gate" : "");
    long long behind_ns = getenv("BEHIND_US") ? (long long)(atof(getenv("BEHIND_US")) * 1000) : 0;
    auto spin_launch = [&]() {
        cudaLaunchConfig_t cfg = {}; cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at; cfg.numAttrs = 1; cfg.stream = stream; cfg.gridDim = dim3(16); cfg.blockDim = dim3(128);
        CK(cudaLaunchKernelEx(&cfg, spin, behind_ns));
        int mid = getenv("MIDDLE") ? atoi(getenv("MIDDLE")) : 0;
        if (mid) {
            cfg.gridDim = dim3(32);
            CK(cudaLaunchKernelEx(&cfg, middle, mid == 2 ? 1 : 0));
        }
    };
    float spin_ms = 0;
    if (behind_ns) {
        std::vector<float> ts;
        for (int r = 0; r < 15; r++) {
            cudaEventRecord(a, stream); for (int c = 0; c < 10; c++) spin_launch(); cudaEventRecord(b, stream); cudaEventSynchronize(b);
            float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms / 10);
        }
        spin_ms = median_ms(ts);
        printf("behind a kernel of %.1f us (alone); times below are the products' exposed time\n", spin_ms * 1e3);
    }

    struct Shape { const char* name; int n, k; } shapes[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"down", 4096, 14336}, {"gate_up", 28672, 4096}};
    FILE* out = dump ? fopen(dump, "wb") : nullptr;
    for (auto& sh : shapes) {
        size_t wn = (size_t)sh.n * sh.k;
        int copies = std::min(8, (int)((256ull << 20) / (wn * 2) + 1));
        std::vector<bf16*> ws(copies);
        std::vector<unsigned short> hw(wn);
        for (auto& w : ws) { for (auto& x : hw) x = rbf(); CK(cudaMalloc(&w, wn * 2)); CK(cudaMemcpy(w, hw.data(), wn * 2, cudaMemcpyHostToDevice)); }
        std::vector<unsigned short> hx((size_t)8 * sh.k); for (auto& x : hx) x = rbf();
        bf16* x; float* y; CK(cudaMalloc(&x, hx.size() * 2)); CK(cudaMalloc(&y, (size_t)8 * sh.n * 4));
        CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
        printf("%-8s", sh.name);
        for (int rows : {1, 2, 8}) {
            auto launch = [&](int c) {
                cudaLaunchConfig_t cfg = {}; cudaLaunchAttribute at[1];
                at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
                cfg.attrs = at; cfg.numAttrs = getenv("NOPDL") ? 0 : 1; cfg.stream = stream;
                cfg.gridDim = dim3((sh.n + GEMV_MMA_COLS - 1) / GEMV_MMA_COLS); cfg.blockDim = dim3(32 * warps);
                CK(cudaLaunchKernelEx(&cfg, gemv_mma, (const bf16*)x, (const bf16*)ws[c % copies], y, rows, sh.n, sh.k));
            };
            for (int c = 0; c < copies; c++) launch(c);
            CK(cudaStreamSynchronize(stream));
            std::vector<float> ts;
            for (int r = 0; r < 15; r++) {
                if (gate) spin<<<1, 32, 0, stream>>>(200000);
                cudaEventRecord(a, stream);
                for (int c = 0; c < 10; c++) { if (behind_ns) spin_launch(); launch(c); }
                cudaEventRecord(b, stream); cudaEventSynchronize(b);
                float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms / 10);
            }
            double ms = median_ms(ts) - spin_ms, gbs = wn * 2.0 / ms / 1e6;
            printf("  %d row%s %6.1f us %5.0f GB/s %3.0f%%", rows, rows > 1 ? "s" : " ", ms * 1e3, gbs, 100 * gbs / bw);
            // The product of the first copy, for the bit check.
            launch(0); CK(cudaStreamSynchronize(stream));
            std::vector<float> hy((size_t)rows * sh.n);
            CK(cudaMemcpy(hy.data(), y, hy.size() * 4, cudaMemcpyDeviceToHost));
            if (out) fwrite(hy.data(), 4, hy.size(), out);
        }
        printf("\n");
        for (auto& w : ws) cudaFree(w); cudaFree(x); cudaFree(y);
    }
    if (out) fclose(out);
    return 0;
}
