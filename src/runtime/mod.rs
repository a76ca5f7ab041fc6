//! The model runtime: one `Backend` interface over a paged KV cache, with a CPU implementation
//! (candle, quantized GGUF) and a CUDA one (bf16, NVRTC kernels, cuBLAS). Nothing here decides
//! who runs; it computes the batch it is given.

pub mod batch;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod error;
pub mod gguf;
pub mod hf;
pub mod kv_link;
pub mod model;
pub mod names;
pub mod shard;

pub use batch::{ForwardBatch, KvLayout, Logits};
pub use config::{Architecture, ModelConfig};
pub use device::{Device, DeviceChoice};
pub use error::{Result, RuntimeError};
pub use kv_link::{HostLink, KvLinkEnd};

use std::path::Path;

/// Marks a token id that stands for the token the last `Backend::launch_sample` drew for row
/// `id & !FROM_LAST_DRAW` (where the backend `pipelines`). No vocabulary reaches it.
pub const FROM_LAST_DRAW: u32 = 1 << 31;

/// A model that can run one flattened, paged batch. Prefill chunks and decode tokens of
/// different sequences may be mixed freely in one call.
///
/// A step is `run` (queue the pass; a GPU backend returns before it is done, so the engine
/// fills the grammar masks meanwhile), then `sample` with each sampled row's mask and, where the
/// backend may decide the row itself, how to draw it: a GPU backend applies the mask, the copy
/// bias and the penalties and draws on the device, so only token ids cross the bus; the rows it
/// leaves (and every row of a backend whose logits are on the host) get their logits back for
/// the engine's sampler.
pub trait Backend: Send {
    fn config(&self) -> &ModelConfig;

    fn kv_layout(&self) -> KvLayout;

    /// Runs the batch, writing each query token's K and V into its slot; the logits of
    /// `batch.logits_rows` are kept for `sample`.
    fn run(&mut self, batch: &ForwardBatch) -> Result<()>;

