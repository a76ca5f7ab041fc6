//! The decoder's weights in device memory, bf16 matrices and f32 norm vectors, from a GGUF file
//! (dequantized on load) or deterministic random values of any shape (`--load-format dummy`).
//! They fill the shared model (runtime/model.rs), with the CPU's stacking of q|k|v and gate|up.
//! Under tensor parallelism a rank keeps its shard's rows and columns (runtime/shard.rs).

use std::sync::Arc;

use candle_core::Device;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::bf16;

use super::kernels::Kernels;
use crate::runtime::config::ModelConfig;
use crate::runtime::error::{Result, RuntimeError};
use crate::runtime::gguf::GgufFile;
use crate::runtime::model::{Attention, Block, Mlp, Model};
use crate::runtime::names::{Format, Part};
use crate::runtime::shard::Shard;

/// The GPU's forms of weights: bf16 matrices `[out, in]` (their shapes follow from the config
/// and the activations they join), f32 vectors.
pub struct CudaWeights;

impl crate::runtime::model::Weights for CudaWeights {
    type Linear = CudaSlice<u16>;
    type Vector = CudaSlice<f32>;
    type Embedding = CudaSlice<u16>;
}

pub type Weights = Model<CudaWeights>;

/// One layer's weights as the shared model holds them.
#[allow(clippy::too_many_arguments)]
fn block(
    attn_norm: CudaSlice<f32>,
    qkv: CudaSlice<u16>,
    qkv_bias: Option<CudaSlice<f32>>,
    out: CudaSlice<u16>,
    ffn_norm: CudaSlice<f32>,
    gate_up: CudaSlice<u16>,
    down: CudaSlice<u16>,
) -> Block<CudaWeights> {
    Block {
        attn_norm,
        attention: Attention { qkv, qkv_bias, out },
        ffn_norm,
        mlp: Mlp { gate_up, down },
    }
}

fn oom(what: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Device(format!("out of device memory loading {what}: {e}"))
}

fn upload_bf16(stream: &Arc<CudaStream>, name: &str, values: &[f32]) -> Result<CudaSlice<u16>> {
    let bits: Vec<u16> = values.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    stream.clone_htod(&bits).map_err(|e| oom(name, e))
}

fn upload_f32(stream: &Arc<CudaStream>, name: &str, values: &[f32]) -> Result<CudaSlice<f32>> {
    stream.clone_htod(values).map_err(|e| oom(name, e))
}

/// Reads one tensor of exactly the given shape, as f32.
pub type Reader<'a> = dyn FnMut(&str, &[usize]) -> Result<Vec<f32>> + 'a;

