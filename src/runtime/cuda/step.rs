//! One forward pass on the GPU: the shared model's operations (runtime/model.rs) queued on the
//! backend's stream over its activation buffers, with the batch's metadata already on the
//! device (one staged copy) and the step's attention plan made once for every layer.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::attention::{self, AttentionArgs, Plan};
use super::gemm::{Gemm, OutType, RopeArgs, StreamNorm};
use super::kernels::Kernels;
use super::tensor_parallel::RankLink;
use super::timing::{Phase, Timing};
use super::weights::CudaWeights;
use super::{launch, silu_mul, Arg, ROW_THREADS};
use crate::runtime::config::{ModelConfig, RopeStyle};
use crate::runtime::error::Result;
use crate::runtime::model::{Act, Head, Ops};

/// Device addresses of the batch's metadata.
#[derive(Clone, Copy)]
pub struct Meta {
    pub ids: u64,
    pub positions: u64,
    pub slots: u64,
    /// Each token's sequence.
    pub seqs: u64,
    /// `[seqs, max_blocks]`.
    pub tables: u64,
    pub max_blocks: usize,
    pub block_size: usize,
    /// The rows whose logits are wanted.
    pub picked: u64,
    pub tokens: usize,
    pub rows: usize,
    pub max_len: usize,
    pub plan: Plan,
}

/// Device addresses of the activations (runtime/model.rs's `Act`s and the backend's own).
pub struct Buffers {
    /// The residual stream, f32.
    pub x: u64,
    pub normed: u64,
    pub qkv: u64,
    /// The rotated queries, bf16.
    pub q: u64,
    pub attn: u64,
    pub branch: u64,
    pub gate_up: u64,
    pub hidden: u64,
    pub head_in: u64,
    pub logits: u64,
    pub partials: u64,
}

pub struct CudaStep<'a> {
    pub stream: &'a Arc<CudaStream>,
    pub kernels: &'a Kernels,
    pub gemm: &'a Gemm,
    pub cfg: &'a ModelConfig,
    pub timing: Option<&'a Timing>,
    pub rope: (u64, u64),
    pub k_cache: &'a [CudaSlice<u16>],
    pub v_cache: &'a [CudaSlice<u16>],
    pub meta: Meta,
    pub buf: Buffers,
    /// This GPU's place in a tensor-parallel group, where there is one.
    pub rank: Option<&'a RankLink>,
    /// Which of the rank's two partial-sum buffers the last row-parallel product went to:
    /// attention's output projection and the MLP's down projection take one each, so that
    /// the all-reduces alternate between them.
    pub reduce_slot: usize,
    /// Whether the MLP's down projection added its branch into the stream itself (the GEMV
    /// does, on one GPU), so that the norm after it adds nothing.
    pub branch_in_stream: bool,
    /// The attention norm left to the q|k|v product, which makes it as its x where it can
    /// (`Gemm::fuses_norm`): the norm's weight.
    pub pending_norm: Option<u64>,
}

