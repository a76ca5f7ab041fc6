//! Matrix products: bf16 operands, f32 accumulation, row-major activations times a row-major
//! `[out, in]` weight (the layout of checkpoints), as `y = x W^T`. Up to 8 rows, the product is
//! bound by reading the weights once and kernels/gemv.cu computes it (`gemv_mma` on the tensor
//! cores where k is a multiple of 32, else `gemv_bf16`), with one order of summation over k
//! whatever the number of rows; cuBLAS takes larger batches (`test-quarry kernel_speeds
//! --ignored`, scripts/bench-gpu, compares them).

use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaStream};

use crate::runtime::error::{Result, RuntimeError};

pub struct Gemm {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
    gemv: CudaFunction,
    gemv_mma: CudaFunction,
    /// cuBLAS's scratch space: Hopper kernels want one (NVIDIA suggests 32 MiB), and without
    /// it cuBLAS may choose slower ones.
    _workspace: cudarc::driver::CudaSlice<u8>,
}

const WORKSPACE_BYTES: usize = 32 << 20;

/// kernels/gemv.cu's GEMV_MAX_ROWS.
pub const GEMV_MAX_ROWS: usize = 8;

/// Weights up to this many elements take the CUDA-core GEMV kernel at `GEMV_MAX_ROWS` rows or
/// fewer (from 8 MB of weights on, cuBLAS read them faster on the H100).
const GEMV_MAX_WEIGHTS: usize = 4 << 20;

/// Warps (output columns) per block of the CUDA-core GEMV kernel.
const GEMV_WARPS: usize = 8;

/// kernels/gemv.cu's GEMV_MMA_COLS.
const GEMV_MMA_COLS: usize = 16;

/// Warps per block of the tensor-core GEMV. 16 where blocks are few (the 8B shape's q|k|v and o)
/// read slower on the H200 (q|k|v 79% -> 67% of the copy bandwidth, o 68% -> 65%).
const GEMV_MMA_WARPS: usize = 8;

/// The product's element type: f32 feeds the kernels that follow in full precision.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    F32,
}

impl Gemm {
    pub fn new(stream: Arc<CudaStream>, gemv: CudaFunction, gemv_mma: CudaFunction) -> Result<Self> {
        let blas = CudaBlas::new(stream.clone()).map_err(|e| RuntimeError::Device(format!("starting cuBLAS: {e}")))?;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| RuntimeError::Device(format!("cuBLAS workspace: {e}")))?;
        let (ptr, _) = cudarc::driver::DevicePtr::device_ptr(&workspace, &stream);
        // SAFETY: the workspace lives as long as the handle (both in this struct).
        let status =
            unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, WORKSPACE_BYTES) };
        if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(RuntimeError::Device(format!("cuBLAS workspace: {status:?}")));
        }
        Ok(Gemm {
            blas,
            stream,
            gemv,
            gemv_mma,
            _workspace: workspace,
        })
    }

    /// `y[rows, n] = x[rows, k] * w[n, k]^T`; `x` and `w` bf16, `y` f32 or bf16. Pointers are
    /// device addresses of buffers the caller keeps alive for the stream's work.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(&self, x: u64, w: u64, y: u64, out: OutType, rows: usize, n: usize, k: usize) -> Result<()> {
        // The GEMV kernels read rows 16 bytes at a time.
        let aligned = (x | w).is_multiple_of(16);
        if rows <= GEMV_MAX_ROWS && k.is_multiple_of(32) && aligned {
            return self.gemv_mma(x, w, y, rows, n, k);
        }
        if rows <= GEMV_MAX_ROWS && n * k <= GEMV_MAX_WEIGHTS && k.is_multiple_of(8) && aligned {
            return self.gemv(x, w, y, rows, n, k);
        }
        self.cublas(x, w, y, out, rows, n, k)
    }

    /// `matmul` through the GEMV kernel (`rows <= GEMV_MAX_ROWS`, `k` a multiple of 8).
    pub fn gemv(&self, x: u64, w: u64, y: u64, rows: usize, n: usize, k: usize) -> Result<()> {
        self.launch_gemv(&self.gemv, n.div_ceil(GEMV_WARPS), GEMV_WARPS, [x, w, y], rows, n, k)
    }

    /// `matmul` through the tensor-core GEMV kernel (`rows <= GEMV_MAX_ROWS`, `k` a multiple of
    /// 32).
    pub fn gemv_mma(&self, x: u64, w: u64, y: u64, rows: usize, n: usize, k: usize) -> Result<()> {
        let blocks = n.div_ceil(GEMV_MMA_COLS);
        self.launch_gemv(&self.gemv_mma, blocks, GEMV_MMA_WARPS, [x, w, y], rows, n, k)
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

    /// `matmul` through cuBLAS, whatever the shape.
    #[allow(clippy::too_many_arguments)]
    pub fn cublas(&self, x: u64, w: u64, y: u64, out: OutType, rows: usize, n: usize, k: usize) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let out_type = match out {
            OutType::F32 => cudaDataType::CUDA_R_32F,
        };
        // cuBLAS is column-major: row-major y[rows, n] is its [n, rows], the product of the
        // weight (row-major [n, k], which it reads as [k, n], hence transposed) and x (row-major
        // [rows, k], which it reads as [k, rows], as is).
        // SAFETY: the pointers address live allocations of the sizes the shapes say.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                rows as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const _,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                out_type,
                n as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cudarc::cublas::sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| RuntimeError::Backend(format!("cuBLAS gemm [{rows}x{k}] x [{n}x{k}]^T: {e}")))
    }
}
