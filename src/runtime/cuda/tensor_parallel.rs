//! Tensor parallelism (`--tensor-parallel-size N`): one model split over N GPUs of one host
//! (runtime/shard.rs says how), one process with a thread a GPU. Each rank is a whole CUDA
//! backend over its shard: it stages the batch, replays its own graphs and queues its own
//! all-reduces, which are captured with the rest of its step. The engine sees one backend:
//! every pass goes to every rank at once; the logits, masks and draws stay on rank 0. The
//! tokens it draws reach the other ranks in the next pass's batch, or, where steps are
//! pipelined, as a copy of its draw's scratch into theirs, which their next pass waits for.
//!
//! The all-reduce is the one-shot through peer memory (peer_reduce.rs) where every GPU reaches
//! the others': it sums in rank order, so every rank holds the same residual stream, and a
//! row's sum does not depend on what else is in the pass. Elsewhere NCCL, a communicator a
//! rank. Either way the partial sums go to a buffer fixed at load, whose address the other
//! ranks hold.

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};

use super::graphs::MAX_PER_SEQ;
use super::nccl::{Group, Nccl, RankComm};
use super::peer_reduce::{device, PeerRank, PeerReduce};
use super::{CudaBackend, CudaOptions, WeightSource};
use crate::runtime::config::ModelConfig;
use crate::runtime::error::{Result, RuntimeError};
use crate::runtime::gguf::GgufFile;
use crate::runtime::shard::{self, Shard};
use crate::runtime::{Backend, ForwardBatch, KvLayout, RowDraw, RowRequest, Sampled, FROM_LAST_DRAW};

/// What one rank's backend needs of its group.
pub struct RankLink {
    pub shard: Shard,
    pub ctx: Arc<CudaContext>,
    reduce: Reduce,
    /// Where the rank's row-parallel products go: two buffers (peer_reduce.rs's slots) of
    /// `capacity` tokens of the hidden width, one after the other.
    partial: CudaSlice<f32>,
    /// Floats in one of them.
    slot_len: usize,
    /// The most tokens a pass may have.
    pub capacity: usize,
}

enum Reduce {
    Peer(PeerRank),
    Nccl(RankComm),
}

impl RankLink {
    /// The buffer `slot` (0 or 1) a row-parallel projection writes its partial sums to.
    pub fn partial(&self, slot: usize, stream: &Arc<CudaStream>) -> u64 {
        self.partial.device_ptr(stream).0 + (slot * self.slot_len * std::mem::size_of::<f32>()) as u64
    }

    /// `out` = the sum over the ranks of the first `n` floats of their partial sums in
    /// `slot`, on `stream`.
    pub fn all_reduce(&self, slot: usize, out: u64, n: usize, stream: &Arc<CudaStream>) -> Result<()> {
        match &self.reduce {
            Reduce::Peer(peer) => peer.all_reduce(slot, out, n, stream),
            Reduce::Nccl(comm) => comm.all_reduce_f32(self.partial(slot, stream), out, n, stream),
        }
    }
}

/// A rank other than the first, on its own thread: it runs each pass it is sent.
struct Worker {
    passes: Option<mpsc::Sender<Pass>>,
    done: mpsc::Receiver<Result<()>>,
    thread: Option<JoinHandle<()>>,
    /// Where rank 0's draws are copied on this GPU (twice `RankLink::capacity` words: a
    /// draw's tokens may sit after its seeded rows' words), and its context.
    drawn: CudaSlice<u32>,
    ctx: Arc<CudaContext>,
}

/// One pass for a rank: the batch, and where its tokens that rank 0 drew are (their words in
/// the copy of the draw's scratch, and the event after the copy).
struct Pass {
    batch: Arc<ForwardBatch>,
    drawn: Option<(u64, Vec<Option<u32>>, Arc<CudaEvent>)>,
}

