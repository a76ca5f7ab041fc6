//! Matrix products: bf16 operands, f32 accumulation, row-major activations times a row-major
//! `[out, in]` weight (the layout of checkpoints), as `y = x W^T`. Up to 8 rows, the product is
//! bound by reading the weights once and kernels/gemv.cu computes it (`gemv_mma` on the tensor
//! cores where k is a multiple of 32, else `gemv_bf16`), with one order of summation over k
//! whatever the number of rows; cuBLASLt takes larger batches, with its algorithm chosen once per
//! shape (`test-quarry kernel_speeds --ignored`, scripts/bench-gpu, compares them). Batch-
//! invariant (`--batch-invariant`), larger batches take `gemm_mma` instead (on Hopper its wgmma
//! form), which sums over k in the GEMV's order, so that a row's product has the same bits in a
//! batch of any size.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    cublasComputeType_t, cublasLtHandle_t, cublasLtMatmulAlgo_t, cublasLtMatmulDescAttributes_t, cublasLtMatmulDesc_t,
    cublasLtMatmulPreferenceAttributes_t, cublasLtMatrixLayout_t, cudaDataType,
};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr};

use super::kernels::Kernels;
use crate::runtime::error::{Result, RuntimeError};

pub struct Gemm {
    handle: cublasLtHandle_t,
    stream: Arc<CudaStream>,
    gemv: CudaFunction,
    gemv_mma: CudaFunction,
    gemv_mma_two_groups: CudaFunction,
    gemv_mma_three_groups: CudaFunction,
    /// The same three forms adding their product into y.
    gemv_mma_add: [CudaFunction; 3],
    gemv_mma_silu: CudaFunction,
    gemv_mma_rope: CudaFunction,
    gemv_mma_rope_three: CudaFunction,
    /// The rope forms that make x as the stream's norm: one group a block, three.
    gemv_mma_rope_norm: [CudaFunction; 2],
    /// The batch-invariant products' kernels, one per `GemmTile`, and the wgmma tiles' forms
    /// that read x permuted (`permute_k32`, into `scratch`).
    tiles: [CudaFunction; 4],
    tiles_permuted: [CudaFunction; 4],
    permute: CudaFunction,
    /// x in the mma's order of k, for products of up to its length in elements (else the wgmma
    /// tiles order x as they copy it, 4 bytes at a time), and its address (taken once: cudarc's
    /// per-use event tracking costs more than a small product).
    scratch: Option<(CudaSlice<u16>, u64)>,
    /// Whether the wgmma tiles run here.
    wgmma: bool,
    /// The device's SMs, which `gemm_mma`'s choice of tile fills.
    sms: usize,
    /// Products of more than `GEMV_MAX_ROWS` rows sum in the GEMV's order (`gemm_mma`) instead
    /// of cuBLAS's.
    invariant: bool,
    /// cuBLAS's scratch space: Hopper kernels want one (NVIDIA suggests 32 MiB), and without
    /// it cuBLAS may choose slower ones.
    workspace: CudaSlice<u8>,
    /// cuBLASLt's algorithm for each shape met so far, asked for once: the heuristic query costs
    /// more than a small product, and a shape then always runs the same kernel.
    plans: Mutex<HashMap<Shape, Arc<Plan>>>,
}

// SAFETY: the cuBLASLt handle is used only through `&self` methods that queue work on the one
// stream; cuBLASLt handles may be used from any thread, one call at a time (the plans' lock
// orders the queries, the stream orders the products).
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

/// A product's shape and the alignment of its three pointers (cuBLASLt picks kernels that
/// assume as much alignment as it is told).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Shape {
    rows: usize,
    n: usize,
    k: usize,
    align: [u32; 3],
}

