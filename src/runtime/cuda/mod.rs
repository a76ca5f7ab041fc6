//! The CUDA backend: bf16 weights and a paged bf16 KV cache in device memory, kernels compiled
//! by NVRTC (kernels/*.cu), projections through our GEMV kernels and cuBLAS. The layer loop is
//! the shared model's (runtime/model.rs); step.rs queues its operations; the last norm and the
//! head run only on the rows whose logits are wanted.

mod attention;
mod gemm;
mod graphs;
mod kernels;
pub mod kv_transfer;
mod launcher;
pub mod nccl;
pub mod peer_reduce;
mod sample;
mod staging;
mod step;
pub mod tensor_parallel;
mod timing;
mod weights;

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use self::gemm::Gemm;
use self::graphs::{Graphs, Shape};
use self::kernels::Kernels;
use self::launcher::{launch, launch3, launch_items, launch_smem, Arg, ROW_THREADS, THREADS};
use self::staging::Staging;
use self::tensor_parallel::RankLink;
use self::timing::{Phase, Timing};
use self::weights::{CudaWeights, Weights};
use super::batch::{ForwardBatch, KvLayout};
use super::config::ModelConfig;
use super::error::{Result, RuntimeError};
use super::gguf::GgufFile;
use super::shard::Shard;
use super::{Backend, RowRequest, Sampled, FROM_LAST_DRAW};

/// Tokens per KV block.
pub const BLOCK_SIZE: usize = 16;

/// kernels/attention.cu's MAX_HEAD_DIM.
const MAX_HEAD_DIM: usize = 256;

pub struct CudaOptions {
    pub ordinal: usize,
    /// KV cache capacity in tokens (rounded up to whole blocks); else `kv_cache_bytes`; else
    /// `gpu_memory_utilization` of the device's memory, less what is in use after loading.
    pub kv_cache_tokens: Option<usize>,
    pub kv_cache_bytes: Option<u64>,
    pub gpu_memory_utilization: f32,
    /// The largest batch the engine will send: activation buffers are taken for it at load,
    /// before the KV cache is sized.
    pub max_num_batched_tokens: usize,
    /// Sequences a pass may hold: its graphs go up to this many, its logits are taken for them.
    pub max_num_seqs: usize,
    /// Replay regular steps from CUDA graphs (graphs.rs); off: `--enforce-eager`.
    pub graphs: bool,
    /// Every product sums a row in the GEMV's order whatever the batch (`--batch-invariant`).
    pub batch_invariant: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            ordinal: 0,
            kv_cache_tokens: None,
            kv_cache_bytes: None,
            gpu_memory_utilization: 0.9,
            max_num_batched_tokens: 2048,
            max_num_seqs: 128,
            graphs: true,
            batch_invariant: false,
        }
    }
}