pub struct TensorParallel {
    lead: CudaBackend,
    workers: Vec<Worker>,
    /// The whole model's shape.
    config: ModelConfig,
    /// Blocks every rank has: the smallest pool among them.
    layout: KvLayout,
    name: String,
    /// With `QUARRY_CUDA_TIMING`: where the host's time in `run` goes.
    host: Option<HostTimes>,
    /// The first error of a pass: the ranks' all-reduces may no longer pair up, so no pass
    /// runs after it.
    failed: Option<String>,
    /// How long rank 0 waits for another rank to queue its part of a pass before the group
    /// is given up (`QUARRY_TP_TIMEOUT`, seconds).
    timeout: std::time::Duration,
    /// The most tokens a pass may have (`RankLink::capacity`).
    capacity: usize,
}

/// `QUARRY_TP_TIMEOUT`'s default: a pass is queued in milliseconds, and loading or capturing
/// happens before the first.
const RANK_TIMEOUT_S: f64 = 30.0;

/// A fault put in on purpose (`QUARRY_TP_FAULT=stall:RANK:PASS` or `exit:RANK:PASS`, for the
/// fault tests): at its `pass`th pass (from 1) rank `rank` stops answering, or its thread
/// ends, as a rank that hangs or dies would.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    Stall { rank: usize, pass: u64 },
    Exit { rank: usize, pass: u64 },
}

impl Fault {
    fn from_env() -> Option<Fault> {
        let text = std::env::var("QUARRY_TP_FAULT").ok()?;
        let parts: Vec<&str> = text.split(':').collect();
        let (rank, pass) = match parts[..] {
            [_, r, p] => (r.parse().ok()?, p.parse().ok()?),
            _ => return None,
        };
        match parts[0] {
            "stall" => Some(Fault::Stall { rank, pass }),
            "exit" => Some(Fault::Exit { rank, pass }),
            _ => None,
        }
    }
}

/// Seconds of host time: copying the draw, rank 0's `run`, waiting for the other ranks, and
/// outside `run` (the engine), over `passes`.
#[derive(Default)]
struct HostTimes {
    share: f64,
    lead: f64,
    wait: f64,
    between: f64,
    passes: u64,
    last_end: Option<std::time::Instant>,
}

/// The whole model's shape, before any rank loads its part.
fn whole_config(source: &WeightSource<'_>) -> Result<ModelConfig> {
    match source {
        WeightSource::Gguf(path) => ModelConfig::from_gguf(&GgufFile::open(path)?),
        WeightSource::HuggingFace(dir) => Ok(crate::runtime::hf::config(dir)?.0),
        WeightSource::Dummy(config) => Ok(config.clone()),
    }
}