impl CudaWeights {
    pub fn from_gguf(
        gguf: &mut GgufFile,
        cfg: &ModelConfig,
        shard: Shard,
        stream: &Arc<CudaStream>,
    ) -> Result<Weights> {
        let has_head = gguf.has_tensor(Format::Gguf.head());
        let mut read = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let t = gguf.tensor(name)?;
            if t.shape().dims() != shape {
                return Err(RuntimeError::BadTensor {
                    name: name.into(),
                    reason: format!("shape {:?}, expected {shape:?}", t.shape().dims()),
                });
            }
            Ok(t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?)
        };
        Self::load(&mut read, Format::Gguf, has_head, cfg, shard, stream)
    }

    pub fn from_hf(
        dir: &std::path::Path,
        cfg: &ModelConfig,
        tied: bool,
        shard: Shard,
        stream: &Arc<CudaStream>,
    ) -> Result<Weights> {
        let files = crate::runtime::hf::Shards::open(dir)?;
        let has_head = !tied;
        let mut read = |name: &str, shape: &[usize]| files.read(name, shape);
        Self::load(&mut read, Format::HuggingFace, has_head, cfg, shard, stream)
    }

    /// The weights by name, q|k|v and gate|up stacked as the kernels want them; `cfg` is the
    /// whole model's shape, of which `shard` keeps its part.
    fn load(
        read: &mut Reader<'_>,
        names: Format,
        has_head: bool,
        cfg: &ModelConfig,
        shard: Shard,
        stream: &Arc<CudaStream>,
    ) -> Result<Weights> {
        let (d, inter, q, kv) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_size(), cfg.kv_size());
        let embedding = upload_bf16(
            stream,
            names.embedding(),
            &read(names.embedding(), &[cfg.vocab_size, d])?,
        )?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let (heads, hd, mlp) = (shard.q_heads(cfg), cfg.head_dim, shard.intermediate(cfg));
        for i in 0..cfg.num_layers {
            let n = |p: Part| names.layer(i, p);
            let (wq, wk, wv) = (
                read(&n(Part::Q), &[q, d])?,
                read(&n(Part::K), &[kv, d])?,
                read(&n(Part::V), &[kv, d])?,
            );
            let qkv = shard.qkv_rows(cfg, &wq, &wk, &wv, d);
            let qkv_bias = if cfg.qkv_bias {
                let (bq, bk, bv) = (
                    read(&n(Part::QBias), &[q])?,
                    read(&n(Part::KBias), &[kv])?,
                    read(&n(Part::VBias), &[kv])?,
                );
                Some(upload_f32(
                    stream,
                    &n(Part::QBias),
                    &shard.qkv_rows(cfg, &bq, &bk, &bv, 1),
                )?)
            } else {
                None
            };
            let mut gate_up = Shard::rows(&read(&n(Part::Gate), &[inter, d])?, d, mlp.clone());
            gate_up.extend(Shard::rows(&read(&n(Part::Up), &[inter, d])?, d, mlp.clone()));
            let out = Shard::columns(&read(&n(Part::AttnOut), &[d, q])?, q, heads.start * hd..heads.end * hd);
            let down = Shard::columns(&read(&n(Part::Down), &[d, inter])?, inter, mlp.clone());
            layers.push(block(
                upload_f32(stream, &n(Part::AttnNorm), &read(&n(Part::AttnNorm), &[d])?)?,
                upload_bf16(stream, &n(Part::Q), &qkv)?,
                qkv_bias,
                upload_bf16(stream, &n(Part::AttnOut), &out)?,
                upload_f32(stream, &n(Part::FfnNorm), &read(&n(Part::FfnNorm), &[d])?)?,
                upload_bf16(stream, &n(Part::Gate), &gate_up)?,
                upload_bf16(stream, &n(Part::Down), &down)?,
            ));
        }
        let output_norm = upload_f32(stream, names.output_norm(), &read(names.output_norm(), &[d])?)?;
        // Small models tie the output head to the embedding matrix.
        let lm_head = if has_head {
            Some(upload_bf16(
                stream,
                names.head(),
                &read(names.head(), &[cfg.vocab_size, d])?,
            )?)
        } else {
            None
        };
        Ok(Model {
            embedding,
            blocks: layers,
            output_norm,
            head: lm_head,
        })
    }

    /// Uniform random matrices (the same on every run for a given shape), unit norms, an
    /// untied head: the memory traffic and arithmetic of the real model, for benchmarks.
    /// `cfg` is the shape a rank computes (a shard's); each rank draws its own values.
    pub fn dummy(cfg: &ModelConfig, shard: Shard, stream: &Arc<CudaStream>, kernels: &Kernels) -> Result<Weights> {
        let mut made = 0u64;
        let mut matrix = |name: &str, rows: usize, cols: usize| -> Result<CudaSlice<u16>> {
            let n = rows * cols;
            let mut m = stream.alloc_zeros::<u16>(n).map_err(|e| oom(name, e))?;
            made += 1;
            // The first, the embedding, is every rank's; the rest are the rank's own.
            let seed = match made {
                1 => 1,
                k => k + shard.rank as u64 * 1_000_000,
            };
            let scale = 1.0f32 / (cols as f32).sqrt();
            let (n64, cfg_launch) = (
                n as u64,
                LaunchConfig {
                    grid_dim: (1024, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                },
            );
            // SAFETY: the kernel writes n values of the allocation just made.
            unsafe {
                stream
                    .launch_builder(&kernels.fill_uniform_bf16)
                    .arg(&mut m)
                    .arg(&n64)
                    .arg(&seed)
                    .arg(&scale)
                    .launch(cfg_launch)
            }
            .map_err(|e| RuntimeError::Device(format!("filling {name}: {e}")))?;
            Ok(m)
        };
        let (d, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let ones = vec![1.0f32; d];
        let embedding = matrix("embedding", cfg.vocab_size, d)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |t: &str| format!("layer {i} {t}");
            let qkv_bias = if cfg.qkv_bias {
                Some(upload_f32(stream, &n("qkv bias"), &vec![0.0; cfg.qkv_size()])?)
            } else {
                None
            };
            layers.push(block(
                upload_f32(stream, &n("attn_norm"), &ones)?,
                matrix(&n("qkv"), cfg.qkv_size(), d)?,
                qkv_bias,
                matrix(&n("attn_out"), d, cfg.q_size())?,
                upload_f32(stream, &n("ffn_norm"), &ones)?,
                matrix(&n("gate_up"), 2 * inter, d)?,
                matrix(&n("down"), d, inter)?,
            ));
        }
        Ok(Model {
            embedding,
            blocks: layers,
            output_norm: upload_f32(stream, "output_norm", &ones)?,
            head: Some(matrix("lm_head", cfg.vocab_size, d)?),
        })
    }
}