    /// One request per row of the last `run`'s `logits_rows`, in order.
    fn sample(&mut self, rows: &[RowRequest<'_>]) -> Result<Sampled>;

    /// Decides again a row that `sample` decided on the backend, under a narrower mask (its
    /// token left the output no room to close), with the same draw: the argmax, or the same
    /// seeded draw from what the narrower mask leaves.
    fn redraw_within(&mut self, row: usize, mask: &[u32]) -> Result<RowDraw>;

    /// Whether `run` takes token ids marked `FROM_LAST_DRAW` (tokens the last `launch_sample`
    /// drew, read where they were drawn), so that the engine queues a step before it reads the
    /// step before's tokens (`engine::core::pipeline`).
    fn pipelines(&self) -> bool {
        false
    }

    /// `sample` without waiting for the draws: `collect` gives them. Only a backend that
    /// `pipelines` is asked.
    fn launch_sample(&mut self, _rows: &[RowRequest<'_>]) -> Result<()> {
        Err(RuntimeError::Backend("this backend does not pipeline steps".into()))
    }

    /// What the last `launch_sample` decided, once it is done.
    fn collect(&mut self) -> Result<Sampled> {
        Err(RuntimeError::Backend("this backend does not pipeline steps".into()))
    }

    /// `run`, then every row's logits.
    fn forward(&mut self, batch: &ForwardBatch) -> Result<Logits> {
        self.run(batch)?;
        let rows = vec![RowRequest::LOGITS; batch.logits_rows.len()];
        Ok(self.sample(&rows)?.logits)
    }

    /// Whether `sample` draws the rows given a `Draw` itself (else the engine need not make
    /// them: every row comes back as logits).
    fn draws_on_device(&self) -> bool {
        false
    }

    /// A short human-readable name of the device, for logs and benchmarks.
    fn device_name(&self) -> String;

    /// Whether a row's logits are the same bits whatever else is in its batch (its position in
    /// it, the number of rows, other requests' lengths).
    fn batch_invariant(&self) -> bool {
        false
    }

    /// Full rows of logits copied from the device to the host so far (rows the engine drew
    /// itself); 0 where the logits are on the host anyway.
    fn logits_rows_copied(&self) -> u64 {
        0
    }

    /// Steps replayed from CUDA graphs so far (the rest ran eagerly).
    fn graph_steps(&self) -> u64 {
        0
    }

    /// Whether the last `run` paid a one-time cost (capturing a CUDA graph for its shape, or
    /// running eagerly while its shape waits to be captured), so that its time says nothing of
    /// what such a step costs.
    fn last_run_warmed_up(&self) -> bool {
        false
    }

    /// Where the device's time went since the last call, where it is being measured
    /// (`QUARRY_CUDA_TIMING`); the count starts again.
    fn take_timing_report(&mut self) -> Option<String> {
        None
    }

    /// Why the backend can run nothing more (a tensor-parallel rank that failed or hung: the
    /// group's collectives may no longer pair up); `None` while it works. The server exits
    /// on it rather than fail every request from then on.
    fn broken(&self) -> Option<String> {
        None
    }

    /// Disaggregated serving (`kv_link`): joins this backend to one end of a link to another;
    /// the link's number here (links are numbered from 0 in the order they are attached: a
    /// prefill engine may serve several decode engines, each over a link of its own).
    fn attach_kv_link(&mut self, _end: KvLinkEnd) -> Result<usize> {
        Err(RuntimeError::Backend(format!(
            "{} cannot move KV blocks to another engine",
            self.device_name()
        )))
    }

    /// Queues the sending of `blocks`' keys and values (every layer, in order) over link
    /// `link`; returns the transfer's ticket on that link. The blocks must stay unwritten until
    /// `kv_transfers_done(link)` passes it.
    fn send_kv_blocks(&mut self, _link: usize, _blocks: &[u32]) -> Result<u64> {
        Err(RuntimeError::Backend("no KV link is attached".into()))
    }

    /// Queues the receiving of the oldest transfer on link `link` not yet received into
    /// `blocks` (as many as were sent); returns its ticket on that link. The blocks hold it
    /// once `kv_transfers_done(link)` passes it.
    fn recv_kv_blocks(&mut self, _link: usize, _blocks: &[u32]) -> Result<u64> {
        Err(RuntimeError::Backend("no KV link is attached".into()))
    }

    /// How many of this end's transfers on link `link` (sends and receives, in the order
    /// queued) are done; an error where the link failed, after which none completes on it.
    fn kv_transfers_done(&mut self, _link: usize) -> Result<u64> {
        Ok(0)
    }
}

/// What the engine asks of one sampled row.
#[derive(Clone, Copy, Debug)]
pub struct RowRequest<'a> {
    /// The grammar's mask for the row: one bit per token of the grammar's vocabulary; tokens
    /// past it are refused.
    pub mask: Option<&'a [u32]>,
    /// How to draw the row where its logits are; `None`: the engine samples it from its logits
    pub draw: Option<Draw<'a>>,
    /// Where `draw` is `None`: whether its logits come back (false for a contrast twin whose
    /// rows are all drawn where the logits are).
    pub logits_back: bool,
}

impl RowRequest<'_> {
    /// A row whose logits come back to the engine.
    pub const LOGITS: RowRequest<'static> = RowRequest {
        mask: None,
        draw: None,
        logits_back: true,
    };
}

/// One row's draw, in the engine sampler's order: contrast with its twin's row, the grammar's
/// mask, the copy bias, the penalties, then the argmax (temperature 0) or a seeded draw after
/// temperature, min-p, top-k and top-p.
#[derive(Clone, Copy, Debug)]
pub struct Draw<'a> {
    /// Context-aware decoding (engine/contrast.rs): the row is drawn from `(1 + weight) * row
    /// - weight * twin`, `twin` being another row of the same step (the index of its request).
    pub contrast: Option<(usize, f32)>,
    pub params: DrawParams,
    /// Added to the logits of the tokens this mask allows.
    pub bias: Option<(&'a [u32], f32)>,
    /// At most one per token.
    pub penalties: &'a [Penalty],
}

impl Draw<'static> {
    /// The argmax, nothing else applied.
    pub const GREEDY: Draw<'static> = Draw {
        contrast: None,
        params: DrawParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            counter: 0,
            logprobs: None,
            confidence: false,
        },
        bias: None,
        penalties: &[],
    };
}

