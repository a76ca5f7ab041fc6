// Rotary embedding of the q and k heads of each token's row (v is left alone), from tables of
// cos and sin per (position, pair) built on the host exactly as the CPU backend builds them.
// halves = 0: adjacent pairs (2j, 2j+1), GGUF llama; halves = 1: (j, j + half), qwen2 and HF llama.
extern "C" __global__ void rope(float* qkv, const u32* positions, const float* cos_t, const float* sin_t,
                                int width, int heads, int head_dim, int halves) {
    int half = head_dim / 2;
    size_t p = positions[blockIdx.x];
    const float* c = cos_t + p * half;
    const float* s = sin_t + p * half;
    float* row = qkv + (size_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
        int h = i / half, j = i % half;
        float* head = row + h * head_dim;
        int a = halves ? j : 2 * j;
        int b = halves ? j + half : 2 * j + 1;
        float x0 = head[a], x1 = head[b];
        head[a] = x0 * c[j] - x1 * s[j];
        head[b] = x0 * s[j] + x1 * c[j];
    }
}

// Adds a bias row to every row of x (qwen2's q/k/v projections have biases).
extern "C" __global__ void add_bias(float* x, const float* bias, int width) {
    float* row = x + (size_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) row[i] += bias[i];
}
