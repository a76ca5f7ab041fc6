//! KV blocks from one GPU to another (runtime/kv_link.rs) over NCCL send and receive, on a
//! stream of their own, so that neither engine's steps wait for a transfer.
//!
//! A transfer goes in pieces of at most `STAGING_BYTES`: the sender gathers a piece's blocks
//! (every layer's K and V) into its staging buffer and sends it; the receiver receives into
//! its own and scatters. Both ends cut a transfer alike (the same model's block size), so each
//! send meets a receive of the same length. An event after each transfer tells the engine when
//! the blocks may be written again (sender) or read (receiver).
//!
//! Nothing orders a gather after the engine's own stream: the engine sends only blocks whose
//! step it has read back (so they are written), and holds them until the transfer is done.
//!
//! The pair's communicators are nonblocking (nccl.rs's `pair`). A transfer that fails, or is
//! not done in time (a peer that never queues its half), aborts both: the kernels waiting on
//! it end, the port's stream drains, and only then are the blocks let go, so no scatter still
//! queued writes a block handed out again. The link then refuses every later transfer and
//! each engine computes its prompts itself.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr};

use super::launcher::{self, Arg};
use super::nccl::{self, Nccl, PairEnd};
use crate::runtime::error::{Result, RuntimeError};
use crate::runtime::KvLinkEnd;

/// The most one piece of a transfer holds: a few dozen blocks of an 8B model's 2 MiB.
const STAGING_BYTES: usize = 128 << 20;

/// kernels/cache.cu's KV_PIECE_BLOCKS: the block ids of a piece, passed by value.
const PIECE_BLOCKS: usize = 960;

/// A transfer not done after this long is taken for a link that failed (a peer that never
/// queued its half); `QUARRY_KV_TIMEOUT` (seconds) sets another.
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a failed link's stream may take to drain once its communicators are aborted.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

#[repr(C)]
#[derive(Clone, Copy)]
struct KvIds {
    id: [u32; PIECE_BLOCKS],
}

impl Arg for KvIds {
    fn as_param(&self) -> *mut std::ffi::c_void {
        self as *const KvIds as *mut std::ffi::c_void
    }
}

/// One GPU's end of a link: its rank in a pair of communicators.
pub struct NcclEnd {
    comm: PairEnd,
    device: usize,
}

/// Both ends of a link from GPU `from` to GPU `to`, their first transfer made.
pub fn pair(from: usize, to: usize) -> Result<(KvLinkEnd, KvLinkEnd)> {
    if from == to {
        return Err(RuntimeError::Device(format!(
            "a KV link joins two GPUs, and both ends are cuda:{from}"
        )));
    }
    let nccl = Nccl::open()?;
    let err = |what: &'static str| move |e: cudarc::driver::DriverError| RuntimeError::Device(format!("{what}: {e}"));
    let ctxs = [from, to].map(CudaContext::new);
    let [a, b] = ctxs;
    let (a, b) = (a.map_err(err("KV link"))?, b.map_err(err("KV link"))?);
    let (sa, sb) = (
        a.new_stream().map_err(err("KV link"))?,
        b.new_stream().map_err(err("KV link"))?,
    );
    let ba = sa.alloc_zeros::<u8>(256).map_err(err("KV link"))?;
    let bb = sb.alloc_zeros::<u8>(256).map_err(err("KV link"))?;
    let ends = {
        let (pa, _ga) = ba.device_ptr(&sa);
        let (pb, _gb) = bb.device_ptr(&sb);
        nccl::pair(nccl, [&a, &b], [pa, pb], [sa.cu_stream(), sb.cu_stream()], 256)?
    };
    sa.synchronize().map_err(err("KV link's first transfer"))?;
    sb.synchronize().map_err(err("KV link's first transfer"))?;
    let [e0, e1] = ends;
    Ok((
        KvLinkEnd::Nccl(NcclEnd { comm: e0, device: from }),
        KvLinkEnd::Nccl(NcclEnd { comm: e1, device: to }),
    ))
}

/// A backend's side of a link.
pub struct KvPort {
    end: NcclEnd,
    stream: Arc<CudaStream>,
    /// Left allocated where a failed transfer may still use it.
    staging: std::mem::ManuallyDrop<CudaSlice<u16>>,
    /// Blocks one piece holds, and the entries of one block in one pool.
    piece_blocks: usize,
    block_elems: usize,
    /// Each layer's K pool then V pool.
    pools: CudaSlice<u64>,
    num_pools: usize,
    /// An event after each transfer not yet seen done, and when it was queued, oldest first.
    pending: VecDeque<(CudaEvent, Instant)>,
    done: u64,
    failed: Option<String>,
    /// After a failure: an event after the abort, and whether the stream was seen past it
    /// (until then no transfer is reported, so their blocks stay held).
    drain: Option<CudaEvent>,
    drained: bool,
    timeout: Duration,
    /// `QUARRY_KV_FAULT=stall-send` (fault tests): sends gather but never send, a peer that
    /// never queues its half.
    stall_sends: bool,
}

