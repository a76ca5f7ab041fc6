//! Kernel launches. On sm_90 and later every kernel is launched with programmatic stream
//! serialization: it may start while the kernel before it in the stream is finishing, and waits
//! inside (kernels/prelude.cuh's `after_previous_kernel`) before it touches that kernel's memory.
//! What overlaps is the launch itself and whatever a kernel reads that no kernel writes (a
//! GEMV's first weights), worth a few microseconds per kernel in a batch-1 step of hundreds.
//! `QUARRY_CUDA_PDL=0` launches them one after the other, as before, for comparison.

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaStream};

use crate::runtime::error::{Result, RuntimeError};

/// Threads of a block for kernels with one thread per item.
pub const THREADS: u32 = 256;

/// Threads of the kernels that give a block to each row (norms, rope, cache writes,
/// embeddings): a batch of one token is one block, whose loop over a row of 4,096 is latency
/// bound with fewer threads.
pub const ROW_THREADS: u32 = 1024;

/// A kernel argument: device pointers travel as `u64`, sizes as `i32`, scalars as `f32`.
pub trait Arg {
    /// The address of the value, as cuLaunchKernelEx reads its parameters.
    fn as_param(&self) -> *mut c_void;
}

macro_rules! kernel_arg {
    ($($t:ty),*) => {$(
        impl Arg for $t {
            fn as_param(&self) -> *mut c_void {
                self as *const $t as *mut c_void
            }
        }
    )*};
}
kernel_arg!(u64, i32, i64, f32);

/// Whether launches overlap their predecessor: sm_90 or later, unless `QUARRY_CUDA_PDL=0`.
/// Decided once per process from the first stream that launches (one kind of GPU per process).
pub fn overlapped(stream: &CudaStream) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        let major = stream
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .unwrap_or(0);
        major >= 9 && std::env::var("QUARRY_CUDA_PDL").map_or(true, |v| v != "0")
    })
}

/// Queues one kernel on `stream`: a grid of `grid` blocks of `block` threads.
pub fn launch(stream: &CudaStream, f: &CudaFunction, grid: (u32, u32), block: u32, args: &[&dyn Arg]) -> Result<()> {
    launch3(stream, f, (grid.0, grid.1, 1), block, args)
}

/// `launch` with a grid of three dimensions.
pub fn launch3(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: (u32, u32, u32),
    block: u32,
    args: &[&dyn Arg],
) -> Result<()> {
    launch_smem(stream, f, grid, block, 0, args)
}

/// `launch3` with `smem` bytes of dynamic shared memory per block.
pub fn launch_smem(
    stream: &CudaStream,
    f: &CudaFunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    args: &[&dyn Arg],
) -> Result<()> {
    let mut params: Vec<*mut c_void> = args.iter().map(|a| a.as_param()).collect();
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        // SAFETY: the union is plain data; zero is a valid value of each member.
        value: unsafe { std::mem::zeroed() },
    };
    attr.value.programmaticStreamSerializationAllowed = 1;
    let overlap = overlapped(stream);
    let config = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream.cu_stream(),
        attrs: if overlap { &mut attr } else { std::ptr::null_mut() },
        numAttrs: u32::from(overlap),
    };
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| RuntimeError::Backend(format!("kernel launch: {e}")))?;
    // SAFETY: every pointer argument addresses a live buffer of the size its kernel reads
    // (batches are validated: ids, slots, block tables, before any launch); `params` holds one
    // address per kernel parameter, each alive until the call returns (the driver copies them).
    unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
        .result()
        .map_err(|e| RuntimeError::Backend(format!("kernel launch: {e}")))
}

/// Queues a kernel that takes one thread per item, over `items` items.
pub fn launch_items(stream: &CudaStream, f: &CudaFunction, items: usize, args: &[&dyn Arg]) -> Result<()> {
    let blocks = (items as u64).div_ceil(THREADS as u64) as u32;
    launch(stream, f, (blocks, 1), THREADS, args)
}

#[cfg(test)]
mod tests {
    /// Every kernel is launched overlapped on sm_90, so every one must wait for its predecessor
    /// before touching memory: a kernel without the call would race with the kernel before it.
    #[test]
    fn every_kernel_waits_for_the_one_before_it() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut kernels = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "cu") {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            // Device functions that wait, themselves or through another that does (the GEMVs
            // share a loop that waits between its first weight loads and its first read of x);
            // the prelude's two: the usual one, and the merge's, which lets the next kernel
            // start first.
            let mut waiting = vec![
                "after_previous_kernel".to_string(),
                "let_next_start_then_wait".to_string(),
            ];
            for chunk in source.split("__device__").skip(1) {
                let body = chunk.split("__global__").next().unwrap_or("");
                let name = body
                    .split('(')
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .last()
                    .unwrap_or("");
                if calls_any(body, &waiting) {
                    waiting.push(name.to_string());
                }
            }
            // The text from each `__global__` to the next holds that kernel's body.
            for body in source.split("__global__").skip(1) {
                kernels += 1;
                let name = body.split('(').next().unwrap_or("").trim();
                assert!(
                    calls_any(body, &waiting),
                    "{}: kernel `{name}` never waits for the kernel before it",
                    path.display()
                );
            }
        }
        assert!(kernels >= 20, "found only {kernels} kernels in {}", dir.display());
    }

    /// Whether `body` calls one of `functions`, templates (`name<D>(`) included.
    fn calls_any(body: &str, functions: &[String]) -> bool {
        functions
            .iter()
            .any(|f| body.contains(&format!("{f}(")) || body.contains(&format!("{f}<")))
    }
}
