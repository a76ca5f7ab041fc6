// What the stand-alone kernel benchmarks here share: a CUDA call that exits on error, and
// random bf16 values in [-1, 1) from a seeded generator (`rng` is the seed; 1 unless set).
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)

static unsigned long long rng = 1;
static unsigned short rbf() {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    float f = ((rng >> 40) / (float)(1 << 24)) * 2.0f - 1.0f;
    unsigned u; memcpy(&u, &f, 4); return (unsigned short)(u >> 16);
}
