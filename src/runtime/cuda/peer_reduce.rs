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

/// `QUARRY_TP_REDUCE=bf16`: every rank's partial sums are rounded to bf16 before they are
/// summed, as if the ranks sent bf16: what halving the all-reduce's bytes would cost in
/// accuracy (measured by `scripts/bench-multi-gpu run tp-extract`), not yet its speed. Only
/// this kernel reads it: NCCL, where the GPUs do not reach each other, sums f32 as ever.
fn bf16_inputs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("QUARRY_TP_REDUCE").is_ok_and(|v| v == "bf16"))
}

/// A group of GPUs that reach each other's memory, rank i on `contexts[i]`.
pub struct PeerReduce {
    contexts: Vec<Arc<CudaContext>>,
    kernels: Vec<CudaFunction>,
    /// Each rank's arrival words (`PeerPtrs::arrivals`), zero at first.
    arrivals: Vec<CudaSlice<u32>>,
    /// Each rank's count of calls, a word a block (the kernel's `epochs`).
    epochs: Vec<CudaSlice<u32>>,
}

/// One rank's end of a group, for the thread that drives that GPU: every call sums one of two
/// inputs a rank, fixed here, and calls alternate between them (so one barrier a call does).
pub struct PeerRank {
    group: Arc<PeerReduce>,
    rank: usize,
    ptrs: PeerPtrs,
    /// Floats each of a rank's two inputs holds; the second follows the first.
    capacity: usize,
}

pub(super) fn device(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError {
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
        let words = |what: &'static str| {
            contexts
                .iter()
                .map(|c| {
                    c.default_stream()
                        .alloc_zeros::<u32>(MAX_BLOCKS * MAX_RANKS)
                        .map_err(device(what))
                })
                .collect::<Result<Vec<_>>>()
        };
        let (arrivals, epochs) = (words("arrival words")?, words("call counts")?);
        for c in contexts {
            c.synchronize().map_err(device("arrival words"))?;
        }
        Ok(Some(PeerReduce {
            contexts: contexts.to_vec(),
            kernels,
            arrivals,
            epochs,
        }))
    }

    pub fn ranks(&self) -> usize {
        self.contexts.len()
    }

    /// Rank `rank`'s end of the group, whose calls sum `inputs` (rank i's buffer on GPU i, two
    /// inputs of `capacity` floats one after the other, 16-byte aligned, alive as long as the
    /// end is).
    pub fn rank(self: &Arc<Self>, rank: usize, inputs: &[u64], capacity: usize) -> Result<PeerRank> {
        Ok(PeerRank {
            ptrs: self.ptrs(inputs)?,
            group: self.clone(),
            rank,
            capacity,
        })
    }

    fn ptrs(&self, inputs: &[u64]) -> Result<PeerPtrs> {
        let ranks = self.ranks();
        if inputs.len() != ranks {
            return Err(RuntimeError::InvalidBatch(format!(
                "a peer all-reduce over {ranks} ranks was given {} inputs",
                inputs.len()
            )));
        }
        let mut ptrs = PeerPtrs {
            inputs: [0; MAX_RANKS],
            arrivals: [0; MAX_RANKS],
        };
        // Each rank's words through its own context's stream: another's would have cudarc
        // record that rank's events on a stream of the wrong context.
        for (r, ((&input, arrivals), ctx)) in inputs.iter().zip(&self.arrivals).zip(&self.contexts).enumerate() {
            ptrs.inputs[r] = input;
            ptrs.arrivals[r] = arrivals.device_ptr(&ctx.default_stream()).0;
        }
        Ok(ptrs)
    }

    /// Queues rank `rank`'s part of a call on `stream`: every rank must queue the same calls,
    /// in the same order, with the same `n`. The inputs start `offset` floats into each
    /// rank's buffer; `guard`: a barrier after the reads, for callers that may write an input
    /// again before the next call.
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        ptrs: &PeerPtrs,
        offset: usize,
        rank: usize,
        out: u64,
        n: usize,
        guard: bool,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // Enough blocks to have the bytes in flight, few enough to be resident at once (their
        // barriers wait on each other across the GPUs).
        let blocks = (n.div_ceil(4) as u32).div_ceil(THREADS).clamp(1, MAX_BLOCKS as u32);
        let (count, rank_i, ranks_i) = (n as i32, rank as i32, self.ranks() as i32);
        let (offset, guard, bf16) = (offset as i64, guard as i32, bf16_inputs() as i32);
        let epochs = self.epochs[rank].device_ptr(stream).0;
        launch(
            stream,
            &self.kernels[rank],
            (blocks, 1),
            THREADS,
            &[ptrs, &offset, &out, &count, &rank_i, &ranks_i, &epochs, &guard, &bf16],
        )
    }

    /// `outputs[i] = sum over ranks of inputs[r]`, `n` floats each, queued on `streams[i]` for
    /// rank i, from one thread. Every buffer is 16-byte aligned; inputs and outputs do not
    /// overlap.
    pub fn all_reduce_f32(&self, inputs: &[u64], outputs: &[u64], n: usize, streams: &[Arc<CudaStream>]) -> Result<()> {
        let ranks = self.ranks();
        if outputs.len() != ranks || streams.len() != ranks {
            return Err(RuntimeError::InvalidBatch(format!(
                "a peer all-reduce over {ranks} ranks was given {} outputs and {} streams",
                outputs.len(),
                streams.len()
            )));
        }
        let ptrs = self.ptrs(inputs)?;
        for r in 0..ranks {
            self.launch(&ptrs, 0, r, outputs[r], n, true, &streams[r])?;
        }
        Ok(())
    }
}

impl PeerRank {
    /// `out` = the sum over ranks of the first `n` floats of their input `slot` (0 or 1; calls
    /// alternate between them), queued on this rank's `stream`; graph-safe (the kernel counts
    /// its own calls).
    pub fn all_reduce(&self, slot: usize, out: u64, n: usize, stream: &Arc<CudaStream>) -> Result<()> {
        if n > self.capacity {
            return Err(RuntimeError::InvalidBatch(format!(
                "an all-reduce of {n} floats; the ranks' buffers hold {}",
                self.capacity
            )));
        }
        self.group
            .launch(&self.ptrs, (slot & 1) * self.capacity, self.rank, out, n, false, stream)
    }
}