/// Where the weights come from.
pub enum WeightSource<'a> {
    Gguf(&'a Path),
    /// A Hugging Face model directory.
    HuggingFace(&'a Path),
    /// Deterministic random weights of this shape.
    Dummy(ModelConfig),
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    gemm: Gemm,
    config: ModelConfig,
    weights: Weights,
    rope_cos: CudaSlice<f32>,
    rope_sin: CudaSlice<f32>,
    k_cache: Vec<CudaSlice<u16>>,
    v_cache: Vec<CudaSlice<u16>>,
    layout: KvLayout,
    buffers: Buffers,
    /// Blocks of attention that fill the GPU: fewer (token, head) pairs split their keys.
    target_blocks: usize,
    /// Rows of logits the last `run` left in `buffers.logits`.
    rows: usize,
    /// How the last draw drew each row (`None`: left to the engine).
    drawn: Vec<Option<sample::Drawn>>,
    /// Where the last draw's penalties and the values they replaced are on the device.
    penalties: sample::PenaltyArrays,
    /// The last draw's work: its scratch (tokens, the saved values a redraw puts back) and
    /// where its results lie.
    queued: Option<sample::Queued>,
    /// A pipelined draw's results, copied back asynchronously, and the event after the copy.
    readback: Option<PinnedHostSlice<u32>>,
    readback_done: Option<CudaEvent>,
    /// A pipelined draw's logits, kept for a redraw after the next pass overwrote them: the
    /// rows with a mask (only a constrained row is ever drawn again), at their own offsets.
    redraw_logits: CudaSlice<f32>,
    redraw_rows: Vec<bool>,
    /// An event after the copy into `redraw_logits`, and the stream a pipelined draw's redraws
    /// run on behind it (`sample::redraw`).
    redraw_ready: Option<CudaEvent>,
    redraw_stream: Arc<CudaStream>,
    /// The logits rows the last draw left to the engine, and which rows they are.
    host_logits: (Vec<f32>, Vec<bool>),
    /// The last draw was launched pipelined; it was not read yet; the run it drew; when.
    draw_pipelined: bool,
    draw_unread: bool,
    sampled_run: u64,
    draw_started: std::time::Instant,
    /// A pass ran after the last draw (whose logits it overwrote).
    run_since_draw: bool,
    /// Full logits rows copied to the host so far (`Backend::logits_rows_copied`).
    rows_copied: u64,
    /// The batch's uploads, in two buffers taken in turn: a pipelined pass is staged while the
    /// pass before it may not have been copied yet.
    run_staging: [Staging; 2],
    /// Passes staged so far, and the last whose upload the stream is known to have passed.
    run_index: u64,
    passed_run: u64,
    /// Under tensor parallelism, an event after each buffer's last upload.
    uploaded: [Option<CudaEvent>; 2],
    sample_staging: Staging,
    redraw_staging: Staging,
    /// The staged pass's tokens that the last draw decided on the device.
    fill: Option<Fill>,
    name: String,
    /// Disaggregated serving's links to other GPUs' engines, numbered as attached.
    kv_ports: Vec<kv_transfer::KvPort>,
    timing: Option<Timing>,
    /// None: every step runs eagerly (`--enforce-eager`, per-kernel timing, or heads the
    /// tensor-core attention does not take).
    graphs: Option<Graphs>,
    /// The last `run` captured its shape's graph, or ran eagerly while its shape waits for one.
    warmed_up_last_run: bool,
    /// This GPU's place in a tensor-parallel group (its shard of the model, the all-reduce).
    rank: Option<RankLink>,
    /// The next pass's tokens drawn on another GPU (a tensor-parallel group's first rank):
    /// the copy of that draw's scratch here, and each row's word in it.
    remote_draw: Option<(u64, Vec<Option<u32>>)>,
}

/// Where a staged pass's tokens decided by the last draw go (device addresses): its ids, the
/// positions among them, each one's word in the draw's scratch, the scratch.
#[derive(Clone, Copy)]
struct Fill {
    ids: u64,
    at: u64,
    word: u64,
    drawn: u64,
    count: usize,
}

/// Activations, sized for the largest batch seen (at least the one given at load).
struct Buffers {
    tokens: usize,
    rows: usize,
    x: CudaSlice<f32>,
    branch: CudaSlice<f32>,
    normed: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    /// The rotated queries, bf16, for attention.
    q: CudaSlice<u16>,
    attn: CudaSlice<u16>,
    gate_up: CudaSlice<f32>,
    act: CudaSlice<u16>,
    head_in: CudaSlice<u16>,
    logits: CudaSlice<f32>,
    /// The partitions of split attention (attention.rs).
    partials: CudaSlice<f32>,
}

impl Buffers {
    fn new(
        stream: &Arc<CudaStream>,
        cfg: &ModelConfig,
        tokens: usize,
        rows: usize,
        target_blocks: usize,
    ) -> Result<Self> {
        let (d, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let width = cfg.qkv_size();
        let oom = |e: cudarc::driver::DriverError| {
            RuntimeError::Device(format!(
                "out of device memory for the activations of {tokens} tokens: {e}"
            ))
        };
        Ok(Buffers {
            tokens,
            rows,
            x: stream.alloc_zeros(tokens * d).map_err(oom)?,
            branch: stream.alloc_zeros(tokens * d).map_err(oom)?,
            normed: stream.alloc_zeros(tokens * d).map_err(oom)?,
            qkv: stream.alloc_zeros(tokens * width).map_err(oom)?,
            q: stream.alloc_zeros(tokens * cfg.q_size()).map_err(oom)?,
            attn: stream.alloc_zeros(tokens * cfg.q_size()).map_err(oom)?,
            gate_up: stream.alloc_zeros(tokens * 2 * inter).map_err(oom)?,
            act: stream.alloc_zeros(tokens * inter).map_err(oom)?,
            head_in: stream.alloc_zeros(rows * d).map_err(oom)?,
            logits: stream.alloc_zeros(rows * cfg.vocab_size).map_err(oom)?,
            partials: stream
                .alloc_zeros(attention::general_scratch_len(target_blocks, cfg.head_dim).max(attention::SCRATCH_FLOATS))
                .map_err(oom)?,
        })
    }
}

fn device_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Backend(format!("{what}: {e}"))
}

impl CudaBackend {
    pub fn load(source: WeightSource<'_>, options: &CudaOptions) -> Result<Self> {
        Self::load_rank(&source, options, None)
    }

    /// The whole model (`rank` None), or one rank's shard of it, on the rank's context.
    pub(crate) fn load_rank(source: &WeightSource<'_>, options: &CudaOptions, rank: Option<RankLink>) -> Result<Self> {
        let ctx = match &rank {
            Some(link) => link.ctx.clone(),
            None => CudaContext::new(options.ordinal)
                .map_err(|e| RuntimeError::Device(format!("creating a context on cuda:{}: {e}", options.ordinal)))?,
        };
        let ordinal = ctx.ordinal();
        // One stream does all the work in order, so cudarc's per-buffer events are not needed.
        // SAFETY: no buffer is used on another stream.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy default stream cannot be captured into a graph.
        let stream = ctx
            .new_stream()
            .map_err(|e| RuntimeError::Device(format!("creating a stream on cuda:{ordinal}: {e}")))?;
        let kernels = Kernels::load(&ctx)?;
        let shard = rank.as_ref().map_or(Shard::WHOLE, |link| link.shard);
        let (whole, weights) = match source {
            WeightSource::Gguf(path) => {
                let mut gguf = GgufFile::open(path)?;
                let config = ModelConfig::from_gguf(&gguf)?;
                let weights = CudaWeights::from_gguf(&mut gguf, &config, shard, &stream)?;
                (config, weights)
            }
            WeightSource::HuggingFace(dir) => {
                let (config, tied) = super::hf::config(dir)?;
                let weights = CudaWeights::from_hf(dir, &config, tied, shard, &stream)?;
                (config, weights)
            }
            WeightSource::Dummy(config) => {
                let weights = CudaWeights::dummy(&shard.config(config), shard, &stream, &kernels)?;
                (config.clone(), weights)
            }
        };
        // The kernels see the heads and the MLP width this GPU computes.
        let config = shard.config(&whole);
        // The attention kernel holds a head in registers and shared memory of 256 values.
        if config.head_dim > MAX_HEAD_DIM {
            return Err(RuntimeError::BadMetadata {
                key: "head_dim".into(),
                reason: format!(
                    "{}: the GPU backend supports heads of up to {MAX_HEAD_DIM}",
                    config.head_dim
                ),
            });
        }
        // Other heads take the general attention kernel, whose split of the keys follows the
        // batch.
        if options.batch_invariant && !attention::flash_head(config.head_dim) {
            return Err(RuntimeError::Device(format!(
                "--batch-invariant needs attention heads of 64 or 128 values (the flash kernel's fixed partitions of the keys); this model's have {}",
                config.head_dim
            )));
        }
        let (cos, sin) = super::cpu::rope_tables(config.head_dim, config.rope_theta, config.context_length);
        let rope_cos = stream.clone_htod(&cos).map_err(device_err("rope tables"))?;
        let rope_sin = stream.clone_htod(&sin).map_err(device_err("rope tables"))?;
        // Enough blocks of attention to keep every SM busy with a few each.
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(device_err("reading the number of multiprocessors"))?;
        let target_blocks = 4 * sms.max(1) as usize;
        let buffers = Buffers::new(
            &stream,
            &config,
            options.max_num_batched_tokens.max(1),
            options.max_num_seqs.max(1),
            target_blocks,
        )?;
        // The batch-invariant products' x in the mma's order: room for a step of the batched
        // tokens at the widest k; a larger step (shadow prompts, graph padding) skips the pass,
        // with the same bits.
        let widest = config.hidden_size.max(config.intermediate_size).max(config.q_size());
        let scratch = options.max_num_batched_tokens.max(1) * widest;
        let gemm = Gemm::new(stream.clone(), &kernels, options.batch_invariant, scratch)?;
        stream.synchronize().map_err(device_err("loading the weights"))?;

        // The KV cache takes what is left of the memory budget.
        let kv_bytes_per_token = 2 * config.num_layers * config.kv_size() * 2;
        let tokens = match (options.kv_cache_tokens, options.kv_cache_bytes) {
            (Some(t), _) => t,
            (None, Some(b)) => (b / kv_bytes_per_token as u64) as usize,
            (None, None) => {
                let (free, total) = ctx.mem_get_info().map_err(device_err("reading free memory"))?;
                let budget = (total as f64 * options.gpu_memory_utilization as f64) as i64 - (total - free) as i64;
                if budget <= 0 {
                    return Err(RuntimeError::Device(format!(
                        "no memory left for the KV cache: {} MiB of {} MiB in use after loading, the budget is {}",
                        (total - free) >> 20,
                        total >> 20,
                        options.gpu_memory_utilization
                    )));
                }
                budget as usize / kv_bytes_per_token
            }
        };
        let layout = KvLayout {
            // Slots are u32 in batches, and the attention kernels address a layer's cache with
            // 32-bit element offsets.
            num_blocks: tokens
                .div_ceil(BLOCK_SIZE)
                .clamp(1, u32::MAX as usize / BLOCK_SIZE / config.kv_size() - 1),
            block_size: BLOCK_SIZE,
        };
        // One block past the pool is the padded rows' of captured steps (graphs.rs).
        let per_layer = (layout.num_blocks + 1) * layout.block_size * config.kv_size();
        let mut k_cache = Vec::with_capacity(config.num_layers);
        let mut v_cache = Vec::with_capacity(config.num_layers);
        for li in 0..config.num_layers {
            let oom = |e| {
                RuntimeError::Device(format!(
                    "out of device memory for layer {li}'s KV cache ({} blocks): {e}",
                    layout.num_blocks
                ))
            };
            // SAFETY: every slot is written by the cache kernel before attention reads it.
            k_cache.push(unsafe { stream.alloc::<u16>(per_layer) }.map_err(oom)?);
            v_cache.push(unsafe { stream.alloc::<u16>(per_layer) }.map_err(oom)?);
        }
        let name = format!(
            "cuda:{ordinal} ({})",
            ctx.name().unwrap_or_else(|_| "unknown GPU".into())
        );
        if let Ok((free, total)) = ctx.mem_get_info() {
            let kv_bytes = 2 * config.num_layers * per_layer * 2;
            eprintln!(
                "quarry: {name}: {} MiB of {} MiB in use, of which the KV cache {} MiB ({} blocks of {BLOCK_SIZE} tokens)",
                (total - free) >> 20,
                total >> 20,
                kv_bytes >> 20,
                layout.num_blocks
            );
        }
        if options.batch_invariant && shard.leads() {
            eprintln!("quarry: {name}: batch-invariant: every product sums a row in one order for any number of rows");
        }
        let timing = Timing::from_env(&ctx);
        let run_staging = [
            Staging::new(&ctx, &stream, 1 << 16, "the batch")?,
            Staging::new(&ctx, &stream, 1 << 16, "the batch")?,
        ];
        let sample_staging = Staging::new(&ctx, &stream, 1 << 16, "sampling inputs")?;
        let redraw_logits = stream.alloc_zeros::<f32>(1).map_err(device_err("sampling"))?;
        let redraw_staging = Staging::new(&ctx, &stream, 1 << 12, "a redraw's inputs")?;
        let redraw_stream = ctx.new_stream().map_err(device_err("sampling"))?;
        let graphs = if options.graphs
            && attention::flash_head(config.head_dim)
            && timing.as_ref().is_none_or(|t| !t.per_phase())
        {
            let (seqs, group) = (options.max_num_seqs.max(1), config.num_heads / config.num_kv_heads);
            let max_parts = attention::part_units(config.context_length).next_power_of_two();
            let tokens = seqs * graphs::MAX_PER_SEQ;
            // Ids, positions, slots, sequences, picked rows and split attention's bases, and
            // the places and words of tokens the last draw decided; tables; flash items.
            let items = seqs * attention::items_of(graphs::MAX_PER_SEQ, group);
            let words = 8 * tokens + 8 + seqs * max_parts * (attention::FLASH_PART / BLOCK_SIZE) + 4 * items;
            let free = graphs::free_padding(config.macs_per_token());
            Some(Graphs::new(&stream, seqs, max_parts, free, words)?)
        } else {
            None
        };
        let mut backend = CudaBackend {
            ctx,
            stream,
            kernels,
            gemm,
            config,
            weights,
            rope_cos,
            rope_sin,
            k_cache,
            v_cache,
            layout,
            buffers,
            target_blocks,
            rows: 0,
            drawn: Vec::new(),
            penalties: Default::default(),
            queued: None,
            readback: None,
            readback_done: None,
            redraw_logits,
            redraw_rows: Vec::new(),
            redraw_ready: None,
            redraw_stream,
            host_logits: Default::default(),
            draw_pipelined: false,
            draw_unread: false,
            sampled_run: 0,
            draw_started: std::time::Instant::now(),
            run_since_draw: false,
            rows_copied: 0,
            run_staging,
            run_index: 0,
            passed_run: 0,
            uploaded: [None, None],
            sample_staging,
            redraw_staging,
            fill: None,
            name,
            kv_ports: Vec::new(),
            timing,
            graphs,
            warmed_up_last_run: false,
            rank,
            remote_draw: None,
        };
        backend.capture_decode_graphs(&[1, 2])?;
        Ok(backend)
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    fn mark(&self, phase: Phase) {
        if let Some(t) = &self.timing {
            t.mark(phase, &self.stream);
        }
    }
}

impl CudaBackend {
    /// The KV block padded rows of a captured step read and write: one past the pool the
    /// engine sees.
    fn reserved_block(&self) -> u32 {
        self.layout.num_blocks as u32
    }

    /// What decides whether a step's attention is split.
    fn split_rule(&self) -> attention::SplitRule {
        attention::SplitRule {
            head_dim: self.config.head_dim,
            heads: self.config.num_heads,
            kv_heads: self.config.num_kv_heads,
            target_blocks: self.target_blocks,
        }
    }

    /// Whether `batch` padded to `shape` splits its attention: its padding adds one item a
    /// padded sequence's tokens and one partition a padded token (at position 0).
    fn shape_splits(&self, batch: &ForwardBatch, shape: &Shape) -> bool {
        let padding = shape.seqs * shape.per_seq - batch.num_tokens();
        let partitions = batch.positions.iter().map(|&p| attention::partitions(p)).sum::<usize>() + padding;
        let skewed = attention::long_rows_dominate(&batch.context_lens, self.config.num_kv_heads, self.target_blocks);
        self.splits(shape, partitions, skewed)
    }

    /// The split rule's choice for a step of `shape` whose query tokens reach `partitions`
    /// partitions in all.
    fn splits(&self, shape: &Shape, partitions: usize, skewed: bool) -> bool {
        let group = self.config.num_heads / self.config.num_kv_heads;
        let items = shape.seqs * attention::items_of(shape.per_seq, group);
        self.split_rule()
            .split(items, shape.seqs, shape.max_len(), partitions, skewed)
    }

    /// A step over the backend's buffers with `meta`; `timed`: with `QUARRY_CUDA_TIMING`'s
    /// events (never inside a capture, which would replay one event forever).
    fn step(&self, meta: step::Meta, timed: bool) -> step::CudaStep<'_> {
        let b = &self.buffers;
        step::CudaStep {
            stream: &self.stream,
            kernels: &self.kernels,
            gemm: &self.gemm,
            cfg: &self.config,
            timing: self.timing.as_ref().filter(|_| timed),
            rope: (self.ptr(&self.rope_cos), self.ptr(&self.rope_sin)),
            k_cache: &self.k_cache,
            v_cache: &self.v_cache,
            meta,
            buf: step::Buffers {
                x: self.ptr(&b.x),
                normed: self.ptr(&b.normed),
                qkv: self.ptr(&b.qkv),
                q: self.ptr(&b.q),
                attn: self.ptr(&b.attn),
                branch: self.ptr(&b.branch),
                gate_up: self.ptr(&b.gate_up),
                hidden: self.ptr(&b.act),
                head_in: self.ptr(&b.head_in),
                logits: self.ptr(&b.logits),
                partials: self.ptr(&b.partials),
            },
            rank: self.rank.as_ref(),
            reduce_slot: 0,
            branch_in_stream: false,
            pending_norm: None,
        }
    }

    /// Copies `batch`'s metadata to the device in one transfer (to the graphs' fixed buffer
    /// where the step has a captured shape) and describes it.
    fn stage(&mut self, batch: &ForwardBatch, shape: Option<Shape>, graphs: Option<&Graphs>) -> Result<step::Meta> {
        let cfg = &self.config;
        let t = batch.num_tokens();
        let rows = batch.logits_rows.len();
        let max_blocks = match shape {
            Some(s) => s.table_width(),
            None => attention::table_width(batch.block_tables.iter().map(Vec::len).max().unwrap_or(1)),
        };
        // The buffer this pass takes was the pass before last's: its upload must be done.
        self.run_index += 1;
        let slot = (self.run_index % 2) as usize;
        if self.passed_run + 2 < self.run_index {
            match self.uploaded[slot].take() {
                // That upload alone, not the passes queued since (a rank that never draws
                // would otherwise wait for its last pass every other step).
                Some(done) => {
                    done.synchronize().map_err(device_err("finishing an earlier upload"))?;
                    self.passed_run = self.run_index - 2;
                }
                None => {
                    self.stream
                        .synchronize()
                        .map_err(device_err("finishing an earlier step"))?;
                    self.passed_run = self.run_index - 1;
                }
            }
        }
        let fills = self.drawn_token_fills(batch)?;
        let st = &mut self.run_staging[slot];
        st.clear();
        let ids = st.push(&batch.token_ids)?;
        let positions = st.push(&batch.positions)?;
        let slots = st.push(&batch.slot_mapping)?;
        let seqs = st.push_with(t, |dst| {
            for i in 0..batch.num_seqs() {
                let (lo, hi) = (batch.query_start[i] as usize, batch.query_start[i + 1] as usize);
                dst[lo..hi].fill(i as u32);
            }
        })?;
        st.align(4)?;
        let tables = st.push_with(batch.num_seqs() * max_blocks, |dst| {
            for (i, table) in batch.block_tables.iter().enumerate() {
                let row = &mut dst[i * max_blocks..(i + 1) * max_blocks];
                let n = table.len().min(max_blocks);
                row[..n].copy_from_slice(&table[..n]);
                row[n..].fill(0);
            }
        })?;
        let picked = st.push(if rows > 0 { &batch.logits_rows } else { &[0] })?;
        let flash_items = attention::flash_items(batch, cfg.num_heads / cfg.num_kv_heads);
        let items = st.push(if flash_items.is_empty() { &[0] } else { &flash_items })?;
        let mut partitions = 0;
        let bases = st.push_with(t, |dst| partitions = attention::part_bases(&batch.positions, dst))?;
        let fill_at = st.push(&fills.0)?;
        let fill_word = st.push(&fills.1)?;
        let base = match (shape, graphs) {
            (Some(_), Some(g)) => st.send_to(&self.stream, g.meta_addr(&self.stream), g.meta_words())?,
            _ => st.send(&self.stream)?,
        };
        if self.rank.is_some() {
            let done = self
                .stream
                .record_event(None)
                .map_err(device_err("marking an upload"))?;
            self.uploaded[slot] = Some(done);
        }
        let addr = |offset: usize| Staging::addr(base, offset);
        let (max_len, split) = match shape {
            Some(s) => (s.max_len(), s.split),
            None => {
                let max_len = batch.context_lens.iter().copied().max().unwrap_or(1) as usize;
                let skewed = attention::long_rows_dominate(&batch.context_lens, cfg.num_kv_heads, self.target_blocks);
                let (items, seqs) = (flash_items.len() / 4, batch.num_seqs());
                (
                    max_len,
                    self.split_rule().split(items, seqs, max_len, partitions, skewed),
                )
            }
        };
        let plan = attention::Plan::new(
            cfg.head_dim,
            cfg.num_heads,
            t,
            max_len,
            addr(items),
            flash_items.len() / 4,
            self.target_blocks,
            split.then(|| addr(bases)),
        );
        self.fill = (!fills.0.is_empty()).then(|| Fill {
            ids: addr(ids),
            at: addr(fill_at),
            word: addr(fill_word),
            drawn: fills.2,
            count: fills.0.len(),
        });
        Ok(step::Meta {
            ids: addr(ids),
            positions: addr(positions),
            slots: addr(slots),
            seqs: addr(seqs),
            tables: addr(tables),
            max_blocks,
            block_size: self.layout.block_size,
            picked: addr(picked),
            tokens: t,
            rows,
            max_len,
            plan,
        })
    }

    /// The tokens of `batch` that stand for the last draw's (`FROM_LAST_DRAW`): their places,
    /// their words in that draw's scratch, and the scratch's address.
    fn drawn_token_fills(&self, batch: &ForwardBatch) -> Result<(Vec<u32>, Vec<u32>, u64)> {
        let (mut at, mut words) = (Vec::new(), Vec::new());
        if !batch.token_ids.iter().any(|t| t & FROM_LAST_DRAW != 0) {
            return Ok((at, words, 0));
        }
        let (scratch, token_word) = self
            .draw_source()
            .ok_or_else(|| RuntimeError::InvalidBatch("tokens stand for a draw that did not happen".into()))?;
        for (i, &t) in batch.token_ids.iter().enumerate() {
            if t & FROM_LAST_DRAW == 0 {
                continue;
            }
            let row = (t & !FROM_LAST_DRAW) as usize;
            let word = token_word.get(row).copied().flatten().ok_or_else(|| {
                RuntimeError::InvalidBatch(format!(
                    "a token stands for row {row} of the last draw, which did not draw it"
                ))
            })?;
            at.push(i as u32);
            words.push(word);
        }
        Ok((at, words, scratch))
    }

    /// Where the last draw's tokens are on this GPU, and each row's word among them: this
    /// backend's own draw, or one made on another GPU and copied here.
    fn draw_source(&self) -> Option<(u64, &[Option<u32>])> {
        match &self.remote_draw {
            Some((words, token_word)) => Some((*words, token_word)),
            None => self.last_draw(),
        }
    }

    /// Writes the staged pass's tokens that the last draw decided into its ids.
    fn take_drawn_tokens(&mut self) -> Result<()> {
        let Some(f) = self.fill.take() else { return Ok(()) };
        let count = f.count as i32;
        launch_items(
            &self.stream,
            &self.kernels.take_drawn_tokens,
            f.count,
            &[&f.ids, &f.at, &f.word, &f.drawn, &count],
        )
    }

    /// Queues `batch`'s forward: replayed from `shape`'s graph (captured first where it is new;
    /// `launch` false only captures), else eagerly. A shape whose capture fails runs eagerly.
    fn queue_step(
        &mut self,
        batch: &ForwardBatch,
        shape: Option<Shape>,
        graphs: Option<&mut Graphs>,
        launch: bool,
    ) -> Result<()> {
        let meta = self.stage(batch, shape, graphs.as_deref())?;
        let (Some(shape), Some(graphs)) = (shape, graphs) else {
            self.take_drawn_tokens()?;
            return self.weights.forward(&mut self.step(meta, true));
        };
        if !graphs.ready(shape) {
            let mut step = self.step(meta, false);
            let weights = &self.weights;
            if let Err(e) = graphs.capture(&self.stream, shape, || weights.forward(&mut step)) {
                // A rank of a group that ran this shape eagerly from now on would pad later
                // batches unlike the others, and their all-reduces would no longer pair up.
                if self.rank.is_some() {
                    return Err(RuntimeError::Device(format!(
                        "a tensor-parallel rank could not capture a step: {e}"
                    )));
                }
                eprintln!("quarry: {e}; steps of that shape run without a graph");
                return if launch {
                    self.take_drawn_tokens()?;
                    self.weights.forward(&mut self.step(meta, true))
                } else {
                    Ok(())
                };
            }
        }
        if !launch {
            return Ok(());
        }
        self.take_drawn_tokens()?;
        // Step mode's first event goes outside the graph.
        self.mark(Phase::Elementwise);
        graphs.launch(shape)
    }

    /// Captures decode steps (one token a sequence) up the whole ladder for contexts of up to
    /// `parts` partitions, so that the first steps of a server do not pay for their capture.
    fn capture_decode_graphs(&mut self, parts: &[usize]) -> Result<()> {
        let Some(mut graphs) = self.graphs.take() else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        // The split a decode step of that shape takes where no long row sets the pace (the
        // rule's records counted for every row reaching the shape's partitions, an upper
        // bound): what `shape_splits` gives the common decode batch.
        let this = &*self;
        let shapes: Vec<Shape> = parts
            .iter()
            .filter(|&&p| p <= graphs.max_parts)
            .flat_map(|&p| {
                graphs.ladder.iter().map(move |&seqs| {
                    let shape = Shape {
                        seqs,
                        per_seq: 1,
                        parts: p,
                        rows: seqs,
                        split: false,
                    };
                    Shape {
                        split: this.splits(&shape, seqs * p, false),
                        ..shape
                    }
                })
            })
            .collect();
        let mut result = Ok(());
        for shape in shapes {
            let pads = graphs::padded(&ForwardBatch::default(), shape, self.reserved_block());
            if pads.num_tokens() > self.buffers.tokens || pads.logits_rows.len() > self.buffers.rows {
                continue;
            }
            result = self.queue_step(&pads, Some(shape), Some(&mut graphs), false);
            if result.is_err() {
                break;
            }
        }
        let captured = graphs.count();
        self.graphs = Some(graphs);
        result?;
        // The captures staged (unread) metadata through the pinned buffer a step reuses.
        self.stream.synchronize().map_err(device_err("capturing graphs"))?;
        let free = self.ctx.mem_get_info().map(|(free, _)| free >> 20).unwrap_or(0);
        eprintln!(
            "quarry: {}: {captured} CUDA graphs captured in {} ms ({free} MiB free after); --enforce-eager runs without them",
            self.name,
            started.elapsed().as_millis()
        );
        Ok(())
    }
}

/// Queues SiLU-and-multiply of `rows` rows of the stacked [gate | up] projection.
fn silu_mul(stream: &CudaStream, k: &Kernels, gate_up: u64, act: u64, rows: usize, inter: usize) -> Result<()> {
    let total = (rows * inter) as i64;
    let inter32 = inter as i32;
    let args: [&dyn Arg; 4] = [&gate_up, &act, &inter32, &total];
    // Four values a thread where rows keep 16-byte alignment: the same values, half the time
    // at 256 rows and more (scripts/flash-bench/norm-run).
    match inter % 4 {
        0 => launch_items(stream, &k.silu_mul4, rows * inter / 4, &args),
        _ => launch_items(stream, &k.silu_mul, rows * inter, &args),
    }
}

fn no_kv_link(link: usize) -> RuntimeError {
    RuntimeError::Backend(format!("no KV link {link} is attached"))
}

impl CudaBackend {
    fn check_kv_blocks(&self, blocks: &[u32]) -> Result<()> {
        match blocks.iter().find(|&&b| b as usize >= self.layout.num_blocks) {
            Some(b) => Err(RuntimeError::InvalidBatch(format!(
                "KV transfer names block {b} of a pool of {}",
                self.layout.num_blocks
            ))),
            None => Ok(()),
        }
    }
}

impl Backend for CudaBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn batch_invariant(&self) -> bool {
        self.gemm.invariant()
    }

    fn attach_kv_link(&mut self, end: crate::runtime::KvLinkEnd) -> Result<usize> {
        let crate::runtime::KvLinkEnd::Nccl(end) = end else {
            return Err(RuntimeError::Backend(
                "a GPU backend moves KV blocks over NCCL, not through host memory".into(),
            ));
        };
        let block_elems = self.layout.block_size * self.config.kv_size();
        self.kv_ports.push(kv_transfer::KvPort::new(
            end,
            &self.ctx,
            &self.k_cache,
            &self.v_cache,
            block_elems,
        )?);
        Ok(self.kv_ports.len() - 1)
    }

    fn send_kv_blocks(&mut self, link: usize, blocks: &[u32]) -> Result<u64> {
        self.check_kv_blocks(blocks)?;
        let port = self.kv_ports.get_mut(link).ok_or_else(|| no_kv_link(link))?;
        port.send(&self.kernels.kv_gather, blocks, &self.stream)
    }

    fn recv_kv_blocks(&mut self, link: usize, blocks: &[u32]) -> Result<u64> {
        self.check_kv_blocks(blocks)?;
        let port = self.kv_ports.get_mut(link).ok_or_else(|| no_kv_link(link))?;
        port.recv(&self.kernels.kv_scatter, blocks, &self.stream)
    }

    fn kv_transfers_done(&mut self, link: usize) -> Result<u64> {
        self.kv_ports.get_mut(link).map_or(Ok(0), |p| p.done())
    }

    fn run(&mut self, batch: &ForwardBatch) -> Result<()> {
        let started = std::time::Instant::now();
        let cfg = self.config.clone();
        let drawn: Vec<bool> = self
            .draw_source()
            .map(|(_, words)| words.iter().map(Option::is_some).collect())
            .unwrap_or_default();
        batch.validate_drawing(self.layout, cfg.vocab_size, cfg.context_length, &drawn)?;
        self.rows = 0;
        self.run_since_draw = true;
        let mut graphs = self.graphs.take();
        let shape = graphs
            .as_mut()
            .and_then(|g| g.shape_for(batch, |s| self.shape_splits(batch, s)));
        let padded = shape.map(|s| graphs::padded(batch, s, self.reserved_block()));
        let step_batch = padded.as_ref().unwrap_or(batch);
        let (t, rows) = (step_batch.num_tokens(), step_batch.logits_rows.len());
        if t > self.buffers.tokens || rows > self.buffers.rows {
            // The group's all-reduce reads every rank's partial sums at addresses fixed at load.
            if let Some(link) = self.rank.as_ref().filter(|link| t > link.capacity) {
                let e = RuntimeError::InvalidBatch(format!(
                    "{t} tokens in one pass; a tensor-parallel group takes at most {}",
                    link.capacity
                ));
                self.graphs = graphs;
                return Err(e);
            }
            self.buffers = Buffers::new(
                &self.stream,
                &cfg,
                t.max(self.buffers.tokens),
                rows.max(self.buffers.rows),
                self.target_blocks,
            )?;
            // Captured graphs address the old activations.
            if let Some(g) = graphs.as_mut() {
                g.forget();
            }
        }
        let before = graphs.as_ref().map_or(0, Graphs::count);
        let result = self.queue_step(step_batch, shape, graphs.as_mut(), true);
        // A capture, or an eager step while its shape waits for one, costs more than the
        // shape's replays will: the speculation choice's fits leave both out.
        self.warmed_up_last_run = graphs.as_ref().is_some_and(|g| g.count() > before || g.awaited_last());
        self.graphs = graphs;
        result?;
        self.rows = batch.logits_rows.len();
        if let Some(timing) = &self.timing {
            let shape = timing::StepShape {
                tokens: batch.num_tokens(),
                seqs: batch.num_seqs(),
                longest: batch.longest_query().unwrap_or(0),
                graph: shape.is_some(),
            };
            timing.finish(&self.stream, started, false, shape);
        }
        Ok(())
    }

    fn sample(&mut self, requests: &[RowRequest<'_>]) -> Result<Sampled> {
        self.sample_rows(requests)
    }

    fn pipelines(&self) -> bool {
        true
    }

    fn launch_sample(&mut self, rows: &[RowRequest<'_>]) -> Result<()> {
        self.launch_rows(rows, true)
    }

    fn collect(&mut self) -> Result<Sampled> {
        if !self.draw_unread {
            return Err(RuntimeError::Backend("no draw to collect".into()));
        }
        self.collect_rows()
    }

    fn redraw_within(&mut self, row: usize, mask: &[u32]) -> Result<super::RowDraw> {
        self.redraw(row, mask)
    }

    fn draws_on_device(&self) -> bool {
        true
    }

    fn logits_rows_copied(&self) -> u64 {
        self.rows_copied
    }

    fn last_run_warmed_up(&self) -> bool {
        self.warmed_up_last_run
    }

    fn graph_steps(&self) -> u64 {
        self.graphs.as_ref().map_or(0, Graphs::replays)
    }

    fn take_timing_report(&mut self) -> Option<String> {
        let _ = self.stream.synchronize();
        let graphs = self.graphs.as_ref().map(Graphs::report);
        self.timing.as_ref().map(|t| {
            [Some(t.take_report()), graphs]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join("\n")
        })
    }
}

#[cfg(test)]
mod tests;

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
        if let Some(t) = &self.timing {
            eprintln!("{}", t.take_report());
            if let Some(g) = &self.graphs {
                eprintln!("{}", g.report());
            }
        }
    }
}