impl KvPort {
    /// A port over the cache pools `k` and `v` (one of each per layer) of the backend on
    /// `ctx`, each block `block_elems` entries.
    pub fn new(
        end: NcclEnd,
        ctx: &Arc<CudaContext>,
        k: &[CudaSlice<u16>],
        v: &[CudaSlice<u16>],
        block_elems: usize,
    ) -> Result<KvPort> {
        if end.device != ctx.ordinal() {
            return Err(RuntimeError::Device(format!(
                "a KV link's end for cuda:{} was given to the backend on cuda:{}",
                end.device,
                ctx.ordinal()
            )));
        }
        if !block_elems.is_multiple_of(8) {
            return Err(RuntimeError::Backend(format!(
                "a KV block of {block_elems} entries: the transfer kernels copy 16 bytes at a time"
            )));
        }
        let err = |e: cudarc::driver::DriverError| RuntimeError::Device(format!("KV link on cuda:{}: {e}", end.device));
        let stream = ctx.new_stream().map_err(err)?;
        let addresses: Vec<u64> = k
            .iter()
            .zip(v)
            .flat_map(|(k, v)| [k.device_ptr(&stream).0, v.device_ptr(&stream).0])
            .collect();
        let pools = stream.clone_htod(&addresses).map_err(err)?;
        let block_bytes = addresses.len() * block_elems * 2;
        // A smaller piece (tests of a transfer in many pieces); both ends must agree.
        let most = std::env::var("QUARRY_KV_PIECE_BLOCKS")
            .ok()
            .and_then(|n| n.parse::<usize>().ok())
            .map_or(PIECE_BLOCKS, |n| n.clamp(1, PIECE_BLOCKS));
        let piece_blocks = (STAGING_BYTES / block_bytes).clamp(1, most);
        // SAFETY: staging is written (gathered or received) before it is read.
        let staging = unsafe { stream.alloc::<u16>(piece_blocks * addresses.len() * block_elems) }.map_err(err)?;
        let staging = std::mem::ManuallyDrop::new(staging);
        Ok(KvPort {
            end,
            stream,
            staging,
            piece_blocks,
            block_elems,
            num_pools: addresses.len(),
            pools,
            pending: VecDeque::new(),
            done: 0,
            failed: None,
            drain: None,
            drained: false,
            timeout: std::env::var("QUARRY_KV_TIMEOUT")
                .ok()
                .and_then(|s| s.parse::<f64>().ok())
                .filter(|s| *s > 0.0)
                .map_or(TRANSFER_TIMEOUT, Duration::from_secs_f64),
            stall_sends: std::env::var("QUARRY_KV_FAULT").is_ok_and(|f| f == "stall-send"),
        })
    }

    /// Queues gathering and sending `blocks`, after the work queued so far on `compute` (the
    /// engine's stream); its ticket.
    pub fn send(&mut self, gather: &CudaFunction, blocks: &[u32], compute: &CudaStream) -> Result<u64> {
        self.transfer(gather, blocks, true, compute)
    }

    /// Queues receiving into `blocks` and scattering, after the work queued so far on
    /// `compute`; its ticket.
    pub fn recv(&mut self, scatter: &CudaFunction, blocks: &[u32], compute: &CudaStream) -> Result<u64> {
        self.transfer(scatter, blocks, false, compute)
    }

    fn transfer(&mut self, kernel: &CudaFunction, blocks: &[u32], sending: bool, compute: &CudaStream) -> Result<u64> {
        self.check()?;
        // A pass still queued may write these blocks (a block a pipelined step is filling, or
        // one a finished request's last pass still writes): the transfer waits for it on the
        // device, never on the host.
        let ordered = compute
            .record_event(None)
            .and_then(|e| self.stream.wait(&e))
            .map_err(|e| RuntimeError::Device(format!("KV transfer: {e}")));
        let ticket = self.done + self.pending.len() as u64;
        match ordered.and_then(|_| self.queue(kernel, blocks, sending)) {
            Ok(ticket) => Ok(ticket),
            Err(e) => {
                // The two ends' pieces may no longer pair up: no later transfer can be trusted.
                // Pieces of this one may be queued already: its blocks stay held as a
                // transfer's, until `done` reports the failure once the stream has drained.
                self.fail(e.to_string());
                Ok(ticket)
            }
        }
    }