/// The descriptors and chosen algorithm for one `Shape`.
struct Plan {
    desc: cublasLtMatmulDesc_t,
    /// The weight, x and y layouts.
    layouts: [cublasLtMatrixLayout_t; 3],
    algo: cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are plain host objects, read-only once built.
unsafe impl Send for Plan {}
unsafe impl Sync for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: built by `Plan::new`, dropped once.
        unsafe {
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

const WORKSPACE_BYTES: usize = 32 << 20;

/// cublasOperation_t's CUBLAS_OP_T (cudarc's cuBLASLt bindings leave the enum out).
const CUBLAS_OP_T: i32 = 1;

/// The largest power of two (up to 256) dividing a device address.
fn alignment(ptr: u64) -> u32 {
    1u32 << ptr.trailing_zeros().min(8)
}

fn lt_err<'a>(what: &'a str, shape: &'a Shape) -> impl Fn(lt::CublasError) -> RuntimeError + 'a {
    move |e| {
        RuntimeError::Backend(format!(
            "cuBLASLt {what} for [{}x{}] x [{}x{}]^T: {e}",
            shape.rows, shape.k, shape.n, shape.k
        ))
    }
}

impl Plan {
    fn new(handle: cublasLtHandle_t, shape: &Shape, workspace: usize) -> Result<Plan> {
        let (rows, n, k) = (shape.rows as u64, shape.n as u64, shape.k as u64);
        let desc = lt::create_matmul_desc(cublasComputeType_t::CUBLAS_COMPUTE_32F, cudaDataType::CUDA_R_32F)
            .map_err(lt_err("descriptor", shape))?;
        // cuBLAS is column-major: row-major y[rows, n] is its [n, rows], the product of the
        // weight (row-major [n, k], which it reads as [k, n], hence transposed) and x (row-major
        // [rows, k], which it reads as [k, rows], as is).
        let layouts = [
            lt::create_matrix_layout(cudaDataType::CUDA_R_16BF, k, n, k as i64),
            lt::create_matrix_layout(cudaDataType::CUDA_R_16BF, k, rows, k as i64),
            lt::create_matrix_layout(cudaDataType::CUDA_R_32F, n, rows, n as i64),
        ];
        let mut made = Vec::with_capacity(3);
        for l in layouts {
            made.push(l.map_err(lt_err("layout", shape))?);
        }
        let mut plan = Plan {
            desc,
            layouts: [made[0], made[1], made[2]],
            algo: unsafe { std::mem::zeroed() },
        };
        let transpose = CUBLAS_OP_T;
        let pref = lt::create_matmul_pref().map_err(lt_err("preference", shape))?;
        let ws = workspace as u64;
        use cublasLtMatmulPreferenceAttributes_t as P;
        // The workspace size is a uint64 attribute, the alignments uint32 ones.
        let aligns = [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, shape.align[0]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, shape.align[1]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, shape.align[2]),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, shape.align[2]),
        ];
        // SAFETY: each descriptor was just created; the attribute buffers are of the types and
        // sizes cuBLASLt documents (an int32 operation, uint64 sizes and alignments).
        let heuristic = unsafe {
            let set = lt::set_matmul_desc_attribute(
                plan.desc,
                cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &transpose as *const _ as *const c_void,
                std::mem::size_of::<i32>(),
            )
            .and_then(|_| {
                let ws = &ws as *const u64 as *const c_void;
                lt::set_matmul_pref_attribute(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws, 8)
            })
            .and_then(|_| {
                aligns
                    .iter()
                    .try_for_each(|(a, v)| lt::set_matmul_pref_attribute(pref, *a, v as *const u32 as *const c_void, 4))
            });
            let found = set.and_then(|_| {
                lt::get_matmul_algo_heuristic(
                    handle,
                    plan.desc,
                    plan.layouts[0],
                    plan.layouts[1],
                    plan.layouts[2],
                    plan.layouts[2],
                    pref,
                )
            });
            let _ = lt::destroy_matmul_pref(pref);
            found.map_err(lt_err("algorithm", shape))?
        };
        // (Not `Plan { algo, ..plan }`: that copies the descriptors out of a plan whose drop
        // then destroys them.)
        plan.algo = heuristic.algo;
        Ok(plan)
    }
}

/// kernels/gemv.cu's GEMV_MAX_ROWS.
pub const GEMV_MAX_ROWS: usize = 8;

