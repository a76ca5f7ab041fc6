// The flash attention kernel alone, on the GPU machine, without the Rust build: times a variant
// of kernels/flash_attention.cu (FA_SRC, a path from this folder) on the 8B shape's attention
// (32 heads, 8 KV heads of 128) and writes its output, so that variants can be compared for
// speed and for bits (`run` does both). Random bf16 data, sequential KV blocks, the host's
// items and split choice (src/runtime/cuda/attention.rs) redone here; NOMERGE=1 leaves split
// mode's merge out of the timing.
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -DFA_SRC='"../../kernels/flash_attention.cu"' flash_bench.cu
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "bench_util.h"
#include "../../kernels/prelude.cuh"
#include FA_SRC
#define FA_ENTRY flash_attention_d128
// The partition of a key: the kernel's own numbering where it has one (older variants cut
// every FA_PART keys).
#ifdef FA_SMALL
#define BENCH_PART_OF(key) fa_part_of(key)
#else
#define BENCH_PART_OF(key) ((key) / FA_PART)
#endif
#define FA_ROWS_ITEM 64

int main(int argc, char** argv) {
    const char* which = argc > 1 ? argv[1] : "prefill4k";
    const char* dump = argc > 2 ? argv[2] : nullptr;
    const int heads = 32, kvh = 8, D = 128, group = heads / kvh;
    std::vector<std::pair<int,int>> picks;  // (ctx, n)
    if (!strcmp(which, "prefill4k")) picks = {{4096, 4096}};
    else if (!strcmp(which, "prefill16k")) picks = {{16384, 2048}};
    else if (!strcmp(which, "prefill8x512")) picks.assign(8, {512, 512});
    else if (!strcmp(which, "decode64x2k")) picks.assign(64, {2048, 1});
    else if (!strcmp(which, "decode16k")) picks = {{16384, 1}};
    else if (!strcmp(which, "decode576")) picks = {{576, 1}};
    else if (!strcmp(which, "verify64x2k")) picks.assign(64, {2048, 4});
    else if (!strcmp(which, "decode128x300")) picks.assign(128, {300, 1});
    else { printf("unknown %s\n", which); return 1; }
    int nseq = picks.size(), maxblocks = 0, tokens = 0, maxlen = 0, blocks = 0;
    for (auto& p : picks) { maxblocks = std::max(maxblocks, (p.first + 15) / 16); tokens += p.second; maxlen = std::max(maxlen, p.first); blocks += (p.first + 15) / 16; }
    maxblocks = (maxblocks + 3) / 4 * 4;
    std::vector<u32> tables(nseq * maxblocks, 0), positions, items;
    int next = 0, t0 = 0;
    for (int s = 0; s < nseq; s++) {
        int nb = (picks[s].first + 15) / 16;
        for (int b = 0; b < nb; b++) tables[s * maxblocks + b] = next++;
        int n = picks[s].second, ctx = picks[s].first;
        for (int i = 0; i < n; i++) positions.push_back(ctx - n + i);
        int rows = n * group;
        for (int r0 = 0; r0 < rows; r0 += FA_ROWS_ITEM) { items.push_back(s); items.push_back(t0); items.push_back(r0); items.push_back(rows); }
        t0 += n;
    }
    size_t kvn = (size_t)blocks * 16 * kvh * D, qn = (size_t)tokens * heads * D;
    std::vector<unsigned short> hk(kvn), hv(kvn), hq(qn);
    for (auto& x : hk) x = rbf(); for (auto& x : hv) x = rbf(); for (auto& x : hq) x = rbf();
    // Split mode's record bases: each token's partitions numbered after those of the tokens
    // before it (attention.rs's part_bases).
    std::vector<u32> bases;
    u32 total_parts = 0;
    for (u32 p : positions) { bases.push_back(total_parts); total_parts += BENCH_PART_OF((int)p) + 1; }
    bf16 *k, *v, *q, *o; u32 *tab, *pos, *it, *bas; float* part;
    CK(cudaMalloc(&k, kvn * 2)); CK(cudaMalloc(&v, kvn * 2)); CK(cudaMalloc(&q, qn * 2)); CK(cudaMalloc(&o, qn * 2));
    CK(cudaMalloc(&tab, tables.size() * 4)); CK(cudaMalloc(&pos, positions.size() * 4)); CK(cudaMalloc(&it, items.size() * 4));
    CK(cudaMalloc(&bas, bases.size() * 4));
    CK(cudaMemcpy(bas, bases.data(), bases.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(k, hk.data(), kvn * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(v, hv.data(), kvn * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(q, hq.data(), qn * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(tab, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(pos, positions.data(), positions.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(it, items.data(), items.size() * 4, cudaMemcpyHostToDevice));
    int count = items.size() / 4, parts = BENCH_PART_OF(maxlen - 1) + 1;
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    bool split = parts > 1 && count * kvh < 4 * sms;
    // Every token's partitions (the backend's split rule would refuse what its scratch cannot hold).
    CK(cudaMalloc(&part, std::max<size_t>((size_t)total_parts * heads * (D + 2) * 4, 4)));
    int smem = 4 * 64 * (D + 8) * 2 + (split ? 0 : FA_WARPS * 16 * (D + 8) * 4);
    CK(cudaFuncSetAttribute(FA_ENTRY, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    float scale = 1.0f / sqrtf((float)D) * 1.4426950408889634f;
    auto run = [&]() {
        dim3 grid(count, kvh, split ? parts : 1);
        FA_ENTRY<<<grid, FA_THREADS, smem>>>(q, o, k, v, it, pos, tab, maxblocks, heads, kvh, scale, split ? part : nullptr, split ? bas : nullptr);
        if (split && !getenv("NOMERGE")) flash_merge<<<dim3(tokens, heads), D>>>(part, pos, bas, o, heads, D);
    };
    run(); CK(cudaDeviceSynchronize());
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    std::vector<float> ts;
    for (int r = 0; r < 15; r++) {
        cudaEventRecord(a); for (int c = 0; c < 10; c++) run(); cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms / 10);
    }
    CK(cudaGetLastError());
    std::sort(ts.begin(), ts.end());
    float ms = ts[ts.size() / 2];
    double pairs = 0; for (auto& p : picks) for (int x = p.first - p.second; x < p.first; x++) pairs += x + 1;
    double tf = 4.0 * pairs * heads * D / ms / 1e9;
    double gbs = 0; for (auto& p : picks) gbs += (double)p.first * kvh * D * 4; gbs /= ms * 1e6;
    cudaFuncAttributes fa; cudaFuncGetAttributes(&fa, FA_ENTRY);
    printf("%-14s %-8s regs %3d smem %6d  %8.4f ms  %6.0f TF/s  %6.0f GB/s\n", which, split ? "split" : "whole", fa.numRegs, smem, ms, tf, gbs);
    if (dump) { std::vector<unsigned short> ho(qn); CK(cudaMemcpy(ho.data(), o, qn * 2, cudaMemcpyDeviceToHost)); FILE* f = fopen(dump, "wb"); fwrite(ho.data(), 2, qn, f); fclose(f); }
    return 0;
}