impl TensorParallel {
    /// The model split over `size` GPUs from `options.ordinal` on.
    pub fn load(source: WeightSource<'_>, options: &CudaOptions, size: usize) -> Result<Self> {
        let config = whole_config(&source)?;
        shard::check(&config, size)?;
        let count = CudaContext::device_count().map_err(device("counting GPUs"))? as usize;
        let ordinals: Vec<usize> = (options.ordinal..options.ordinal + size).collect();
        if ordinals.last().is_some_and(|&last| last >= count) {
            return Err(RuntimeError::Device(format!(
                "--tensor-parallel-size {size} from cuda:{} needs GPUs up to cuda:{}; this machine has {count}",
                options.ordinal,
                options.ordinal + size - 1
            )));
        }
        let contexts = ordinals
            .iter()
            .map(|&o| CudaContext::new(o).map_err(device("creating a context")))
            .collect::<Result<Vec<_>>>()?;
        // A step may pass the scheduler's budget by a shadow prompt (context-aware decoding's
        // twin runs its prompt with its request's sampling step, unchunked): room for twice
        // the budget covers twins' prompts up to the budget's length.
        let capacity = (2 * options.max_num_batched_tokens).max(options.max_num_seqs * MAX_PER_SEQ);
        let floats = capacity * config.hidden_size;
        let partials = contexts
            .iter()
            .map(|c| {
                c.default_stream()
                    .alloc_zeros::<f32>(2 * floats)
                    .map_err(device("partial sums"))
            })
            .collect::<Result<Vec<_>>>()?;
        for c in &contexts {
            c.synchronize().map_err(device("partial sums"))?;
        }
        let reduces = match PeerReduce::new(&contexts)? {
            Some(group) => {
                let group = Arc::new(group);
                let inputs: Vec<u64> = partials
                    .iter()
                    .zip(&contexts)
                    .map(|(p, c)| p.device_ptr(&c.default_stream()).0)
                    .collect();
                (0..size)
                    .map(|r| group.rank(r, &inputs, floats).map(Reduce::Peer))
                    .collect::<Result<Vec<_>>>()?
            }
            None => {
                let devices: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
                Group::local(Nccl::open()?, &devices)?
                    .into_ranks()
                    .into_iter()
                    .map(Reduce::Nccl)
                    .collect()
            }
        };
        if options.batch_invariant && matches!(reduces[0], Reduce::Nccl(_)) {
            return Err(RuntimeError::Device(
                "--batch-invariant with tensor parallelism needs GPUs that reach each other's memory (NCCL's all-reduce picks its order by message size)".into(),
            ));
        }
        let how = match reduces[0] {
            Reduce::Peer(_) => "the one-shot all-reduce through peer memory",
            Reduce::Nccl(_) => "NCCL (the GPUs do not reach each other's memory)",
        };
        let links =
            contexts
                .into_iter()
                .zip(reduces)
                .zip(partials)
                .enumerate()
                .map(|(rank, ((ctx, reduce), partial))| RankLink {
                    shard: Shard { rank, size },
                    ctx,
                    reduce,
                    partial,
                    slot_len: floats,
                    capacity,
                });
        // Every rank loads its shard at once, each on its own thread.
        let source = &source;
        let loaded: Vec<Result<CudaBackend>> = std::thread::scope(|s| {
            let loads: Vec<_> = links
                .map(|link| s.spawn(move || CudaBackend::load_rank(source, options, Some(link))))
                .collect();
            loads
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(RuntimeError::Device("a rank panicked while loading".into())))
                })
                .collect()
        });
        let mut ranks = loaded.into_iter().collect::<Result<Vec<_>>>()?;
        let layout = KvLayout {
            num_blocks: ranks.iter().map(|r| r.layout.num_blocks).min().unwrap_or(0),
            block_size: ranks[0].layout.block_size,
        };
        let name = format!("{size} x {} (tensor parallel)", ranks[0].device_name());
        eprintln!(
            "quarry: {name}: {} blocks of {} tokens a rank; all-reduce by {how}",
            layout.num_blocks, layout.block_size
        );
        let fault = Fault::from_env();
        if let Some(f) = fault {
            eprintln!("quarry: QUARRY_TP_FAULT puts in a fault on purpose: {f:?}");
        }
        let workers = ranks
            .drain(1..)
            .enumerate()
            .map(|(i, r)| Worker::start(r, capacity, fault, i + 1))
            .collect::<Result<Vec<_>>>()?;
        let timeout = std::env::var("QUARRY_TP_TIMEOUT")
            .ok()
            .and_then(|t| t.parse::<f64>().ok())
            .filter(|t| *t > 0.0)
            .unwrap_or(RANK_TIMEOUT_S);
        Ok(TensorParallel {
            lead: ranks.pop().expect("rank 0"),
            workers,
            config,
            layout,
            name,
            host: std::env::var_os("QUARRY_CUDA_TIMING").map(|_| HostTimes::default()),
            failed: None,
            timeout: std::time::Duration::from_secs_f64(timeout),
            capacity,
        })
    }
}