impl CudaStep<'_> {
    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(self.stream).0
    }

    fn mark(&self, phase: Phase) {
        if let Some(t) = self.timing {
            t.mark(phase, self.stream);
        }
    }

    /// A kernel with a block of `ROW_THREADS` per token.
    fn per_token(&self, f: &cudarc::driver::CudaFunction, args: &[&dyn Arg]) -> Result<()> {
        launch(self.stream, f, (self.meta.tokens as u32, 1), ROW_THREADS, args)
    }

    /// What rotating q|k|v and writing layer `layer`'s cache takes, fused or not.
    fn rope_args(&self, bias: Option<&CudaSlice<f32>>, layer: usize) -> RopeArgs {
        let c = self.cfg;
        RopeArgs {
            bias: bias.map_or(0, |b| self.ptr(b)),
            positions: self.meta.positions,
            cos: self.rope.0,
            sin: self.rope.1,
            heads: c.num_heads as i32,
            kv_heads: c.num_kv_heads as i32,
            head_dim: c.head_dim as i32,
            halves: (c.rope_style == RopeStyle::Halves) as i32,
            slots: self.meta.slots,
            q: self.buf.q,
            k_cache: self.ptr(&self.k_cache[layer]),
            v_cache: self.ptr(&self.v_cache[layer]),
        }
    }

    /// add_rms_norm's kernel on every token into `Normed`; `residual` (0: none) joins the
    /// stream first.
    fn norm_kernel(&self, residual: u64, weight: u64) -> Result<()> {
        let (null, write_back) = (0u64, 1i32);
        let (d, eps) = (self.cfg.hidden_size as i32, self.cfg.rms_norm_eps);
        self.per_token(
            &self.kernels.add_rms_norm,
            &[
                &self.buf.x,
                &residual,
                &null,
                &write_back,
                &weight,
                &self.buf.normed,
                &d,
                &eps,
            ],
        )
    }

    /// An activation's address and width.
    fn act(&self, a: Act) -> (u64, usize) {
        let c = self.cfg;
        match a {
            Act::Normed => (self.buf.normed, c.hidden_size),
            Act::Qkv => (self.buf.qkv, c.qkv_size()),
            Act::Attn => (self.buf.attn, c.q_size()),
            Act::Branch => (self.buf.branch, c.hidden_size),
            Act::GateUp => (self.buf.gate_up, 2 * c.intermediate_size),
            Act::Hidden => (self.buf.hidden, c.intermediate_size),
        }
    }
}