/// Weights up to this many elements take the CUDA-core GEMV kernel at `GEMV_MAX_ROWS` rows or
/// fewer (from 8 MB of weights on, cuBLAS read them faster on the H100).
const GEMV_MAX_WEIGHTS: usize = 4 << 20;

/// Warps (output columns) per block of the CUDA-core GEMV kernel.
const GEMV_WARPS: usize = 8;

/// kernels/gemv.cu's GEMV_MMA_COLS.
const GEMV_MMA_COLS: usize = 16;

/// Warps per block of the tensor-core GEMV. With four k-blocks of loads in flight a warp, 16
/// warps read the 8B shape's weights faster than 8 warps with eight (scripts/flash-bench/gemv-run
/// on an H200, 1 row: q|k|v 77% -> 80% of the copy bandwidth, o 75% -> 77%, down 96% -> 97%,
/// gate|up 95% -> 96%); sixteen k-blocks in flight lose (57-68%).
const GEMV_MMA_WARPS: usize = 16;

/// kernels/gemv.cu's GEMM_COLS and GW_COLS: the columns (rows of w) of a batch-invariant block.
const GEMM_COLS: usize = 128;

/// The blocks of the batch-invariant product (kernels/gemv.cu). Every tile gives the same bits;
/// they differ in speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmTile {
    /// `gemm_mma`: 128 columns x 64 rows, four stages, mma.sync.
    Narrow,
    /// `gemm_mma_wide`: 128 x 128, five stages.
    Wide,
    /// `gemm_wgmma` (Hopper): 128 x 64, two warpgroups, four stages.
    Wgmma,
    /// `gemm_wgmma_wide` (Hopper): 128 x 128, six stages.
    WgmmaWide,
}

impl GemmTile {
    /// Rows of x a block takes.
    const fn rows(self) -> usize {
        match self {
            GemmTile::Narrow | GemmTile::Wgmma => 64,
            GemmTile::Wide | GemmTile::WgmmaWide => 128,
        }
    }

    const fn threads(self) -> u32 {
        match self {
            GemmTile::Narrow | GemmTile::Wide => 2 * self.rows() as u32,
            GemmTile::Wgmma | GemmTile::WgmmaWide => 256,
        }
    }

    /// Shared memory of a block: its stages of (128 + rows) rows of 64 k.
    const fn smem(self) -> u32 {
        let stage = (GEMM_COLS + self.rows()) * 64 * 2;
        (match self {
            GemmTile::Narrow | GemmTile::Wgmma => 4 * stage,
            GemmTile::Wide => 5 * stage,
            GemmTile::WgmmaWide => 6 * stage,
        }) as u32
    }

    /// The tile's kernel; `permuted`: the wgmma form that reads x as `permute_k32` leaves it.
    fn function(self, k: &Kernels, permuted: bool) -> &CudaFunction {
        match (self, permuted) {
            (GemmTile::Narrow, _) => &k.gemm_mma,
            (GemmTile::Wide, _) => &k.gemm_mma_wide,
            (GemmTile::Wgmma, false) => &k.gemm_wgmma,
            (GemmTile::Wgmma, true) => &k.gemm_wgmma_p,
            (GemmTile::WgmmaWide, false) => &k.gemm_wgmma_wide,
            (GemmTile::WgmmaWide, true) => &k.gemm_wgmma_wide_p,
        }
    }

    /// Whether the tile can read x permuted ahead (the wgmma tiles).
    pub const fn permutes(self) -> bool {
        matches!(self, GemmTile::Wgmma | GemmTile::WgmmaWide)
    }

    /// The tiles the device runs: the wgmma ones only where the kernels have wgmma.
    pub fn available(k: &Kernels) -> &'static [GemmTile] {
        match k.wgmma {
            true => &[GemmTile::Narrow, GemmTile::Wide, GemmTile::Wgmma, GemmTile::WgmmaWide],
            false => &[GemmTile::Narrow, GemmTile::Wide],
        }
    }
}

