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
