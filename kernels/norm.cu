// RMSNorm fused with the residual add, one block per output row.
//   residual: x[row] += y[row] first (y may be null: the first layer has no branch yet);
//   rows: output row r reads input row rows[r] (null: the identity), so the last norm runs only
//   on the rows whose logits are wanted;
//   write_back: whether x keeps the sum (the last norm reads it and leaves x alone).
// A row is read once, in 16-byte pieces a thread holds in registers from the sum of squares to
// the scaled write (at most NORM_PIECES a thread: rows up to 16,384 wide in a block of 1,024);
// a wider row, or one of a width not a multiple of 4, is read twice, a value at a time. Either
// way a row's sum runs in an order set by its width and the block alone, never by the batch.
// The host launches blocks of 1,024 threads (ROW_THREADS): the bound keeps a thread's registers
// within what such a block may take.
extern "C" __global__ void __launch_bounds__(1024)
    add_rms_norm(float* x, const float* y, const u32* rows, int write_back, const float* weight, bf16* out, int d,
                 float eps) {
    int pieces = d >> 2;
    bool fast = (d & 3) == 0 && pieces <= NORM_PIECES * (int)blockDim.x;
    // Rows to read (uploads), the weight, and the stream where a branch is added (its last
    // writer, the norm before, ran two or more kernels back: only norms write x, and a product
    // lies between any two) are no output of the kernel just before. They are asked for before
    // the wait for it, so that neither x (gone from L2 after a layer's weights) nor the weight
    // is a round trip from memory on the step's critical path; only the branch (y, that
    // kernel's output) is read after it. Without a branch, x is the embedding's output, just
    // written, and waits like y.
    size_t in_row = rows ? rows[blockIdx.x] : blockIdx.x;
    float* xr = x + in_row * d;
    const float* yr = y ? y + in_row * d : 0;
    bf16* o = out + (size_t)blockIdx.x * d;
    float4 v[NORM_PIECES], w[NORM_PIECES];
    if (fast) {
#pragma unroll
        for (int j = 0; j < NORM_PIECES; j++) {
            int c = threadIdx.x + j * blockDim.x;
            if (c >= pieces) continue;
            w[j] = reinterpret_cast<const float4*>(weight)[c];
            if (yr) v[j] = reinterpret_cast<const float4*>(xr)[c];
        }
    }
    after_previous_kernel();
    float ss = 0.0f;
    if (fast) {
#pragma unroll
        for (int j = 0; j < NORM_PIECES; j++) {
            int c = threadIdx.x + j * blockDim.x;
            if (c >= pieces) continue;
            float4 a = yr ? v[j] : reinterpret_cast<const float4*>(xr)[c];
            if (yr) {
                float4 b = reinterpret_cast<const float4*>(yr)[c];
                a.x += b.x;
                a.y += b.y;
                a.z += b.z;
                a.w += b.w;
                if (write_back) reinterpret_cast<float4*>(xr)[c] = a;
            }
            v[j] = a;
            ss = add_squares(ss, a);
        }
        float scale = rsqrtf(block_sum(ss) / (float)d + eps);
#pragma unroll
        for (int j = 0; j < NORM_PIECES; j++) {
            int c = threadIdx.x + j * blockDim.x;
            if (c >= pieces) continue;
            reinterpret_cast<uint2*>(o)[c] = norm_piece(v[j], scale, w[j]);
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
