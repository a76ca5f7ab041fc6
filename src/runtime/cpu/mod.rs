//! The CPU backend: quantized GGUF weights (candle), our Q4_1 kernel, paged attention over a
//! host KV pool, all cores through candle's barrier pool.

mod attention;
mod exp;
mod kv_cache;
mod linear;
mod ops;
mod pool;
mod step;
pub use pool::prefer_parking;
pub mod q4_1;
pub mod q4_1_x16;
pub mod q4_1_x8;
pub mod q8_0_x16;
pub mod q8_0_x8;
mod weights;

use std::path::Path;

pub use attention::MAX_GROUP as MAX_HEAD_GROUP;
use kv_cache::KvCache;
pub use ops::rope_tables;
use ops::Rope;
use step::CpuStep;
use weights::{CpuWeights, ModelWeights};

use super::batch::{ForwardBatch, KvLayout, Logits};
use super::config::ModelConfig;
use super::error::{Result, RuntimeError};
use super::gguf::GgufFile;
use super::model;
use super::{Backend, HostLink, KvLinkEnd, RowRequest, Sampled};

/// When the KV pool's pages are backed by memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Prefault {
    /// As blocks are first written (the kernel's default): a one-off command takes only the
    /// memory it uses.
    #[default]
    OnUse,
    /// Before `load` returns: a server's footprint is flat from its start and no step pays
    /// for page faults; benchmarks time the engine, not the kernel's page zeroing.
    AtLoad,
}

pub struct CpuOptions {
    /// KV cache capacity in tokens, rounded up to whole blocks.
    pub kv_cache_tokens: usize,
    /// KV cache capacity in bytes of host memory; overrides `kv_cache_tokens` when set.
    pub kv_cache_bytes: Option<u64>,
    /// When the KV cache's memory is taken from the system.
    pub prefault_kv: Prefault,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions {
            kv_cache_tokens: 16 * 1024,
            kv_cache_bytes: None,
            prefault_kv: Prefault::OnUse,
        }
    }
}

pub struct CpuBackend {
    config: ModelConfig,
    /// The last pass's logits, until `sample` hands them over.
    logits: Logits,
    weights: ModelWeights,
    rope: Rope,
    kv: KvCache,
    buffers: Buffers,
    /// Disaggregated serving's links to other engines' backends, each with the transfers
    /// queued on it (each done as it is queued: the host copies at once).
    kv_links: Vec<(HostLink, u64)>,
}

/// Activations of one forward pass, `[tokens, width]` each.
#[derive(Default)]
pub(crate) struct Buffers {
    /// A normalized residual stream, the input of attention and of the MLP.
    normed: Vec<f32>,
    /// The output of attention or of the MLP, before it joins the residual stream.
    branch: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
}

impl Buffers {
    fn get(&mut self, act: model::Act) -> &mut Vec<f32> {
        match act {
            model::Act::Normed => &mut self.normed,
            model::Act::Qkv => &mut self.qkv,
            model::Act::Attn => &mut self.attn,
            model::Act::Branch => &mut self.branch,
            model::Act::GateUp => &mut self.gate_up,
            model::Act::Hidden => &mut self.act,
        }
    }
}

impl CpuBackend {
    pub fn load(path: &Path, options: &CpuOptions) -> Result<Self> {
        let mut gguf = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&gguf)?;
        let weights = CpuWeights::load(&mut gguf, &config)?;
        let rope = Rope::new(
            config.head_dim,
            config.rope_theta,
            config.context_length,
            config.rope_style,
        );
        // The attention kernel works on whole blocks of this size.
        let block_size = attention::BLOCK;
        let layout = KvLayout {
            num_blocks: options
                .kv_cache_bytes
                .map_or(options.kv_cache_tokens, |bytes| {
                    (bytes / KvCache::bytes_per_token(config.num_layers, config.kv_size()) as u64) as usize
                })
                .div_ceil(block_size)
                .max(1),
            block_size,
        };
        let kv = KvCache::new(layout, config.num_layers, config.num_kv_heads, config.head_dim);
        if options.prefault_kv == Prefault::AtLoad {
            kv.prefault();
        }
        Ok(CpuBackend {
            config,
            logits: Logits::default(),
            weights,
            rope,
            kv,
            buffers: Buffers::default(),
            kv_links: Vec::new(),
        })
    }
}

