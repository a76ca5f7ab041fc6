// RMSNorm fused with the residual add, one block per output row.
//   residual: x[row] += y[row] first (y may be null: the first layer has no branch yet);
//   rows: output row r reads input row rows[r] (null: the identity), so the last norm runs only
//   on the rows whose logits are wanted;
//   write_back: whether x keeps the sum (the last norm reads it and leaves x alone).
extern "C" __global__ void add_rms_norm(float* x, const float* y, const u32* rows, int write_back,
                                        const float* weight, bf16* out, int d, float eps) {
    after_previous_kernel();
    size_t in_row = rows ? rows[blockIdx.x] : blockIdx.x;
    float* xr = x + in_row * d;
    const float* yr = y ? y + in_row * d : 0;
    bf16* o = out + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = xr[i];
        if (yr) {
            v += yr[i];
            if (write_back) xr[i] = v;
        }
        ss += v * v;
    }
    float scale = rsqrtf(block_sum(ss) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = yr ? xr[i] + (write_back ? 0.0f : yr[i]) : xr[i];
        o[i] = f32_to_bf16(v * scale * weight[i]);
    }
}