impl Ops<CudaWeights> for CudaStep<'_> {
    fn embed(&mut self, table: &CudaSlice<u16>) -> Result<()> {
        self.mark(Phase::Elementwise);
        let d = self.cfg.hidden_size as i32;
        self.per_token(
            &self.kernels.embedding,
            &[&self.meta.ids, &self.ptr(table), &self.buf.x, &d],
        )
    }

    fn add_rms_norm(&mut self, first: bool, weight: &CudaSlice<f32>) -> Result<()> {
        self.mark(Phase::Elementwise);
        let in_stream = std::mem::take(&mut self.branch_in_stream);
        let weight = self.ptr(weight);
        // The stream holds every branch (before the first block, or after a down projection
        // that added its own): this is the attention norm, which the q|k|v product may make.
        if (first || in_stream) && self.rank.is_none() {
            self.pending_norm = Some(weight);
            return Ok(());
        }
        let residual = if first || in_stream { 0u64 } else { self.buf.branch };
        self.norm_kernel(residual, weight)
    }

    fn linear(&mut self, weight: &CudaSlice<u16>, input: Act, output: Act) -> Result<()> {
        self.mark(Phase::Gemm);
        let ((x, k), (mut y, n)) = (self.act(input), self.act(output));
        // A row-parallel product is a partial sum: it goes where the all-reduce reads it.
        if let (Act::Branch, Some(link)) = (output, self.rank) {
            self.reduce_slot = (input == Act::Hidden) as usize;
            y = link.partial(self.reduce_slot, self.stream);
        }
        // On one GPU the down projection's GEMV adds its branch into the stream, so that the
        // next block's attention norm reads the stream alone and q|k|v can make it itself.
        let (w, rows) = (self.ptr(weight), self.meta.tokens);
        if (output, input) == (Act::Branch, Act::Hidden) && self.rank.is_none() && Gemm::takes_mma_gemv(x, w, rows, k) {
            self.branch_in_stream = true;
            return self.gemm.gemv_mma_add(x, w, self.buf.x, rows, n, k);
        }
        self.gemm.matmul(x, w, y, OutType::F32, rows, n, k)
    }

    fn qkv_rope_and_cache(&mut self, qkv: &CudaSlice<u16>, bias: Option<&CudaSlice<f32>>, layer: usize) -> Result<()> {
        let rope = self.rope_args(bias, layer);
        let (x, k, w, rows) = (self.buf.normed, self.cfg.hidden_size, self.ptr(qkv), self.meta.tokens);
        // The attention norm, left pending: made by the product as its x, or run here.
        let mut norm = None;
        if let Some(weight) = self.pending_norm.take() {
            if Gemm::fuses_norm(x, w, rows, k) {
                let eps = self.cfg.rms_norm_eps;
                norm = Some(StreamNorm {
                    stream: self.buf.x,
                    weight,
                    eps,
                });
            } else {
                self.norm_kernel(0, weight)?;
            }
        }
        if Gemm::takes_mma_gemv(x, w, rows, k) {
            self.mark(Phase::Gemm);
            return self.gemm.gemv_rope(x, w, rows, k, &rope, norm.as_ref());
        }
        self.linear(qkv, Act::Normed, Act::Qkv)?;
        self.mark(Phase::Elementwise);
        let width = self.cfg.qkv_size() as i32;
        if rope.bias != 0 {
            self.per_token(&self.kernels.add_bias, &[&self.buf.qkv, &rope.bias, &width])?;
        }
        let mut args: Vec<&dyn Arg> = vec![&self.buf.qkv, &width];
        args.extend(rope.kernel_args());
        self.per_token(&self.kernels.rope_and_cache, &args)
    }

    fn attention(&mut self, layer: usize) -> Result<()> {
        self.mark(Phase::Attention);
        let c = self.cfg;
        let args = AttentionArgs {
            q: self.buf.q,
            out: self.buf.attn,
            k_cache: self.ptr(&self.k_cache[layer]),
            v_cache: self.ptr(&self.v_cache[layer]),
            token_seq: self.meta.seqs,
            positions: self.meta.positions,
            tables: self.meta.tables,
            max_blocks: self.meta.max_blocks as i32,
            block_size: self.meta.block_size as i32,
            heads: c.num_heads as i32,
            kv_heads: c.num_kv_heads as i32,
            head_dim: c.head_dim as i32,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        let m = &self.meta;
        attention::launch(
            self.stream,
            self.kernels,
            &args,
            m.plan,
            m.tokens,
            m.max_len,
            self.buf.partials,
        )
    }

    fn all_reduce(&mut self, act: Act) -> Result<()> {
        let Some(link) = self.rank else { return Ok(()) };
        self.mark(Phase::Reduce);
        let (out, width) = self.act(act);
        link.all_reduce(self.reduce_slot, out, self.meta.tokens * width, self.stream)
    }

    fn gate_up_silu(&mut self, gate_up: &CudaSlice<u16>) -> Result<()> {
        let inter = self.cfg.intermediate_size;
        let (x, k, w) = (self.buf.normed, self.cfg.hidden_size, self.ptr(gate_up));
        if Gemm::takes_mma_gemv(x, w, self.meta.tokens, k) {
            self.mark(Phase::Gemm);
            return self.gemm.gemv_silu(x, w, self.buf.hidden, self.meta.tokens, inter, k);
        }
        self.linear(gate_up, Act::Normed, Act::GateUp)?;
        self.mark(Phase::Elementwise);
        silu_mul(
            self.stream,
            self.kernels,
            self.buf.gate_up,
            self.buf.hidden,
            self.meta.tokens,
            inter,
        )
    }

    fn logits(&mut self, norm: &CudaSlice<f32>, head: Head<'_, CudaWeights>) -> Result<()> {
        let rows = self.meta.rows;
        // The first rank alone computes logits and draws.
        if rows == 0 || self.rank.is_some_and(|link| !link.shard.leads()) {
            return Ok(());
        }
        self.mark(Phase::Head);
        // The last layer's branch joins the stream only in the rows read here (where its down
        // projection did not add it).
        let (d, eps, write_back) = (self.cfg.hidden_size as i32, self.cfg.rms_norm_eps, 0i32);
        let branch = if self.branch_in_stream { 0u64 } else { self.buf.branch };
        launch(
            self.stream,
            &self.kernels.add_rms_norm,
            (rows as u32, 1),
            ROW_THREADS,
            &[
                &self.buf.x,
                &branch,
                &self.meta.picked,
                &write_back,
                &self.ptr(norm),
                &self.buf.head_in,
                &d,
                &eps,
            ],
        )?;
        let head = match head {
            Head::Linear(w) | Head::Tied(w) => self.ptr(w),
        };
        let (vocab, d) = (self.cfg.vocab_size, self.cfg.hidden_size);
        self.gemm
            .matmul(self.buf.head_in, head, self.buf.logits, OutType::F32, rows, vocab, d)
    }
}
