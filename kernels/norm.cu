// RMSNorm fused with the residual add, one block per output row.
//   residual: x[row] += y[row] first (y may be null: the first layer has no branch yet);
//   rows: output row r reads input row rows[r] (null: the identity), so the last norm runs only
//   on the rows whose logits are wanted;
//   write_back: whether x keeps the sum (the last norm reads it and leaves x alone).
// A row is read once, in 16-byte pieces a thread holds in registers from the sum of squares to
// the scaled write (at most NORM_PIECES a thread: rows up to 16,384 wide in a block of 1,024);
// a wider row, or one of a width not a multiple of 4, is read twice, a value at a time. Either
// way a row's sum runs in an order set by its width and the block alone, never by the batch.
#define NORM_PIECES 4
extern "C" __global__ void add_rms_norm(float* x, const float* y, const u32* rows, int write_back,
                                        const float* weight, bf16* out, int d, float eps) {
    after_previous_kernel();
    size_t in_row = rows ? rows[blockIdx.x] : blockIdx.x;
    float* xr = x + in_row * d;
    const float* yr = y ? y + in_row * d : 0;
    bf16* o = out + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    int pieces = d >> 2;
    if ((d & 3) == 0 && pieces <= NORM_PIECES * (int)blockDim.x) {
        float4 v[NORM_PIECES];
#pragma unroll
        for (int j = 0; j < NORM_PIECES; j++) {
            int c = threadIdx.x + j * blockDim.x;
            if (c >= pieces) continue;
            float4 a = reinterpret_cast<const float4*>(xr)[c];
            if (yr) {
                float4 b = reinterpret_cast<const float4*>(yr)[c];
                a.x += b.x;
                a.y += b.y;
                a.z += b.z;
                a.w += b.w;
                if (write_back) reinterpret_cast<float4*>(xr)[c] = a;
            }
            v[j] = a;
            ss += a.x * a.x;
            ss += a.y * a.y;
            ss += a.z * a.z;
            ss += a.w * a.w;
        }
        float scale = rsqrtf(block_sum(ss) / (float)d + eps);
#pragma unroll
        for (int j = 0; j < NORM_PIECES; j++) {
            int c = threadIdx.x + j * blockDim.x;
            if (c >= pieces) continue;
            float4 w = reinterpret_cast<const float4*>(weight)[c];
            uint2 packed;
            packed.x = (u32)f32_to_bf16(v[j].x * scale * w.x) | ((u32)f32_to_bf16(v[j].y * scale * w.y) << 16);
            packed.y = (u32)f32_to_bf16(v[j].z * scale * w.z) | ((u32)f32_to_bf16(v[j].w * scale * w.w) << 16);
            reinterpret_cast<uint2*>(o)[c] = packed;
        }
        return;
    }
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
