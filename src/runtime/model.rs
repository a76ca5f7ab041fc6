//! The decoder, written once for every backend: llama and qwen2 (a llama whose q, k and v
//! projections have biases, with its own rope style, both read from the config). A backend
//! keeps the weights in its own form (`Weights`) and computes the coarse operations of `Ops`
//! over activations it owns, fused where it can: q|k|v and gate|up are one projection each, the
//! residual add goes with the norm, rope and the cache write with the q|k|v projection, SiLU
//! with gate|up. This file says what a forward pass is; a backend says how each step of it runs.

use super::error::Result;

/// The forms a backend keeps weights in.
pub trait Weights {
    /// A projection `[out, in]` (q|k|v and gate|up stacked).
    type Linear;
    /// A norm's weights or a bias.
    type Vector;
    /// The token embedding table.
    type Embedding;
}

/// The activations of one pass, `[tokens, width]` each, held by the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// The residual stream, normalized: the input of attention and of the MLP.
    Normed,
    /// `[q | k | v]`.
    Qkv,
    /// Attention's output, before its projection.
    Attn,
    /// The output of attention or of the MLP, before it joins the residual stream.
    Branch,
    /// `[gate | up]`.
    GateUp,
    /// SiLU(gate) * up, the down projection's input.
    Hidden,
}

/// The output head: its own matrix, or the embedding table's (tied).
pub enum Head<'a, W: Weights> {
    Linear(&'a W::Linear),
    Tied(&'a W::Embedding),
}

/// One forward pass's operations on a backend, in the order `Model::forward` calls them.
pub trait Ops<W: Weights> {
    /// The residual stream from the batch's token ids.
    fn embed(&mut self, table: &W::Embedding) -> Result<()>;
    /// `Branch` joins the residual stream (except before the first layer, which has none yet),
    /// and the stream's RMS norm times `weight` goes to `Normed`.
    fn add_rms_norm(&mut self, first: bool, weight: &W::Vector) -> Result<()>;
    /// `output = input * weight^T`.
    fn linear(&mut self, weight: &W::Linear, input: Act, output: Act) -> Result<()>;
    /// `Normed` through q|k|v (plus `bias`, qwen2's), the q and k heads rotated, and k and v
    /// written into layer `layer`'s KV cache, where attention reads them with the queries.
    fn qkv_rope_and_cache(&mut self, qkv: &W::Linear, bias: Option<&W::Vector>, layer: usize) -> Result<()>;
    /// Paged attention of the rotated queries over layer `layer`'s cache, into `Attn`.
    fn attention(&mut self, layer: usize) -> Result<()>;
    /// Under tensor parallelism, `act` (a row-parallel projection's partial sum on each GPU)
    /// summed over the GPUs; nothing on one.
    fn all_reduce(&mut self, _act: Act) -> Result<()> {
        Ok(())
    }
    /// `Normed` through gate|up, then SiLU(gate) * up into `Hidden`.
    fn gate_up_silu(&mut self, gate_up: &W::Linear) -> Result<()>;
    /// The last residual add and the final norm, on the rows whose logits are wanted only,
    /// then the head.
    fn logits(&mut self, norm: &W::Vector, head: Head<'_, W>) -> Result<()>;
}

pub struct Attention<W: Weights> {
    pub qkv: W::Linear,
    /// qwen2's, where the backend does not fold it into `qkv`.
    pub qkv_bias: Option<W::Vector>,
    pub out: W::Linear,
}

impl<W: Weights> Attention<W> {
    fn forward(&self, ops: &mut impl Ops<W>, layer: usize) -> Result<()> {
        ops.qkv_rope_and_cache(&self.qkv, self.qkv_bias.as_ref(), layer)?;
        ops.attention(layer)?;
        ops.linear(&self.out, Act::Attn, Act::Branch)?;
        ops.all_reduce(Act::Branch)
    }
}

pub struct Mlp<W: Weights> {
    pub gate_up: W::Linear,
    pub down: W::Linear,
}

impl<W: Weights> Mlp<W> {
    fn forward(&self, ops: &mut impl Ops<W>) -> Result<()> {
        ops.gate_up_silu(&self.gate_up)?;
        ops.linear(&self.down, Act::Hidden, Act::Branch)?;
        ops.all_reduce(Act::Branch)
    }
}

pub struct Block<W: Weights> {
    pub attn_norm: W::Vector,
    pub attention: Attention<W>,
    pub ffn_norm: W::Vector,
    pub mlp: Mlp<W>,
}

impl<W: Weights> Block<W> {
    fn forward(&self, ops: &mut impl Ops<W>, layer: usize) -> Result<()> {
        ops.add_rms_norm(layer == 0, &self.attn_norm)?;
        self.attention.forward(ops, layer)?;
        ops.add_rms_norm(false, &self.ffn_norm)?;
        self.mlp.forward(ops)
    }
}

pub struct Model<W: Weights> {
    pub embedding: W::Embedding,
    pub blocks: Vec<Block<W>>,
    pub output_norm: W::Vector,
    /// None: tied to the embedding table.
    pub head: Option<W::Linear>,
}

impl<W: Weights> Model<W> {
    /// One pass over a batch: the backend's `ops` knows the batch and holds the activations;
    /// each layer's output stays in `Branch` until the next layer's norm adds it in.
    pub fn forward(&self, ops: &mut impl Ops<W>) -> Result<()> {
        ops.embed(&self.embedding)?;
        for (layer, block) in self.blocks.iter().enumerate() {
            block.forward(ops, layer)?;
        }
        let head = match &self.head {
            Some(linear) => Head::Linear(linear),
            None => Head::Tied(&self.embedding),
        };
        ops.logits(&self.output_norm, head)
    }
}