/// What a draw takes from the request's sampling parameters and its sampler's state.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawParams {
    pub temperature: f32,
    /// 0: no limit.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    /// The draw's place in the request's output: with the seed, all the draw depends on (not
    /// the batch around it).
    pub counter: u64,
    /// Log-probabilities of the drawn token and of the `n` most likely, of the logits after the
    /// mask and the bias (before penalties and temperature), as the engine's sampler reports them.
    pub logprobs: Option<usize>,
    /// The drawn token's `TokenConfidence`, as the engine's sampler computes it.
    pub confidence: bool,
}

/// A drawn token's probability under the temperature-1 softmax of the final scores (the mask,
/// the copy bias, contrast and penalties applied: what the draw saw, whatever its temperature),
/// and how many tokens those scores left possible. A token that was the only choice (a forced
/// one, or a mask of one token) tells nothing about the model's belief.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenConfidence {
    pub prob: f32,
    pub choices: u32,
}

impl TokenConfidence {
    /// The grammar's own decision.
    pub const SOLE: TokenConfidence = TokenConfidence { prob: 1.0, choices: 1 };

    /// `scores[token]`'s share of the softmax over `scores` (`-inf` for refused tokens).
    pub fn of(scores: &[f32], token: u32) -> TokenConfidence {
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let (mut z, mut choices) = (0.0f64, 0u32);
        for &v in scores {
            if v > f32::NEG_INFINITY {
                z += ((v - max) as f64).exp();
                choices += 1;
            }
        }
        let prob = match scores.get(token as usize) {
            Some(&v) if v > f32::NEG_INFINITY && z > 0.0 => (((v - max) as f64).exp() / z) as f32,
            _ => 0.0,
        };
        TokenConfidence { prob, choices }
    }
}

/// A row a backend drew: the token, and what the draw was asked to report of it.
#[derive(Clone, Debug, PartialEq)]
pub struct RowDraw {
    pub token: u32,
    pub logprobs: Option<RowLogprobs>,
    pub confidence: Option<TokenConfidence>,
}

/// A drawn token's log-probability and the most likely tokens with theirs, best first.
#[derive(Clone, Debug, PartialEq)]
pub struct RowLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// A penalty on one token's logit: `factor` divides it where positive and multiplies it where
/// negative (the repetition penalty), then `add` is added (frequency, presence, DRY).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalty {
    pub token: u32,
    pub factor: f32,
    pub add: f32,
}

/// The tokens a backend decided, and the logits of the rows it left to the engine.
#[derive(Debug, Clone)]
pub struct Sampled {
    /// Per row: the token, where the backend drew it.
    pub tokens: Vec<Option<u32>>,
    /// Per row drawn with `logprobs` asked for: its log-probabilities.
    pub logprobs: Vec<Option<RowLogprobs>>,
    /// Per row drawn with `confidence` asked for: the drawn token's.
    pub confidence: Vec<Option<TokenConfidence>>,
    /// The rows without a token whose logits came back (`RowRequest::logits_back`), in row
    /// order.
    pub logits: Logits,
    /// Per row: whether `logits` holds it.
    pub has_logits: Vec<bool>,
}

impl Sampled {
    /// Every row left to the engine: what a backend whose logits are on the host returns.
    pub fn all_logits(logits: Logits) -> Self {
        Sampled {
            tokens: vec![None; logits.rows()],
            logprobs: vec![None; logits.rows()],
            confidence: vec![None; logits.rows()],
            has_logits: vec![true; logits.rows()],
            logits,
        }
    }

    /// The logits of row `row`, where the backend neither decided it nor kept them (a
    /// contrast twin's, `RowRequest::logits_back`).
    pub fn host_row(&self, row: usize) -> Option<&[f32]> {
        if !*self.has_logits.get(row)? {
            return None;
        }
        let before = self.has_logits[..row].iter().filter(|&&h| h).count();
        Some(self.logits.row(before))
    }
}

/// How the weights are loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFormat {
    /// From the model file.
    #[default]
    Auto,
    /// Deterministic random weights of the shape in `LoadOptions::model_config` (benchmarks;
    /// the CUDA backend only).
    Dummy,
}

