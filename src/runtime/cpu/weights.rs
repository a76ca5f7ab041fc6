//! The decoder weights of llama-family models on the CPU, quantized as the GGUF file has them,
//! loaded by tensor name into the shared model (runtime/model.rs). qwen2's q/k/v biases are
//! folded into the stacked projection.

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use super::linear::Linear;
use crate::runtime::config::ModelConfig;
use crate::runtime::error::{Result, RuntimeError};
use crate::runtime::gguf::GgufFile;
use crate::runtime::model::{Attention, Block, Mlp, Model, Weights};

/// The CPU's forms of weights: quantized projections, f32 vectors.
pub struct CpuWeights;

impl Weights for CpuWeights {
    type Linear = Linear;
    type Vector = Vec<f32>;
    type Embedding = QTensor;
}

pub type ModelWeights = Model<CpuWeights>;

impl CpuWeights {
    pub fn load(gguf: &mut GgufFile, cfg: &ModelConfig) -> Result<ModelWeights> {
        let embedding = gguf.tensor("token_embd.weight")?;
        expect_shape("token_embd.weight", &embedding, &[cfg.vocab_size, cfg.hidden_size])?;
        let mut blocks = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            blocks.push(load_layer(gguf, cfg, i)?);
        }
        let output_norm = vector(gguf, "output_norm.weight", cfg.hidden_size)?;
        // Small models tie the output head to the embedding matrix: the head is still a
        // projection of its own here (the table is read as one).
        let head_name = if gguf.has_tensor("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let head = gguf.tensor(head_name)?;
        expect_shape(head_name, &head, &[cfg.vocab_size, cfg.hidden_size])?;
        Ok(Model {
            embedding,
            blocks,
            output_norm,
            head: Some(Linear::from_qtensor(head_name, head, None)?),
        })
    }
}

/// Dequantized embedding rows of `ids`, `[ids, hidden]`.
pub fn embed(table: &QTensor, ids: &[u32]) -> Result<Vec<f32>> {
    let ids = Tensor::from_slice(ids, ids.len(), &Device::Cpu)?;
    Ok(table.embedding(&ids)?.flatten_all()?.to_vec1::<f32>()?)
}

fn load_layer(gguf: &mut GgufFile, cfg: &ModelConfig, i: usize) -> Result<Block<CpuWeights>> {
    let name = |t: &str| format!("blk.{i}.{t}");
    let d = cfg.hidden_size;
    let mut proj = |t: &str, rows: usize, cols: usize, bias: bool| -> Result<Linear> {
        let n = name(&format!("{t}.weight"));
        let w = gguf.tensor(&n)?;
        expect_shape(&n, &w, &[rows, cols])?;
        let b = if bias {
            Some(vector(gguf, &name(&format!("{t}.bias")), rows)?)
        } else {
            None
        };
        Linear::from_qtensor(&n, w, b)
    };
    let q = proj("attn_q", cfg.q_size(), d, cfg.qkv_bias)?;
    let k = proj("attn_k", cfg.kv_size(), d, cfg.qkv_bias)?;
    let v = proj("attn_v", cfg.kv_size(), d, cfg.qkv_bias)?;
    let attn_out = proj("attn_output", d, cfg.q_size(), false)?;
    let gate = proj("ffn_gate", cfg.intermediate_size, d, false)?;
    let up = proj("ffn_up", cfg.intermediate_size, d, false)?;
    let down = proj("ffn_down", d, cfg.intermediate_size, false)?;
    Ok(Block {
        attn_norm: vector(gguf, &name("attn_norm.weight"), d)?,
        attention: Attention {
            qkv: Linear::stack(vec![q, k, v])?,
            qkv_bias: None,
            out: attn_out,
        },
        ffn_norm: vector(gguf, &name("ffn_norm.weight"), d)?,
        mlp: Mlp {
            gate_up: Linear::stack(vec![gate, up])?,
            down,
        },
    })
}

fn vector(gguf: &mut GgufFile, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = gguf.tensor(name)?;
    expect_shape(name, &t, &[len])?;
    Ok(t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
}

fn expect_shape(name: &str, t: &QTensor, want: &[usize]) -> Result<()> {
    if t.shape().dims() != want {
        return Err(RuntimeError::BadTensor {
            name: name.into(),
            reason: format!("shape {:?}, expected {want:?}", t.shape().dims()),
        });
    }
    Ok(())
}
