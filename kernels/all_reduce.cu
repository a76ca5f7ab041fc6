// One-shot all-reduce through peer memory (src/runtime/cuda/peer_reduce.rs), for messages small
// enough that NCCL's launch and protocol cost more than the bytes: one token's hidden state is
// 16 KiB. Every rank's kernel reads every rank's input over NVLink and sums it in rank order, so
// every rank gets the same bits, and a row's sum does not depend on the message's size (nor on
// which rows ride with it). Barriers through arrival words in each rank's memory: before the
// reads (every rank's input is written: its kernels before this one are done) and, where the
// caller asks (`guard`), after them, so that no rank overwrites its input while another still
// reads it. A caller that alternates between two inputs needs no second barrier: a rank that
// writes the input of call k again (at call k + 2) has passed call k + 1's first barrier, which
// every rank reaches only after its reads of call k.
#define AR_MAX_RANKS 8
#define AR_MAX_BLOCKS 64

struct PeerPtrs {
    const float* in[AR_MAX_RANKS];
    // Each rank's arrival words, [AR_MAX_BLOCKS][AR_MAX_RANKS]: block b of rank r writes word
    // (b, r) of every rank's array.
    u32* arrivals[AR_MAX_RANKS];
};

// Block b tells every rank it has reached barrier `value`, then waits until block b of every
// rank has told it the same. Values only grow (wrap-safe compare), so a rank already past the
// next barrier also counts as arrived. A rank that never comes traps after seconds: the
// context reports an error instead of hanging. Each block counts its calls in `epochs`, in its
// rank's memory, so that a call replayed from a CUDA graph takes the next barrier values (an
// argument would be frozen at capture); every rank makes the same calls, so the counts agree.
__device__ void peer_barrier(const PeerPtrs& p, int rank, int ranks, u32 value) {
    __syncthreads();
    if ((int)threadIdx.x < ranks) {
        u32* there = p.arrivals[threadIdx.x] + blockIdx.x * AR_MAX_RANKS + rank;
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(there), "r"(value) : "memory");
        const u32* here = p.arrivals[rank] + blockIdx.x * AR_MAX_RANKS + threadIdx.x;
        u32 seen;
        long long spins = 0;
        do {
            asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(seen) : "l"(here) : "memory");
            if (++spins > (1ll << 26)) __trap();
        } while ((int)(seen - value) < 0);
    }
    __syncthreads();
}

// Loads that skip L1 (the same addresses held the last call's values).
__device__ __forceinline__ float4 load_cg4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float load_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

// A value as bf16 would carry it (round to nearest even), for `bf16` below.
__device__ __forceinline__ float as_bf16(float v) {
    return bf16_to_f32(f32_to_bf16(v));
}

// out = the sum over ranks of in[r] + offset, n floats (16-byte aligned buffers), in rank order.
// bf16: every rank's input is rounded to bf16 before the sum, as if the ranks sent bf16 (a
// measurement of what that would cost in accuracy: QUARRY_TP_REDUCE=bf16).
extern "C" __global__ void peer_all_reduce(PeerPtrs p, long long offset, float* out, int n, int rank, int ranks,
                                           u32* epochs, int guard, int bf16) {
    after_previous_kernel();
    // Every thread reads the count before thread 0 moves it on, after the last barrier.
    u32 epoch = epochs[blockIdx.x] + 1;
    peer_barrier(p, rank, ranks, 2 * epoch);
    for (int r = 0; r < ranks; r++) p.in[r] += offset;
    int stride = gridDim.x * blockDim.x;
    int n4 = n >> 2;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        float4 s = load_cg4(p.in[0] + 4 * i);
        if (bf16) s = make_float4(as_bf16(s.x), as_bf16(s.y), as_bf16(s.z), as_bf16(s.w));
        for (int r = 1; r < ranks; r++) {
            float4 v = load_cg4(p.in[r] + 4 * i);
            if (bf16) v = make_float4(as_bf16(v.x), as_bf16(v.y), as_bf16(v.z), as_bf16(v.w));
            s.x += v.x;
            s.y += v.y;
            s.z += v.z;
            s.w += v.w;
        }
        reinterpret_cast<float4*>(out)[i] = s;
    }
    for (int i = 4 * n4 + blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float s = load_cg(p.in[0] + i);
        if (bf16) s = as_bf16(s);
        for (int r = 1; r < ranks; r++) {
            float v = load_cg(p.in[r] + i);
            s += bf16 ? as_bf16(v) : v;
        }
        out[i] = s;
    }
    if (guard) peer_barrier(p, rank, ranks, 2 * epoch + 1);
    if (threadIdx.x == 0) epochs[blockIdx.x] = epoch;
}