impl Worker {
    fn start(mut backend: CudaBackend, capacity: usize, fault: Option<Fault>, rank: usize) -> Result<Worker> {
        let ctx = backend.ctx.clone();
        let drawn = backend
            .stream
            .alloc_zeros::<u32>(2 * capacity.max(1))
            .map_err(device("room for rank 0's draws"))?;
        let (passes, jobs) = mpsc::channel::<Pass>();
        let (report, done) = mpsc::channel();
        let thread = std::thread::spawn(move || {
            let mut passes = 0;
            while let Ok(pass) = jobs.recv() {
                passes += 1;
                match fault {
                    Some(Fault::Exit { rank: r, pass: p }) if (r, p) == (rank, passes) => return,
                    Some(Fault::Stall { rank: r, pass: p }) if (r, p) == (rank, passes) => {
                        // Hung: no answer until the group is dropped.
                        while jobs.recv().is_ok() {}
                        return;
                    }
                    _ => {}
                }
                let mut result = Ok(());
                if let Some((words, token_word, ready)) = pass.drawn {
                    result = backend.stream.wait(&ready).map_err(device("waiting for rank 0's draw"));
                    backend.remote_draw = Some((words, token_word));
                }
                let result = result.and_then(|_| backend.run(&pass.batch));
                backend.remote_draw = None;
                if report.send(result).is_err() {
                    break;
                }
            }
        });
        Ok(Worker {
            passes: Some(passes),
            done,
            thread: Some(thread),
            drawn,
            ctx,
        })
    }
}

