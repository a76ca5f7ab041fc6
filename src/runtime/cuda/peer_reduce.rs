//! The one-shot all-reduce through peer memory (kernels/all_reduce.cu): for the small messages
//! of tensor-parallel decoding, where NCCL's fixed cost (about 14 us on two H200s over NVLink,
//! docs/multi-gpu.md) is most of the call. Every GPU of the group must reach every other's
//! memory (`cuDeviceCanAccessPeer`); where one cannot, there is no peer group and NCCL serves
//! all sizes. One process holds every rank, so each rank's buffers are plain device pointers
//! to the others, with no IPC handles to exchange.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr};

use super::kernels::load_one;
use super::launcher::{launch, Arg};
use crate::runtime::error::{Result, RuntimeError};

/// kernels/all_reduce.cu's AR_MAX_RANKS and AR_MAX_BLOCKS.
pub const MAX_RANKS: usize = 8;
const MAX_BLOCKS: usize = 64;
const THREADS: u32 = 512;

/// The kernel's `PeerPtrs`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct PeerPtrs {
    inputs: [u64; MAX_RANKS],
    arrivals: [u64; MAX_RANKS],
}

impl Arg for PeerPtrs {
    fn as_param(&self) -> *mut c_void {
        self as *const PeerPtrs as *mut c_void
    }
}

/// A group of GPUs that reach each other's memory, rank i on `contexts[i]`.
pub struct PeerReduce {
    contexts: Vec<Arc<CudaContext>>,
    kernels: Vec<CudaFunction>,
    /// Each rank's arrival words (`PeerPtrs::arrivals`), zero at first.
    arrivals: Vec<CudaSlice<u32>>,
    /// The calls so far: the barriers' values come from it and only grow.
    epoch: u32,
}

fn device(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError {
    move |e| RuntimeError::Device(format!("{what}: {e}"))
}

/// Lets `reader` use what `owner` allocates from its memory pool: buffers come from
/// `cuMemAllocAsync`, whose pools peer access between contexts does not cover.
fn grant_pool(owner: &CudaContext, reader: &CudaContext) -> Result<()> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: writes one handle; the device exists.
    unsafe { sys::cuDeviceGetMemPool(&mut pool, owner.cu_device()) }
        .result()
        .map_err(device("reading a memory pool"))?;
    let access = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: reader.ordinal() as i32,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: one descriptor, read during the call.
    unsafe { sys::cuMemPoolSetAccess(pool, &access, 1) }
        .result()
        .map_err(device("granting a GPU another's memory pool"))
}

impl PeerReduce {
    /// The group, or None where some GPU cannot reach another's memory.
    pub fn new(contexts: &[Arc<CudaContext>]) -> Result<Option<PeerReduce>> {
        if !(2..=MAX_RANKS).contains(&contexts.len()) {
            return Err(RuntimeError::Device(format!(
                "a peer all-reduce takes 2 to {MAX_RANKS} GPUs, not {}",
                contexts.len()
            )));
        }
        for a in contexts {
            for b in contexts.iter().filter(|b| b.ordinal() != a.ordinal()) {
                let mut can = 0;
                // SAFETY: writes one int; both devices exist.
                unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
                    .result()
                    .map_err(device("asking for peer access"))?;
                if can == 0 {
                    return Ok(None);
                }
                a.bind_to_thread().map_err(device("peer access"))?;
                // SAFETY: both contexts live as long as the group (it holds them).
                match unsafe { sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) } {
                    sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                    e => {
                        return Err(RuntimeError::Device(format!(
                            "enabling GPU {}'s access to GPU {}: {e:?}",
                            a.ordinal(),
                            b.ordinal()
                        )))
                    }
                }
                if b.has_async_alloc() {
                    grant_pool(b, a)?;
                }
            }
        }
        let source = include_str!("../../../kernels/all_reduce.cu");
        let kernels = contexts
            .iter()
            .map(|c| load_one(c, "all_reduce.cu", source, "peer_all_reduce"))
            .collect::<Result<Vec<_>>>()?;
        let arrivals = contexts
            .iter()
            .map(|c| {
                c.default_stream()
                    .alloc_zeros::<u32>(MAX_BLOCKS * MAX_RANKS)
                    .map_err(device("arrival words"))
            })
            .collect::<Result<Vec<_>>>()?;
        for c in contexts {
            c.synchronize().map_err(device("arrival words"))?;
        }
        Ok(Some(PeerReduce {
            contexts: contexts.to_vec(),
            kernels,
            arrivals,
            epoch: 0,
        }))
    }

    pub fn ranks(&self) -> usize {
        self.contexts.len()
    }

    /// `outputs[i] = sum over ranks of inputs[r]`, `n` floats each, queued on `streams[i]` for
    /// rank i. Every buffer is 16-byte aligned; inputs and outputs do not overlap.
    pub fn all_reduce_f32(
        &mut self,
        inputs: &[u64],
        outputs: &[u64],
        n: usize,
        streams: &[Arc<CudaStream>],
    ) -> Result<()> {
        let ranks = self.ranks();
        if inputs.len() != ranks || outputs.len() != ranks || streams.len() != ranks {
            return Err(RuntimeError::InvalidBatch(format!(
                "a peer all-reduce over {ranks} ranks was given {} inputs, {} outputs and {} streams",
                inputs.len(),
                outputs.len(),
                streams.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let mut ptrs = PeerPtrs {
            inputs: [0; MAX_RANKS],
            arrivals: [0; MAX_RANKS],
        };
        for r in 0..ranks {
            ptrs.inputs[r] = inputs[r];
            ptrs.arrivals[r] = self.arrivals[r].device_ptr(&streams[r]).0;
        }
        self.epoch = self.epoch.wrapping_add(1);
        // Enough blocks to have the bytes in flight, few enough to be resident at once (their
        // barriers wait on each other across the GPUs).
        let blocks = (n.div_ceil(4) as u32).div_ceil(THREADS).clamp(1, MAX_BLOCKS as u32);
        let (count, ranks_i) = (n as i32, ranks as i32);
        let epoch = self.epoch as i32;
        for r in 0..ranks {
            let rank = r as i32;
            launch(
                &streams[r],
                &self.kernels[r],
                (blocks, 1),
                THREADS,
                &[&ptrs, &outputs[r], &count, &rank, &ranks_i, &epoch],
            )?;
        }
        Ok(())
    }
}
