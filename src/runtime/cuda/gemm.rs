//! Matrix products through cuBLAS: bf16 operands, f32 accumulation, row-major activations
//! times a row-major `[out, in]` weight (the layout of checkpoints), as `y = x W^T`.

use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaStream;

use crate::runtime::error::{Result, RuntimeError};

pub struct Gemm {
    blas: CudaBlas,
    /// cuBLAS's scratch space: Hopper kernels want one (NVIDIA suggests 32 MiB), and without
    /// it cuBLAS may choose slower ones.
    _workspace: cudarc::driver::CudaSlice<u8>,
}

const WORKSPACE_BYTES: usize = 32 << 20;

/// The product's element type: f32 feeds the kernels that follow in full precision.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    F32,
}

impl Gemm {
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
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
            _workspace: workspace,
        })
    }

    /// `y[rows, n] = x[rows, k] * w[n, k]^T`; `x` and `w` bf16, `y` f32 or bf16. Pointers are
    /// device addresses of buffers the caller keeps alive for the stream's work.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(&self, x: u64, w: u64, y: u64, out: OutType, rows: usize, n: usize, k: usize) -> Result<()> {
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