/// What every backend needs to load, and what only one of them reads.
#[derive(Default)]
pub struct LoadOptions {
    pub load_format: LoadFormat,
    /// The shape of dummy weights.
    pub model_config: Option<ModelConfig>,
    /// KV cache capacity in tokens; overrides `kv_cache_bytes`.
    pub kv_cache_tokens: Option<usize>,
    /// KV cache memory; when neither is set, the CPU backend takes its default and the GPU
    /// backend a share of device memory (`gpu_memory_utilization`).
    pub kv_cache_bytes: Option<u64>,
    pub cpu: cpu::CpuOptions,
    pub gpu_memory_utilization: Option<f32>,
    pub max_num_batched_tokens: usize,
    /// The scheduler's: a pass may hold twice as many sequences, a contrast twin beside each
    /// (unless `for_drafts`).
    pub max_num_seqs: usize,
    /// The backend of a draft model (`--speculative-model`): its passes hold the drafting
    /// requests only, never a contrast twin, so it is sized for `max_num_seqs` sequences.
    pub for_drafts: bool,
    /// The GPU runs every step eagerly, without CUDA graphs (vLLM's --enforce-eager).
    pub enforce_eager: bool,
    /// A request's output the same whatever else is in its batch (`--batch-invariant`): on the
    /// GPU, products summed in one order for any number of rows; the CPU's always are.
    pub batch_invariant: bool,
    /// GPUs the model is split over (tensor parallelism), from the device's ordinal on; 0 and
    /// 1: one.
    pub tensor_parallel_size: usize,
}

/// The one place a backend is chosen and built.
pub fn load(device: DeviceChoice, model: &Path, options: LoadOptions) -> Result<Box<dyn Backend>> {
    match device.resolve()? {
        Device::Cpu => {
            if options.tensor_parallel_size > 1 {
                return Err(RuntimeError::Device(
                    "--tensor-parallel-size splits a model over GPUs; this run is on the CPU".into(),
                ));
            }
            if options.load_format == LoadFormat::Dummy {
                return Err(RuntimeError::Device(
                    "--load-format dummy runs on the GPU only (the CPU backend reads quantized GGUF)".into(),
                ));
            }
            if hf::is_model_dir(model) {
                return Err(RuntimeError::Device(format!(
                    "{} is a model directory (bf16 safetensors), which runs on the GPU; the CPU backend reads quantized GGUF files",
                    model.display()
                )));
            }
            let mut cpu = options.cpu;
            if let Some(tokens) = options.kv_cache_tokens {
                cpu.kv_cache_tokens = tokens;
                cpu.kv_cache_bytes = None;
            } else if options.kv_cache_bytes.is_some() {
                cpu.kv_cache_bytes = options.kv_cache_bytes;
            }
            Ok(Box::new(cpu::CpuBackend::load(model, &cpu)?))
        }
        Device::Cuda(ordinal) => {
            let cuda_options = cuda::CudaOptions {
                ordinal,
                kv_cache_tokens: options.kv_cache_tokens,
                kv_cache_bytes: options.kv_cache_bytes,
                gpu_memory_utilization: options.gpu_memory_utilization.unwrap_or(0.9),
                max_num_batched_tokens: options.max_num_batched_tokens.max(1),
                // Sized for every request contrasting (extraction's default), so that such
                // passes replay graphs and never grow the buffers (which forgets every graph).
                max_num_seqs: options.max_num_seqs.max(1) * if options.for_drafts { 1 } else { 2 },
                graphs: !options.enforce_eager,
                batch_invariant: options.batch_invariant,
            };
            let source = match (options.load_format, options.model_config) {
                (LoadFormat::Dummy, Some(config)) => cuda::WeightSource::Dummy(config),
                (LoadFormat::Dummy, None) => {
                    return Err(RuntimeError::Device("--load-format dummy needs --model-config".into()))
                }
                (LoadFormat::Auto, _) if hf::is_model_dir(model) => cuda::WeightSource::HuggingFace(model),
                (LoadFormat::Auto, _) => cuda::WeightSource::Gguf(model),
            };
            match options.tensor_parallel_size {
                0 | 1 => Ok(Box::new(cuda::CudaBackend::load(source, &cuda_options)?)),
                size => Ok(Box::new(cuda::tensor_parallel::TensorParallel::load(
                    source,
                    &cuda_options,
                    size,
                )?)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_parallelism_on_the_cpu_is_refused_before_anything_loads() {
        let options = LoadOptions {
            tensor_parallel_size: 2,
            ..Default::default()
        };
        let e = load(DeviceChoice::Cpu, Path::new("/nonexistent.gguf"), options)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("--tensor-parallel-size"), "{e}");
    }
}