/// The residual stream's RMS norm that the q|k|v product makes as its x (kernels/gemv.cu's
/// `StreamNorm`, add_rms_norm's bits): device addresses of the stream (f32, rows x d) and the
/// norm's weight.
pub struct StreamNorm {
    pub stream: u64,
    pub weight: u64,
    pub eps: f32,
}

/// The shared memory the rope forms may take for x made from the stream: 8 rows of up to 8,166.
const FUSED_NORM_SMEM: usize = 160 << 10;

/// x's bytes in shared memory (rows padded by 64 bytes, kernels/gemv.cu's GEMV_X_PAD), then
/// the norm's weight (f32).
fn norm_smem(rows: usize, d: usize) -> usize {
    rows * (d + 32) * 2 + d * 4
}

/// Lets the batch-invariant products take the shared memory they need (over the 48 KB default),
/// and the rope forms theirs for x made from the stream.
pub fn prepare(k: &Kernels) -> Result<()> {
    for f in [&k.gemv_mma_rope_norm, &k.gemv_mma_rope_three_norm] {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            FUSED_NORM_SMEM as i32,
        )
        .map_err(|e| RuntimeError::Device(format!("shared memory for the q|k|v product with its norm: {e}")))?;
    }
    for &tile in GemmTile::available(k) {
        for permuted in [false, true] {
            tile.function(k, permuted)
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    tile.smem() as i32,
                )
                .map_err(|e| RuntimeError::Device(format!("shared memory for the batch-invariant product: {e}")))?;
        }
    }
    Ok(())
}

/// What the fused q|k|v product does after the product (kernels/cache.cu's `rope_and_cache`
/// takes the same): device addresses, 0 for no bias.
pub struct RopeArgs {
    pub bias: u64,
    pub positions: u64,
    pub cos: u64,
    pub sin: u64,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    /// 1: pairs half a head apart (qwen2, HF llama); 0: adjacent (GGUF llama).
    pub halves: i32,
    pub slots: u64,
    /// The rotated queries, bf16 `[rows, heads * head_dim]`.
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
}

impl RopeArgs {
    /// The arguments after the bias, in the order both kernels take them.
    pub fn kernel_args(&self) -> [&dyn super::Arg; 11] {
        [
            &self.positions,
            &self.cos,
            &self.sin,
            &self.heads,
            &self.kv_heads,
            &self.head_dim,
            &self.halves,
            &self.slots,
            &self.q,
            &self.k_cache,
            &self.v_cache,
        ]
    }
}

/// The product's element type: f32 feeds the kernels that follow in full precision.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    F32,
}