impl CpuBackend {
    /// Attached link `link`, once `blocks` are known to lie in the pool.
    fn link(&mut self, link: usize, blocks: &[u32]) -> Result<&mut (HostLink, u64)> {
        let total = self.kv.layout().num_blocks;
        if let Some(b) = blocks.iter().find(|&&b| b as usize >= total) {
            return Err(RuntimeError::InvalidBatch(format!(
                "KV transfer names block {b} of a pool of {total}"
            )));
        }
        self.kv_links
            .get_mut(link)
            .ok_or_else(|| RuntimeError::Backend(format!("no KV link {link} is attached")))
    }
}

impl Backend for CpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_layout(&self) -> KvLayout {
        self.kv.layout()
    }

    fn device_name(&self) -> String {
        format!("cpu ({} threads)", pool::num_threads())
    }

    /// Each row is computed on its own, in the same order, whatever the batch.
    fn batch_invariant(&self) -> bool {
        true
    }

    fn attach_kv_link(&mut self, end: KvLinkEnd) -> Result<usize> {
        match end {
            KvLinkEnd::Host(link) => {
                self.kv_links.push((link, 0));
                Ok(self.kv_links.len() - 1)
            }
            KvLinkEnd::Nccl(_) => Err(RuntimeError::Backend(
                "the CPU backend moves KV blocks through host memory, not NCCL".into(),
            )),
        }
    }

    fn send_kv_blocks(&mut self, link: usize, blocks: &[u32]) -> Result<u64> {
        self.link(link, blocks)?;
        let piece = self.kv.gather(blocks);
        let (link, transfers) = self.link(link, blocks)?;
        link.send(piece)?;
        *transfers += 1;
        Ok(*transfers - 1)
    }

    fn recv_kv_blocks(&mut self, link: usize, blocks: &[u32]) -> Result<u64> {
        let bytes = blocks.len() * self.kv.block_bytes();
        let (link, transfers) = self.link(link, blocks)?;
        let piece = link.receive(bytes)?;
        *transfers += 1;
        let ticket = *transfers - 1;
        self.kv.scatter(blocks, &piece);
        Ok(ticket)
    }

    fn kv_transfers_done(&mut self, link: usize) -> Result<u64> {
        Ok(self.kv_links.get(link).map_or(0, |(_, done)| *done))
    }

    /// The logits are on the host already: every row goes back to the engine's sampler.
    fn sample(&mut self, rows: &[RowRequest<'_>]) -> Result<Sampled> {
        let logits = std::mem::take(&mut self.logits);
        if logits.rows() != rows.len() {
            return Err(RuntimeError::InvalidBatch(format!(
                "{} rows asked for, the last pass computed {}",
                rows.len(),
                logits.rows()
            )));
        }
        Ok(Sampled::all_logits(logits))
    }

    fn redraw_within(&mut self, _row: usize, _mask: &[u32]) -> Result<crate::runtime::RowDraw> {
        Err(RuntimeError::Backend(
            "the CPU backend leaves every row to the engine's sampler".into(),
        ))
    }

    fn run(&mut self, batch: &ForwardBatch) -> Result<()> {
        batch.validate(self.kv.layout(), self.config.vocab_size, self.config.context_length)?;
        let mut step = CpuStep::new(&self.config, batch, &self.rope, &mut self.kv, &mut self.buffers);
        self.weights.forward(&mut step)?;
        self.logits = step.logits;
        Ok(())
    }
}
