// SiLU(gate) * up, from the stacked [gate | up] projection (f32) to the down projection's
// bf16 input.
extern "C" __global__ void silu_mul(const float* gate_up, bf16* out, int inter) {
    const float* g = gate_up + (size_t)blockIdx.x * 2 * inter;
    const float* u = g + inter;
    bf16* o = out + (size_t)blockIdx.x * inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        float x = g[i];
        o[i] = f32_to_bf16(x / (1.0f + expf(-x)) * u[i]);
    }
}
