//! One forward pass on the CPU: the shared model's operations (runtime/model.rs) over the
//! backend's host buffers and KV pool.

use super::attention::{self, paged_attention, AttentionInput, AttentionShape, Run};
use super::kv_cache::KvCache;
use super::ops::{self, Rope};
use super::weights::{embed, CpuWeights};
use super::Buffers;
use crate::runtime::batch::{ForwardBatch, Logits};
use crate::runtime::config::ModelConfig;
use crate::runtime::error::{Result, RuntimeError};
use crate::runtime::model::{Act, Head, Ops};

pub struct CpuStep<'a> {
    cfg: &'a ModelConfig,
    batch: &'a ForwardBatch,
    rope: &'a Rope,
    kv: &'a mut KvCache,
    buffers: &'a mut Buffers,
    runs: Vec<Run>,
    /// The residual stream.
    x: Vec<f32>,
    /// What `logits` computed.
    pub logits: Logits,
}

impl<'a> CpuStep<'a> {
    pub fn new(
        cfg: &'a ModelConfig,
        batch: &'a ForwardBatch,
        rope: &'a Rope,
        kv: &'a mut KvCache,
        buffers: &'a mut Buffers,
    ) -> Self {
        let (t, d) = (batch.num_tokens(), cfg.hidden_size);
        let inter = cfg.intermediate_size;
        // Reused from pass to pass: fresh buffers would be page faults every step.
        for (act, len) in [
            (Act::Normed, t * d),
            (Act::Branch, t * d),
            (Act::Qkv, t * cfg.qkv_size()),
            (Act::Attn, t * cfg.q_size()),
            (Act::GateUp, t * 2 * inter),
            (Act::Hidden, t * inter),
        ] {
            buffers.get(act).resize(len, 0.0);
        }
        let runs = attention::runs(
            &batch.query_start,
            &batch.positions,
            attention::run_len(cfg.num_heads / cfg.num_kv_heads),
        );
        CpuStep {
            cfg,
            batch,
            rope,
            kv,
            buffers,
            runs,
            x: Vec::new(),
            logits: Logits::default(),
        }
    }

    fn qkv_width(&self) -> usize {
        self.cfg.qkv_size()
    }
}

impl Ops<CpuWeights> for CpuStep<'_> {
    fn embed(&mut self, table: &candle_core::quantized::QTensor) -> Result<()> {
        self.x = embed(table, &self.batch.token_ids)?;
        Ok(())
    }

    fn add_rms_norm(&mut self, first: bool, weight: &Vec<f32>) -> Result<()> {
        let eps = self.cfg.rms_norm_eps;
        let b = &mut *self.buffers;
        if first {
            ops::rms_norm(&self.x, weight, eps, &mut b.normed);
        } else {
            ops::add_rms_norm(&mut self.x, &b.branch, weight, eps, &mut b.normed);
        }
        Ok(())
    }

    fn linear(&mut self, weight: &super::linear::Linear, input: Act, output: Act) -> Result<()> {
        // Out of the set for the call: the two are distinct buffers.
        let x = std::mem::take(self.buffers.get(input));
        let result = weight.forward(&x, self.batch.num_tokens(), self.buffers.get(output));
        *self.buffers.get(input) = x;
        result
    }

    fn qkv_rope_and_cache(&mut self, qkv: &super::linear::Linear, bias: Option<&Vec<f32>>, layer: usize) -> Result<()> {
        self.linear(qkv, Act::Normed, Act::Qkv)?;
        let (q_size, kv_size, width) = (self.cfg.q_size(), self.cfg.kv_size(), self.qkv_width());
        let qkv = &mut self.buffers.qkv;
        if let Some(bias) = bias {
            for row in qkv.chunks_mut(bias.len()) {
                row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
            }
        }
        // Every head of q and of k rotates; v does not.
        ops::rope_rows(self.rope, qkv, width, q_size + kv_size, &self.batch.positions);
        let rows: &[f32] = qkv;
        self.kv.write(
            layer,
            &self.batch.slot_mapping,
            |t| &rows[t * width + q_size..][..kv_size],
            |t| &rows[t * width + q_size + kv_size..][..kv_size],
        );
        Ok(())
    }

    fn attention(&mut self, layer: usize) -> Result<()> {
        let shape = AttentionShape {
            num_heads: self.cfg.num_heads,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
        };
        let (k_pool, v_pool) = self.kv.layer(layer);
        let input = AttentionInput {
            q: &self.buffers.qkv,
            q_stride: self.qkv_width(),
            k_pool,
            v_pool,
            block_tables: &self.batch.block_tables,
            runs: &self.runs,
        };
        paged_attention(&shape, &input, &mut self.buffers.attn);
        Ok(())
    }

    fn gate_up_silu(&mut self, gate_up: &super::linear::Linear) -> Result<()> {
        self.linear(gate_up, Act::Normed, Act::GateUp)?;
        let b = &mut *self.buffers;
        ops::silu_mul(&b.gate_up, self.cfg.intermediate_size, &mut b.act);
        Ok(())
    }

    fn logits(&mut self, norm: &Vec<f32>, head: Head<'_, CpuWeights>) -> Result<()> {
        // The CPU loader reads a tied head as a projection of its own.
        let Head::Linear(head) = head else {
            return Err(RuntimeError::Backend(
                "the CPU backend needs the output head as a projection".into(),
            ));
        };
        let (d, vocab) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let rows = self.batch.logits_rows.len();
        let branch = &self.buffers.branch;
        let mut picked = Vec::with_capacity(rows * d);
        for &r in &self.batch.logits_rows {
            let r = r as usize * d;
            picked.extend(self.x[r..r + d].iter().zip(&branch[r..r + d]).map(|(a, b)| a + b));
        }
        let mut normed = vec![0f32; rows * d];
        ops::rms_norm(&picked, norm, self.cfg.rms_norm_eps, &mut normed);
        let mut data = vec![0f32; rows * vocab];
        if rows > 0 {
            head.forward(&normed, rows, &mut data)?;
        }
        self.logits = Logits {
            vocab_size: vocab,
            data,
        };
        Ok(())
    }
}