impl Gemm {
    /// `invariant`: every product sums a row in one order whatever the batch (`gemm_mma`);
    /// `scratch` elements are kept for the wgmma tiles' x in the mma's order (0: none; rows x k
    /// of the largest product the engine runs lets every one of them take it).
    pub fn new(stream: Arc<CudaStream>, kernels: &Kernels, invariant: bool, scratch: usize) -> Result<Self> {
        let handle = lt::create_handle().map_err(|e| RuntimeError::Device(format!("starting cuBLASLt: {e}")))?;
        let sms = stream
            .context()
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| RuntimeError::Device(format!("reading the number of SMs: {e}")))? as usize;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| RuntimeError::Device(format!("cuBLAS workspace: {e}")))?;
        let scratch = match invariant && kernels.wgmma && scratch > 0 {
            true => {
                let slice = stream
                    .alloc_zeros::<u16>(scratch)
                    .map_err(|e| RuntimeError::Device(format!("the batch-invariant product's scratch: {e}")))?;
                let (p, _) = slice.device_ptr(&stream);
                Some((slice, p))
            }
            false => None,
        };
        let all = [GemmTile::Narrow, GemmTile::Wide, GemmTile::Wgmma, GemmTile::WgmmaWide];
        Ok(Gemm {
            handle,
            stream,
            gemv: kernels.gemv_bf16.clone(),
            gemv_mma: kernels.gemv_mma.clone(),
            gemv_mma_two_groups: kernels.gemv_mma_two_groups.clone(),
            gemv_mma_three_groups: kernels.gemv_mma_three_groups.clone(),
            gemv_mma_add: [
                kernels.gemv_mma_add.clone(),
                kernels.gemv_mma_two_groups_add.clone(),
                kernels.gemv_mma_three_groups_add.clone(),
            ],
            gemv_mma_silu: kernels.gemv_mma_silu.clone(),
            gemv_mma_rope: kernels.gemv_mma_rope.clone(),
            gemv_mma_rope_three: kernels.gemv_mma_rope_three.clone(),
            gemv_mma_rope_norm: [
                kernels.gemv_mma_rope_norm.clone(),
                kernels.gemv_mma_rope_three_norm.clone(),
            ],
            tiles: all.map(|t| t.function(kernels, false).clone()),
            tiles_permuted: all.map(|t| t.function(kernels, true).clone()),
            permute: kernels.permute_k32.clone(),
            scratch,
            wgmma: kernels.wgmma,
            sms,
            invariant,
            workspace,
            plans: Mutex::new(HashMap::new()),
        })
    }

    /// `y[rows, n] = x[rows, k] * w[n, k]^T`; `x` and `w` bf16, `y` f32 or bf16. Pointers are
    /// device addresses of buffers the caller keeps alive for the stream's work.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(&self, x: u64, w: u64, y: u64, out: OutType, rows: usize, n: usize, k: usize) -> Result<()> {
        if Self::takes_mma_gemv(x, w, rows, k) {
            return self.gemv_mma(x, w, y, rows, n, k);
        }
        // The GEMV kernels read rows 16 bytes at a time.
        let aligned = (x | w).is_multiple_of(16);
        if self.invariant {
            return self.invariant_product(x, w, y, rows, n, k, aligned);
        }
        if rows <= GEMV_MAX_ROWS && n * k <= GEMV_MAX_WEIGHTS && k.is_multiple_of(8) && aligned {
            return self.gemv(x, w, y, rows, n, k);
        }
        self.cublas(x, w, y, out, rows, n, k)
    }

    /// A batch-invariant product that the tensor-core GEMV does not take: `gemm_mma` (the
    /// GEMV's sums for any number of rows) where k is a multiple of 32, else the CUDA-core GEMV
    /// 8 rows at a time (each of its rows is a sum of its own, whatever the others).
    #[allow(clippy::too_many_arguments)]
    fn invariant_product(&self, x: u64, w: u64, y: u64, rows: usize, n: usize, k: usize, aligned: bool) -> Result<()> {
        if !aligned || !k.is_multiple_of(8) {
            return Err(RuntimeError::Backend(format!(
                "--batch-invariant: no fixed-order product of [{rows}x{k}] x [{n}x{k}]^T (k not a multiple of 8, or rows not 16-byte aligned)"
            )));
        }
        if k.is_multiple_of(32) {
            return self.gemm_mma(x, w, y, rows, n, k);
        }
        for first in (0..rows).step_by(GEMV_MAX_ROWS) {
            let (xs, ys) = (x + (first * k * 2) as u64, y + (first * n * 4) as u64);
            self.gemv(xs, w, ys, GEMV_MAX_ROWS.min(rows - first), n, k)?;
        }
        Ok(())
    }

    /// `matmul` for any number of rows with the bits of `gemv_mma` (`k` a multiple of 32, rows
    /// 16-byte aligned): the batch-invariant product. The tile is chosen by shape (the bits do
    /// not depend on it): on Hopper the wgmma tiles, of 128 rows for prefills of 512 rows or more
    /// whose blocks fill three quarters of the GPU (x put in the mma's order first, where the
    /// scratch holds it), else of 64; elsewhere the mma.sync ones, of 128 rows for prefills of a
    /// thousand rows or more, else of 64 (`kernel_speeds` and `scripts/flash-bench/gemm-run` on
    /// an H200).
    pub fn gemm_mma(&self, x: u64, w: u64, y: u64, rows: usize, n: usize, k: usize) -> Result<()> {
        // Whether blocks of `tile_rows` rows fill three quarters of the SMs or more.
        let fills = |tile_rows: usize| 4 * rows.div_ceil(tile_rows) * n.div_ceil(GEMM_COLS) >= 3 * self.sms;
        let tile = match self.wgmma && Self::wgmma_reaches(rows, n, k) {
            true if rows >= 512 && fills(128) => GemmTile::WgmmaWide,
            true => GemmTile::Wgmma,
            false if rows >= 1024 && fills(128) => GemmTile::Wide,
            false => GemmTile::Narrow,
        };
        // Only the 128-row tile gains by the pass (`kernel_speeds`: 7-11% at 2048 rows; the
        // 64-row tile after it lost up to 30% at 64 and 256 rows).
        let permuted = tile == GemmTile::WgmmaWide && self.scratch_holds(rows * k);
        self.gemm_mma_tiled(tile, permuted, x, w, y, rows, n, k)
    }

    /// `gemm_mma` in blocks of `tile` (one of `GemmTile::available`); `permuted` (a wgmma tile,
    /// with the scratch for x): x is put in the mma's order of k first, by a pass of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_mma_tiled(
        &self,
        tile: GemmTile,
        permuted: bool,
        x: u64,
        w: u64,
        y: u64,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        if tile.permutes() && !self.wgmma {
            return Err(RuntimeError::Backend(format!(
                "{tile:?} blocks need wgmma (kernels built for sm_90a)"
            )));
        }
        if tile.permutes() && !Self::wgmma_reaches(rows, n, k) {
            return Err(RuntimeError::Backend(format!(
                "the wgmma product addresses its operands in 32 bits: [{rows}x{k}] x [{n}x{k}]^T is too large"
            )));
        }
        let (f, x) = match permuted {
            false => (&self.tiles[tile as usize], x),
            true => {
                if !tile.permutes() || !self.scratch_holds(rows * k) {
                    return Err(RuntimeError::Backend(format!(
                        "no scratch for a permuted x of {rows}x{k} in {tile:?} blocks"
                    )));
                }
                let xp = self.scratch.as_ref().map_or(0, |s| s.1);
                let (r, k32) = (rows as i32, k as i32);
                let pieces = (rows * k / 8).div_ceil(256) as u32;
                super::launch(&self.stream, &self.permute, (pieces, 1), 256, &[&x, &xp, &r, &k32])?;
                (&self.tiles_permuted[tile as usize], xp)
            }
        };
        let grid = (rows.div_ceil(tile.rows()) as u32, n.div_ceil(GEMM_COLS) as u32, 1);
        let (r, n32, k32, segments) = (rows as i32, n as i32, k as i32, GEMV_MMA_WARPS as i32);
        super::launch_smem(
            &self.stream,
            f,
            grid,
            tile.threads(),
            tile.smem(),
            &[&x, &w, &y, &r, &n32, &k32, &segments],
        )
    }

    /// Whether the scratch holds `elements` of a permuted x.
    fn scratch_holds(&self, elements: usize) -> bool {
        self.scratch.as_ref().is_some_and(|s| elements <= s.0.len())
    }

    /// Whether the wgmma tiles' 32-bit element offsets reach every element of both operands.
    fn wgmma_reaches(rows: usize, n: usize, k: usize) -> bool {
        rows.max(n) * k <= u32::MAX as usize
    }

    /// `matmul` through the GEMV kernel (`rows <= GEMV_MAX_ROWS`, `k` a multiple of 8).
    pub fn gemv(&self, x: u64, w: u64, y: u64, rows: usize, n: usize, k: usize) -> Result<()> {
        self.launch_gemv(&self.gemv, n.div_ceil(GEMV_WARPS), GEMV_WARPS, [x, w, y], rows, n, k)
    }

    /// `matmul` through the tensor-core GEMV kernel (`rows <= GEMV_MAX_ROWS`, `k` a multiple of
    /// 32). Where its grid of 16-column blocks would be two or three waves at one block an SM
    /// (o and down on the 8B shape: two; q|k|v: three), a form whose blocks take two or three
    /// groups of 16 runs it in one, with the same bits (docs/gpu-kernels.md).
    pub fn gemv_mma(&self, x: u64, w: u64, y: u64, rows: usize, n: usize, k: usize) -> Result<()> {
        let groups = n.div_ceil(GEMV_MMA_COLS);
        let (f, per_block) = match self.groups_a_block(groups, n, k) {
            2 => (&self.gemv_mma_two_groups, 2),
            3 => (&self.gemv_mma_three_groups, 3),
            _ => (&self.gemv_mma, 1),
        };
        self.launch_gemv(f, groups.div_ceil(per_block), GEMV_MMA_WARPS, [x, w, y], rows, n, k)
    }

    /// `gemv_mma` adding its product into `y` (`y += x w^T`), with the bits of `gemv_mma` then
    /// the addition: each element added once, by the thread that finishes its sum.
    pub fn gemv_mma_add(&self, x: u64, w: u64, y: u64, rows: usize, n: usize, k: usize) -> Result<()> {
        let groups = n.div_ceil(GEMV_MMA_COLS);
        let per_block = self.groups_a_block(groups, n, k);
        let f = &self.gemv_mma_add[per_block - 1];
        self.launch_gemv(f, groups.div_ceil(per_block), GEMV_MMA_WARPS, [x, w, y], rows, n, k)
    }

    /// Whether `gemv_rope` can make its own x as the norm of `rows` rows of a `d`-wide stream:
    /// where it takes the GEMV, at add_rms_norm's fast path's widths, in the shared memory
    /// `prepare` lets it take.
    pub fn fuses_norm(x: u64, w: u64, rows: usize, d: usize) -> bool {
        Self::takes_mma_gemv(x, w, rows, d)
            && d.is_multiple_of(4)
            && d / 4 <= 4 * super::ROW_THREADS as usize
            && norm_smem(rows, d) <= FUSED_NORM_SMEM
    }

    /// Groups of 16 columns a block that put a GEMV grid of `groups` (over `n` rows of `k`) in
    /// one wave at one block an SM, where a form for that many exists (2 or 3); else 1. The
    /// three-group forms take rows' offsets in 16-byte pieces as 32-bit numbers.
    fn groups_a_block(&self, groups: usize, n: usize, k: usize) -> usize {
        match groups.div_ceil(self.sms) {
            2 => 2,
            3 if n * k / 8 <= u32::MAX as usize => 3,
            _ => 1,
        }
    }

    /// Whether `matmul` would run this product on the tensor-core GEMV, which alone has the
    /// fused forms below: a few rows, k a multiple of 32, rows read 16 bytes at a time.
    pub fn takes_mma_gemv(x: u64, w: u64, rows: usize, k: usize) -> bool {
        rows <= GEMV_MAX_ROWS && k.is_multiple_of(32) && (x | w).is_multiple_of(16)
    }

    /// The gate|up product (`w` is `[gate; up]`, `2 * inter` rows of `k`) with SiLU(gate) * up
    /// applied to its sums, into bf16 `out[rows, inter]`: the bits of `gemv_mma` then the
    /// `silu_mul` kernel, in one launch. Only where `takes_mma_gemv`.
    pub fn gemv_silu(&self, x: u64, w: u64, out: u64, rows: usize, inter: usize, k: usize) -> Result<()> {
        let blocks = inter.div_ceil(GEMV_MMA_COLS / 2);
        let f = &self.gemv_mma_silu;
        self.launch_gemv(f, blocks, GEMV_MMA_WARPS, [x, w, out], rows, inter, k)
    }

    /// The q|k|v product with the rope-and-cache kernel's work done on its sums (and `rope.bias`
    /// added first): the bits of `gemv_mma`, `add_bias` and `rope_and_cache`, in one launch. Only
    /// where `takes_mma_gemv`.
    /// `norm`: x is not read but made by the kernel as that norm of the stream (`fuses_norm`).
    pub fn gemv_rope(
        &self,
        x: u64,
        w: u64,
        rows: usize,
        k: usize,
        rope: &RopeArgs,
        norm: Option<&StreamNorm>,
    ) -> Result<()> {
        let pairs = (rope.heads + 2 * rope.kv_heads) as usize * rope.head_dim as usize / 2;
        let groups = pairs.div_ceil(GEMV_MMA_COLS / 2);
        // The 8B shape's 384 groups: one wave of blocks of three, as gemv_mma runs them.
        let width = 2 * pairs;
        let (f, per_block) = match (self.groups_a_block(groups, width, k), norm.is_some()) {
            (3, false) => (&self.gemv_mma_rope_three, 3),
            (3, true) => (&self.gemv_mma_rope_norm[1], 3),
            (_, false) => (&self.gemv_mma_rope, 1),
            (_, true) => (&self.gemv_mma_rope_norm[0], 1),
        };
        let (r, k32) = (rows as i32, k as i32);
        let mut args: Vec<&dyn super::Arg> = vec![&x, &w, &r, &k32, &rope.bias];
        args.extend(rope.kernel_args());
        if let Some(nm) = norm {
            args.extend([&nm.stream as &dyn super::Arg, &nm.weight, &nm.eps]);
        }
        let smem = norm.map_or(0, |_| norm_smem(rows, k)) as u32;
        let blocks = groups.div_ceil(per_block) as u32;
        super::launch_smem(
            &self.stream,
            f,
            (blocks, 1, 1),
            (GEMV_MMA_WARPS * 32) as u32,
            smem,
            &args,
        )
    }

    /// Both GEMV kernels take `(x, w, y, rows, n, k)`.
    #[allow(clippy::too_many_arguments)]
    fn launch_gemv(
        &self,
        f: &CudaFunction,
        blocks: usize,
        warps: usize,
        [x, w, y]: [u64; 3],
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let (r, n32, k32) = (rows as i32, n as i32, k as i32);
        let block = (warps * 32) as u32;
        super::launch(
            &self.stream,
            f,
            (blocks as u32, 1),
            block,
            &[&x, &w, &y, &r, &n32, &k32],
        )
    }

    /// `matmul` through cuBLASLt, whatever the shape, with the algorithm chosen for the shape
    /// the first time it is met.
    #[allow(clippy::too_many_arguments)]
    pub fn cublas(&self, x: u64, w: u64, y: u64, out: OutType, rows: usize, n: usize, k: usize) -> Result<()> {
        let OutType::F32 = out;
        let shape = Shape {
            rows,
            n,
            k,
            align: [alignment(w), alignment(x), alignment(y)],
        };
        let plan = {
            let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
            match plans.get(&shape) {
                Some(p) => p.clone(),
                None => {
                    let p = Arc::new(Plan::new(self.handle, &shape, WORKSPACE_BYTES)?);
                    plans.insert(shape, p.clone());
                    p
                }
            }
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (ws, _) = self.workspace.device_ptr(&self.stream);
        // SAFETY: the pointers address live allocations of the sizes the shape says, aligned as
        // the plan was told; the workspace is this struct's and used on its stream only.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                plan.layouts[0],
                x as *const c_void,
                plan.layouts[1],
                y as *const c_void,
                plan.layouts[2],
                y as *mut c_void,
                plan.layouts[2],
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as _,
            )
        }
        .map_err(lt_err("product", &shape))
    }

    /// Whether products of any number of rows sum in the GEMV's order.
    pub fn invariant(&self) -> bool {
        self.invariant
    }

    /// How many shapes have a chosen algorithm.
    #[cfg(test)]
    pub fn shapes_planned(&self) -> usize {
        self.plans.lock().map_or(0, |p| p.len())
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        // Plans first: their descriptors belong to no handle, but the handle goes last.
        self.plans.lock().map(|mut p| p.clear()).ok();
        // SAFETY: created in `new`, destroyed once; the stream's work is done or abandoned.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
