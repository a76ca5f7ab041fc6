// The residual stream starts as the embedding rows of the batch's tokens. One block per token.
extern "C" __global__ void embedding(const u32* ids, const bf16* table, float* out, int d) {
    after_previous_kernel();
    const bf16* row = table + (size_t)ids[blockIdx.x] * d;
    float* o = out + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = bf16_to_f32(row[i]);
}

// A pipelined step's tokens that the draws before it decided on the device: ids[at[i]] =
// drawn[word[i]], before the embedding reads them.
extern "C" __global__ void take_drawn_tokens(u32* ids, const u32* at, const u32* word, const u32* drawn, int count) {
    after_previous_kernel();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) ids[at[i]] = drawn[word[i]];
}
