// SiLU(gate) * up, from the stacked [gate | up] projection (f32) to the down projection's
// bf16 input. One thread per output element over the whole batch: a few rows of 14,336 would
// otherwise leave all but a few SMs idle.
extern "C" __global__ void silu_mul(const float* gate_up, bf16* out, int inter, long long total) {
    after_previous_kernel();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= total) return;
    long long row = idx / inter;
    int i = (int)(idx - row * inter);
    const float* g = gate_up + row * 2 * inter;
    out[idx] = f32_to_bf16(silu_times(g[i], g[inter + i]));
}

// silu_mul four elements a thread, for widths that are a multiple of 4: the same values, with
// 16-byte reads and an 8-byte write.
extern "C" __global__ void silu_mul4(const float* gate_up, bf16* out, int inter, long long total) {
    after_previous_kernel();
    long long idx = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (idx >= total) return;
    long long row = idx / inter;
    int i = (int)(idx - row * inter);
    const float* g = gate_up + row * 2 * inter;
    float4 a = *reinterpret_cast<const float4*>(g + i);
    float4 b = *reinterpret_cast<const float4*>(g + inter + i);
    uint2 packed;
    packed.x = (u32)f32_to_bf16(silu_times(a.x, b.x)) | ((u32)f32_to_bf16(silu_times(a.y, b.y)) << 16);
    packed.y = (u32)f32_to_bf16(silu_times(a.z, b.z)) | ((u32)f32_to_bf16(silu_times(a.w, b.w)) << 16);
    *reinterpret_cast<uint2*>(out + idx) = packed;
}
