// The residual add + RMSNorm and SiLU x up kernels alone, on the GPU machine, without the Rust
// build: times a variant of kernels/norm.cu and kernels/activation.cu (NORM_SRC, ACT_SRC, paths
// from this folder) at the 8B shape (hidden 4096, intermediate 14336) for 1 to 512 rows,
// launched back to back with programmatic dependent launch as a step launches them, buffers
// rotating among copies larger than L2; prints GB/s of the bytes each moves, and writes the
// outputs for bit checks. SiLU is timed with silu_mul4, or with silu_mul where -DSILU_ONE_A_THREAD
// is given (activation.cu before ec88ff1, which has no silu_mul4).
//   nvcc -O3 -arch=sm_90 -std=c++17 -DNORM_SRC='"../../kernels/norm.cu"' -DACT_SRC='"../../kernels/activation.cu"' norm_bench.cu
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "bench_util.h"
#include "../../kernels/prelude.cuh"
#include NORM_SRC
#include ACT_SRC

static float median_ms(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

template <typename... A>
static void launch(cudaStream_t s, void (*f)(A...), int grid, int block, A... args) {
    cudaLaunchConfig_t cfg = {}; cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at; cfg.numAttrs = 1; cfg.stream = s; cfg.gridDim = dim3(grid); cfg.blockDim = dim3(block);
    CK(cudaLaunchKernelEx(&cfg, f, args...));
}

int main(int argc, char** argv) {
    // argv[1]: the norms' outputs and sums; argv[2]: silu's outputs.
    FILE* out = argc > 1 ? fopen(argv[1], "wb") : nullptr;
    FILE* silu_out = argc > 2 ? fopen(argv[2], "wb") : nullptr;
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int d = 4096, inter = 14336, copies = 8;
    const int threads = 1024;  // ROW_THREADS, as the backend launches it
    printf("norm: %d threads a row\n", threads);
    for (int rows : {1, 8, 64, 256, 512}) {
        size_t n = (size_t)rows * d;
        std::vector<float*> xs(copies), ys(copies); std::vector<bf16*> os(copies);
        std::vector<float> h(n);
        float* w; CK(cudaMalloc(&w, d * 4));
        { std::vector<float> hw(d); for (auto& v : hw) v = 1.0f + (rbf() & 0xff) / 256.0f; CK(cudaMemcpy(w, hw.data(), d * 4, cudaMemcpyHostToDevice)); }
        for (int c = 0; c < copies; c++) {
            for (auto& v : h) { unsigned short u = rbf(); unsigned uu = (unsigned)u << 16; memcpy(&v, &uu, 4); }
            CK(cudaMalloc(&xs[c], n * 4)); CK(cudaMemcpy(xs[c], h.data(), n * 4, cudaMemcpyHostToDevice));
            for (auto& v : h) { unsigned short u = rbf(); unsigned uu = (unsigned)u << 16; memcpy(&v, &uu, 4); }
            CK(cudaMalloc(&ys[c], n * 4)); CK(cudaMemcpy(ys[c], h.data(), n * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(&os[c], n * 2));
        }
        // The first copy once, for the bit check (write_back on, as in a layer).
        launch(s, add_rms_norm, rows, threads, xs[0], (const float*)ys[0], (const u32*)nullptr, 1, (const float*)w, os[0], d, 1e-5f);
        CK(cudaStreamSynchronize(s));
        if (out) { std::vector<unsigned short> ho(n); CK(cudaMemcpy(ho.data(), os[0], n * 2, cudaMemcpyDeviceToHost)); fwrite(ho.data(), 2, n, out);
                   CK(cudaMemcpy(h.data(), xs[0], n * 4, cudaMemcpyDeviceToHost)); fwrite(h.data(), 4, n, out); }
        std::vector<float> ts;
        for (int r = 0; r < 15; r++) {
            cudaEventRecord(a, s);
            // write_back off: the inputs stay the same from round to round.
            for (int c = 0; c < 10; c++) launch(s, add_rms_norm, rows, threads, xs[c % copies], (const float*)ys[c % copies], (const u32*)nullptr, 0, (const float*)w, os[c % copies], d, 1e-5f);
            cudaEventRecord(b, s); cudaEventSynchronize(b);
            float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms / 10);
        }
        double ms = median_ms(ts), bytes = n * (4.0 + 4.0 + 2.0);
        printf("norm    %3d rows %7.2f us %6.0f GB/s\n", rows, ms * 1e3, bytes / ms / 1e6);
        for (int c = 0; c < copies; c++) { cudaFree(xs[c]); cudaFree(ys[c]); cudaFree(os[c]); }
        cudaFree(w);
    }
    for (int rows : {1, 8, 64, 256, 512}) {
        size_t n = (size_t)rows * inter;
        std::vector<float*> gs(copies); std::vector<bf16*> os(copies);
        std::vector<float> h(2 * n);
        for (int c = 0; c < copies; c++) {
            for (auto& v : h) { unsigned short u = rbf(); unsigned uu = (unsigned)u << 16; memcpy(&v, &uu, 4); }
            CK(cudaMalloc(&gs[c], 2 * n * 4)); CK(cudaMemcpy(gs[c], h.data(), 2 * n * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(&os[c], n * 2));
        }
        auto run = [&](int c) {
#ifndef SILU_ONE_A_THREAD
            launch(s, silu_mul4, (int)((n / 4 + 255) / 256), 256, (const float*)gs[c], os[c], inter, (long long)n);
#else
            launch(s, silu_mul, (int)((n + 255) / 256), 256, (const float*)gs[c], os[c], inter, (long long)n);
#endif
        };
        run(0); CK(cudaStreamSynchronize(s));
        if (silu_out) { std::vector<unsigned short> ho(n); CK(cudaMemcpy(ho.data(), os[0], n * 2, cudaMemcpyDeviceToHost)); fwrite(ho.data(), 2, n, silu_out); }
        std::vector<float> ts;
        for (int r = 0; r < 15; r++) {
            cudaEventRecord(a, s);
            for (int c = 0; c < 10; c++) run(c % copies);
            cudaEventRecord(b, s); cudaEventSynchronize(b);
            float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms / 10);
        }
        double ms = median_ms(ts), bytes = n * (8.0 + 2.0);
        printf("silu    %3d rows %7.2f us %6.0f GB/s\n", rows, ms * 1e3, bytes / ms / 1e6);
        for (int c = 0; c < copies; c++) { cudaFree(gs[c]); cudaFree(os[c]); }
    }
    CK(cudaGetLastError());
    if (out) fclose(out);
    if (silu_out) fclose(silu_out);
    return 0;
}