    /// Ends the link: aborts the pair's communicators (the other end's transfers fail too),
    /// then waits for this end's stream to drain, so that the caller may let the blocks of
    /// every transfer go.
    fn fail(&mut self, why: String) {
        if self.failed.is_some() {
            return;
        }
        eprintln!(
            "quarry: the KV link on cuda:{} failed: {why}; aborting it, each engine computes its prompts itself from now on",
            self.end.device
        );
        self.failed = Some(why);
        self.end.comm.abort();
        self.drain = self.stream.record_event(None).ok();
        let started = Instant::now();
        while !self.poll_drain() && started.elapsed() < DRAIN_DEADLINE {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !self.drained {
            eprintln!(
                "quarry: the KV link's stream on cuda:{} did not drain within {} s of the abort; its transfers' blocks stay held until it does",
                self.end.device,
                DRAIN_DEADLINE.as_secs()
            );
        }
    }

    /// Whether the stream has passed the abort (no kernel of a transfer still to run).
    fn poll_drain(&mut self) -> bool {
        if !self.drained {
            self.drained = self
                .drain
                .as_ref()
                .is_some_and(|e| e.try_is_complete().unwrap_or(false));
        }
        self.drained
    }

    /// After a failure, the error, once the stream has drained: until then no transfer is
    /// done (a scatter still queued would write blocks let go).
    fn after_failure(&mut self) -> Result<u64> {
        match self.poll_drain() {
            true => self.check().map(|_| self.done),
            false => Ok(self.done),
        }
    }

    fn queue(&mut self, kernel: &CudaFunction, blocks: &[u32], sending: bool) -> Result<u64> {
        let err = |e: cudarc::driver::DriverError| RuntimeError::Device(format!("KV transfer: {e}"));
        for piece in blocks.chunks(self.piece_blocks) {
            let mut ids = KvIds { id: [0; PIECE_BLOCKS] };
            ids.id[..piece.len()].copy_from_slice(piece);
            let bytes = piece.len() * self.num_pools * self.block_elems * 2;
            let (pools, _g2) = self.pools.device_ptr(&self.stream);
            let (staging, _g3) = self.staging.device_ptr(&self.stream);
            let elems = self.block_elems as i32;
            let args: [&dyn Arg; 4] = [&ids, &pools, &elems, &staging];
            let grid = (piece.len() as u32, self.num_pools as u32);
            if sending {
                launcher::launch(&self.stream, kernel, grid, launcher::THREADS, &args)?;
                if !self.stall_sends {
                    self.end.comm.send(staging, bytes, &self.stream)?;
                }
            } else {
                self.end.comm.recv(staging, bytes, &self.stream)?;
                launcher::launch(&self.stream, kernel, grid, launcher::THREADS, &args)?;
            }
        }
        let event = self.stream.record_event(None).map_err(err)?;
        self.pending.push_back((event, Instant::now()));
        Ok(self.done + self.pending.len() as u64 - 1)
    }

    /// Transfers done so far, in order.
    pub fn done(&mut self) -> Result<u64> {
        if self.failed.is_some() {
            return self.after_failure();
        }
        let mut finished = 0;
        for (event, queued) in &self.pending {
            match event.try_is_complete() {
                Ok(true) => finished += 1,
                Ok(false) if queued.elapsed() > self.timeout => {
                    let why = format!(
                        "a transfer not done after {:.0} s (the other end never queued its half?)",
                        self.timeout.as_secs_f64()
                    );
                    self.fail(why);
                    return self.after_failure();
                }
                Ok(false) => break,
                Err(e) => {
                    self.fail(format!("KV transfer: {e}"));
                    return self.after_failure();
                }
            }
        }
        // Asked after the events: a transfer ended by the other end's abort completes its event
        // too, and the abort is seen here first.
        if let Err(e) = self.end.comm.health() {
            self.fail(e.to_string());
            return self.after_failure();
        }
        self.pending.drain(..finished);
        self.done += finished as u64;
        Ok(self.done)
    }

    fn check(&self) -> Result<()> {
        match &self.failed {
            Some(e) => Err(RuntimeError::Device(format!("the KV link failed earlier: {e}"))),
            None => Ok(()),
        }
    }
}

impl Drop for KvPort {
    fn drop(&mut self) {
        // Transfers in flight read or write the staging buffer freed with the port. One whose
        // other end is gone would hold the stream forever: they get as long as a transfer may
        // take, then the link is aborted. After a failure whose stream did not drain, the
        // memory is left to the process.
        if self.failed.is_none() {
            let started = Instant::now();
            let last_done =
                |p: &VecDeque<(CudaEvent, Instant)>| p.back().is_none_or(|(e, _)| e.try_is_complete().unwrap_or(true));
            while !last_done(&self.pending) && started.elapsed() < self.timeout {
                std::thread::sleep(Duration::from_millis(1));
            }
            if !last_done(&self.pending) {
                self.fail("transfers still under way as the link closes".into());
            }
        }
        let idle = match self.failed {
            None => self.stream.synchronize().is_ok(),
            Some(_) => self.poll_drain(),
        };
        if idle {
            // SAFETY: dropped once, here, after the stream's last use of it.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.staging) };
        }
    }
}
