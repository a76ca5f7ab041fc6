// The batch-invariant product on wgmma alone, on the GPU machine, without the Rust build: times
// a variant of kernels/gemv.cu (GEMV_SRC, a path from this folder) against cuBLAS on the 8B
// shape's projections at 256 and 2048 rows, in both wgmma tiles, and writes each product for
// bit checks (the first variant's bits are the reference: gemm-run compares them).
//   nvcc -O3 -arch=sm_90a -std=c++17 -DGEMV_SRC='"../../kernels/gemv.cu"' gemm_bench.cu -lcublas
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include "bench_util.h"
#include "../../kernels/prelude.cuh"
#include GEMV_SRC

static float median_ms(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main(int argc, char** argv) {
    const char* dump = argc > 1 ? argv[1] : nullptr;
    FILE* out = dump ? fopen(dump, "wb") : nullptr;
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    cublasHandle_t h; cublasCreate(&h);
    struct Shape { const char* name; int n, k; } shapes[] = {
        {"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 28672, 4096}, {"down", 4096, 14336}};
    // _p: x put in the mma's order first by permute_k32 (timed with the product).
    struct Tile { const char* name; void (*f)(const bf16*, const bf16*, float*, int, int, int, int); int rows, smem; bool permuted; } tiles[] = {
        {"wgmma", gemm_wgmma, 64, 4 * 192 * 128, false}, {"wgmma_wide", gemm_wgmma_wide, 128, 6 * 256 * 128, false},
        {"wgmma_p", gemm_wgmma_p, 64, 4 * 192 * 128, true}, {"wgmma_wide_p", gemm_wgmma_wide_p, 128, 6 * 256 * 128, true}};
    for (auto& t : tiles) CK(cudaFuncSetAttribute(t.f, cudaFuncAttributeMaxDynamicSharedMemorySize, t.smem));
    for (auto& s : shapes) {
        for (int rows : {256, 2048}) {
            std::vector<unsigned short> hx((size_t)rows * s.k), hw((size_t)s.n * s.k);
            rng = 3; for (auto& v : hx) v = rbf();
            for (auto& v : hw) v = rbf();
            bf16 *x, *xp, *w; float* y;
            CK(cudaMalloc(&xp, hx.size() * 2));
            CK(cudaMalloc(&x, hx.size() * 2)); CK(cudaMalloc(&w, hw.size() * 2)); CK(cudaMalloc(&y, (size_t)rows * s.n * 4));
            CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(w, hw.data(), hw.size() * 2, cudaMemcpyHostToDevice));
            double flops = 2.0 * rows * s.n * (double)s.k;
            auto time = [&](auto run) {
                for (int i = 0; i < 3; i++) run();
                std::vector<float> ts;
                for (int i = 0; i < 15; i++) {
                    cudaEventRecord(a); run(); cudaEventRecord(b); cudaEventSynchronize(b);
                    float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms);
                }
                CK(cudaGetLastError());
                return median_ms(ts);
            };
            float one = 1.0f, zero = 0.0f;
            float ms = time([&] {
                cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.n, rows, s.k, &one, w, CUDA_R_16BF, s.k, x, CUDA_R_16BF, s.k,
                             &zero, y, CUDA_R_32F, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            });
            printf("%-8s %5d rows  cublas      %8.4f ms %5.0f TF/s\n", s.name, rows, ms, flops / ms / 1e9);
            std::vector<float> first;
            for (auto& t : tiles) {
                dim3 grid((rows + t.rows - 1) / t.rows, (s.n + 127) / 128);
                CK(cudaMemset(y, 0, (size_t)rows * s.n * 4));
                int pieces = (int)(hx.size() / 8);
                ms = time([&] {
                    if (t.permuted) permute_k32<<<(pieces + 255) / 256, 256>>>(x, xp, rows, s.k);
                    t.f<<<grid, 256, t.smem>>>(t.permuted ? xp : x, w, y, rows, s.n, s.k, 16);
                });
                std::vector<float> hy((size_t)rows * s.n);
                CK(cudaMemcpy(hy.data(), y, hy.size() * 4, cudaMemcpyDeviceToHost));
                // Every tile must give the first tile's bits.
                const char* same = first.empty() ? "" : memcmp(first.data(), hy.data(), hy.size() * 4) ? "  OTHER BITS" : "  same bits";
                printf("%-8s %5d rows  %-11s %8.4f ms %5.0f TF/s%s\n", s.name, rows, t.name, ms, flops / ms / 1e9, same);
                if (first.empty()) first = hy;
                if (out) fwrite(hy.data(), 4, hy.size(), out);
            }
            cudaFree(x); cudaFree(xp); cudaFree(w); cudaFree(y);
        }
    }
    if (out) fclose(out);
}
