// Adds a bias row to every row of x (qwen2's q/k/v projections have biases).
extern "C" __global__ void add_bias(float* x, const float* bias, int width) {
    after_previous_kernel();
    float* row = x + (size_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) row[i] += bias[i];
}