impl Drop for TensorParallel {
    fn drop(&mut self) {
        // Every rank done before any frees its partial sums: a rank past its last all-reduce
        // may free them while another still reads them.
        let _ = self.lead.ctx.synchronize();
        for w in &self.workers {
            let _ = w.ctx.synchronize();
        }
        if let Some(h) = &self.host {
            let ms = |s: f64| 1e3 * s / h.passes.max(1) as f64;
            eprintln!(
                "quarry tensor parallel host: {} passes; per pass: rank 0's draw shared {:.3} ms, rank 0's run {:.3} ms, waiting for the others {:.3} ms, outside run {:.3} ms",
                h.passes,
                ms(h.share),
                ms(h.lead),
                ms(h.wait),
                ms(h.between)
            );
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.passes.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl TensorParallel {
    /// Copies rank 0's last draw (the tokens' words of its scratch) to every other rank, on
    /// rank 0's stream after the draw: each row's word, and the event after the copies.
    fn share_draw(&self) -> Result<(Vec<Option<u32>>, Arc<CudaEvent>)> {
        let (scratch, token_word) = self
            .lead
            .last_draw()
            .ok_or_else(|| RuntimeError::InvalidBatch("tokens stand for a draw that did not happen".into()))?;
        let words = token_word.iter().flatten().max().map_or(0, |&w| w as usize + 1);
        let lead = &self.lead;
        for w in &self.workers {
            if words > w.drawn.len() {
                return Err(RuntimeError::InvalidBatch(format!(
                    "a draw of {words} tokens; a rank holds {}",
                    w.drawn.len()
                )));
            }
            let to = w.drawn.device_ptr(&w.ctx.default_stream()).0;
            // SAFETY: both buffers hold `words` u32s; the copy is queued after the draw.
            unsafe {
                sys::cuMemcpyPeerAsync(
                    to,
                    w.ctx.cu_ctx(),
                    scratch,
                    lead.ctx.cu_ctx(),
                    words * 4,
                    lead.stream.cu_stream(),
                )
            }
            .result()
            .map_err(device("copying rank 0's draw"))?;
        }
        let ready = lead
            .stream
            .record_event(None)
            .map_err(device("marking rank 0's draw"))?;
        Ok((token_word.to_vec(), Arc::new(ready)))
    }
}

impl Backend for TensorParallel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn run(&mut self, batch: &ForwardBatch) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(RuntimeError::Device(format!(
                "the tensor-parallel group stopped after an error ({why}); restart to use it again"
            )));
        }
        // A pass refused by one rank after the others queued theirs would leave their
        // all-reduces waiting for it: refuse it here, for all of them.
        let c = &self.config;
        let drawn: Vec<bool> = self
            .lead
            .last_draw()
            .map(|(_, words)| words.iter().map(Option::is_some).collect())
            .unwrap_or_default();
        batch.validate_drawing(self.layout, c.vocab_size, c.context_length, &drawn)?;
        if batch.num_tokens() > self.capacity {
            return Err(RuntimeError::InvalidBatch(format!(
                "{} tokens in one pass; a tensor-parallel group takes at most {}",
                batch.num_tokens(),
                self.capacity
            )));
        }
        let t0 = std::time::Instant::now();
        let shared = Arc::new(batch.clone());
        let draws = match batch.token_ids.iter().any(|t| t & FROM_LAST_DRAW != 0) {
            true => Some(self.share_draw()?),
            false => None,
        };
        let t1 = std::time::Instant::now();
        let gone = |r: usize| RuntimeError::Backend(format!("tensor-parallel rank {r} has stopped"));
        let mut result = Ok(());
        for (i, w) in self.workers.iter().enumerate() {
            let pass = Pass {
                batch: shared.clone(),
                drawn: draws.as_ref().map(|(token_word, ready)| {
                    (
                        w.drawn.device_ptr(&w.ctx.default_stream()).0,
                        token_word.clone(),
                        ready.clone(),
                    )
                }),
            };
            let sent = w.passes.as_ref().is_some_and(|p| p.send(pass).is_ok());
            if !sent && result.is_ok() {
                result = Err(gone(i + 1));
            }
        }
        // Rank 0 queues its pass while the others queue theirs; each waits only for its own
        // work, and their all-reduces meet on the GPUs.
        let lead = self.lead.run(batch);
        let t2 = std::time::Instant::now();
        for (i, w) in self.workers.iter().enumerate() {
            let r = match w.done.recv_timeout(self.timeout) {
                Ok(r) => r,
                Err(mpsc::RecvTimeoutError::Timeout) => Err(RuntimeError::Backend(format!(
                    "tensor-parallel rank {} did not queue its part of a pass within {:.0} s (QUARRY_TP_TIMEOUT): it hangs",
                    i + 1,
                    self.timeout.as_secs_f64()
                ))),
                Err(mpsc::RecvTimeoutError::Disconnected) => Err(gone(i + 1)),
            };
            if result.is_ok() {
                result = r.map_err(|e| RuntimeError::Backend(format!("tensor-parallel rank {}: {e}", i + 1)));
            }
        }
        if let Some(h) = &mut self.host {
            let t3 = std::time::Instant::now();
            h.between += h.last_end.map_or(0.0, |e| (t0 - e).as_secs_f64());
            h.share += (t1 - t0).as_secs_f64();
            h.lead += (t2 - t1).as_secs_f64();
            h.wait += (t3 - t2).as_secs_f64();
            h.passes += 1;
            h.last_end = Some(t3);
        }
        let result = lead.and(result);
        if let Err(e) = &result {
            eprintln!("quarry: a tensor-parallel pass failed: {e}; the group takes no more passes");
            self.failed = Some(e.to_string());
        }
        result
    }

    fn sample(&mut self, rows: &[RowRequest<'_>]) -> Result<Sampled> {
        self.lead.sample(rows)
    }

    fn broken(&self) -> Option<String> {
        self.failed.clone()
    }

    fn pipelines(&self) -> bool {
        true
    }

    fn launch_sample(&mut self, rows: &[RowRequest<'_>]) -> Result<()> {
        self.lead.launch_sample(rows)
    }

    fn collect(&mut self) -> Result<Sampled> {
        self.lead.collect()
    }

    fn redraw_within(&mut self, row: usize, mask: &[u32]) -> Result<RowDraw> {
        self.lead.redraw_within(row, mask)
    }

    fn draws_on_device(&self) -> bool {
        true
    }

    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn batch_invariant(&self) -> bool {
        self.lead.batch_invariant()
    }

    fn logits_rows_copied(&self) -> u64 {
        self.lead.logits_rows_copied()
    }

    fn graph_steps(&self) -> u64 {
        self.lead.graph_steps()
    }

    fn last_run_warmed_up(&self) -> bool {
        self.lead.last_run_warmed_up()
    }

    fn take_timing_report(&mut self) -> Option<String> {
        self.lead.take_timing_report()
    }
}
