//! The CPU backend: quantized GGUF weights (candle), our Q4_1 kernel, paged attention over a
//! host KV pool, all cores through candle's barrier pool.

mod attention;
mod exp;
mod kv_cache;
mod linear;
mod ops;
mod pool;
pub use pool::prefer_parking;
pub mod q4_1;
pub mod q4_1_x16;
pub mod q4_1_x8;
pub mod q8_0_x16;
pub mod q8_0_x8;
mod weights;

use std::path::Path;

pub use attention::MAX_GROUP as MAX_HEAD_GROUP;
use attention::{paged_attention, AttentionInput, AttentionShape};
use kv_cache::KvCache;
pub use ops::rope_tables;
use ops::Rope;
use weights::ModelWeights;

use super::batch::{ForwardBatch, KvLayout, Logits};
use super::config::ModelConfig;
use super::error::{Result, RuntimeError};
use super::gguf::GgufFile;
use super::{Backend, RowRequest, Sampled};

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
}

/// Activations of one forward pass, `[tokens, width]` each.
#[derive(Default)]
struct Buffers {
    /// A normalized residual stream, the input of attention and of the MLP.
    normed: Vec<f32>,
    /// The output of attention or of the MLP, before it joins the residual stream.
    branch: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
}

impl CpuBackend {
    pub fn load(path: &Path, options: &CpuOptions) -> Result<Self> {
        let mut gguf = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&gguf)?;
        let weights = ModelWeights::load(&mut gguf, &config)?;
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
        })
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

    fn redraw_within(&mut self, _row: usize, _mask: &[u32]) -> Result<(u32, Option<crate::runtime::RowLogprobs>)> {
        Err(RuntimeError::Backend(
            "the CPU backend leaves every row to the engine's sampler".into(),
        ))
    }

    fn run(&mut self, batch: &ForwardBatch) -> Result<()> {
        let cfg = &self.config;
        batch.validate(self.kv.layout(), cfg.vocab_size, cfg.context_length)?;
        let (t, d) = (batch.num_tokens(), cfg.hidden_size);
        let (q_size, kv_size) = (cfg.q_size(), cfg.kv_size());
        let qkv_width = q_size + 2 * kv_size;
        let runs = attention::runs(
            &batch.query_start,
            &batch.positions,
            attention::run_len(cfg.num_heads / cfg.num_kv_heads),
        );
        let shape = AttentionShape {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };

        let mut x = self.weights.embed(&batch.token_ids)?;
        // Reused from pass to pass: fresh buffers would be page faults every step.
        let b = &mut self.buffers;
        let inter = cfg.intermediate_size;
        for (buf, len) in [
            (&mut b.normed, t * d),
            (&mut b.branch, t * d),
            (&mut b.qkv, t * qkv_width),
            (&mut b.attn, t * q_size),
            (&mut b.gate_up, t * 2 * inter),
            (&mut b.act, t * inter),
        ] {
            buf.resize(len, 0.0);
        }
        let Buffers {
            normed,
            branch,
            qkv,
            attn,
            gate_up,
            act,
        } = b;
        for (li, layer) in self.weights.layers.iter().enumerate() {
            // The previous layer's MLP output joins the residual stream here.
            if li == 0 {
                ops::rms_norm(&x, &layer.attn_norm, cfg.rms_norm_eps, normed);
            } else {
                ops::add_rms_norm(&mut x, branch, &layer.attn_norm, cfg.rms_norm_eps, normed);
            }
            layer.qkv.forward(normed, t, qkv)?;
            // Every head of q and of k rotates; v does not.
            ops::rope_rows(&self.rope, qkv, qkv_width, q_size + kv_size, &batch.positions);
            let rows: &[f32] = qkv;
            self.kv.write(
                li,
                &batch.slot_mapping,
                |t| &rows[t * qkv_width + q_size..][..kv_size],
                |t| &rows[t * qkv_width + q_size + kv_size..][..kv_size],
            );
            let (k_pool, v_pool) = self.kv.layer(li);
            let input = AttentionInput {
                q: qkv,
                q_stride: qkv_width,
                k_pool,
                v_pool,
                block_tables: &batch.block_tables,
                runs: &runs,
            };
            paged_attention(&shape, &input, attn);
            layer.attn_out.forward(attn, t, branch)?;
            ops::add_rms_norm(&mut x, branch, &layer.ffn_norm, cfg.rms_norm_eps, normed);
            layer.gate_up.forward(normed, t, gate_up)?;
            ops::silu_mul(gate_up, inter, act);
            layer.down.forward(act, t, branch)?;
        }

        // Only the rows whose logits are wanted go through the last residual add, the final
        // norm and the head.
        let rows = batch.logits_rows.len();
        let mut picked = Vec::with_capacity(rows * d);
        for &r in &batch.logits_rows {
            let r = r as usize * d;
            picked.extend(x[r..r + d].iter().zip(&branch[r..r + d]).map(|(a, b)| a + b));
        }
        let mut normed = vec![0f32; rows * d];
        ops::rms_norm(&picked, &self.weights.output_norm, cfg.rms_norm_eps, &mut normed);
        let mut data = vec![0f32; rows * cfg.vocab_size];
        if rows > 0 {
            self.weights.lm_head.forward(&normed, rows, &mut data)?;
        }
        self.logits = Logits {
            vocab_size: cfg.vocab_size,
            data,
        };
        Ok(())
    }
}
