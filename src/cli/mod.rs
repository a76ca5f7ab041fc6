//! The `quarry` command line: one subcommand per job, each a thin layer over the library.

mod bench;
mod extract;
mod generate;
mod progress;
mod serve;

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};

use crate::engine::{EngineClient, EngineConfig, EngineCore, KvLink};
use crate::runtime::cpu::{CpuOptions, Prefault};
use crate::runtime::{Backend, DeviceChoice, LoadFormat, LoadOptions, ModelConfig};
use crate::tokenizer::Tokenizer;

#[derive(Parser)]
#[command(
    name = "quarry",
    version,
    about = "Schema-first structured extraction with a constrained LLM"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines are written on stderr: `text` (the message alone, with the request's id
    /// where one is served) or `json` (one object a line, with time, level and request id).
    #[arg(long, global = true, value_enum, default_value_t = crate::logging::LogFormat::Text)]
    log_format: crate::logging::LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming tokens to stdout.
    Generate(generate::GenerateArgs),
    /// Extract one JSON object matching a schema from a document, or one per document of a
    /// JSONL or CSV batch.
    Extract(extract::ExtractArgs),
    /// Measure the engine's speed.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Serve the HTTP API (POST /extract, GET /health, GET /openapi.json).
    Serve(serve::ServeArgs),
    /// Work on the job store's jobs and batches, serving no HTTP (beside any number of
    /// `serve` and `worker` processes sharing the store).
    Worker(serve::WorkerArgs),
    /// Print the OpenAPI document of the HTTP API.
    Openapi(serve::OpenApiArgs),
    /// Write a GGUF model's tokenizer into a model directory as Hugging Face files
    /// (tokenizer.json, tokenizer_config.json): for test models saved by transformers.
    #[command(hide = true)]
    ExportTokenizer(ExportTokenizerArgs),
}

#[derive(Args)]
pub struct ExportTokenizerArgs {
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    output: PathBuf,
}

fn export_tokenizer(args: ExportTokenizerArgs) -> anyhow::Result<()> {
    let path = args.model.unwrap_or_else(crate::model_path::default_model_path);
    let gguf = crate::runtime::gguf::GgufFile::open(&path)?;
    let template = gguf.string("tokenizer.chat_template").ok();
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    std::fs::create_dir_all(&args.output)?;
    tokenizer.save_to_dir(&args.output, template.as_deref())?;
    Ok(())
}

/// Options every command that loads a model shares.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// GGUF model file [default: models/SmolLM2-135M-Instruct.Q4_1.gguf, or $QUARRY_MODEL]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Where the model runs: auto (the first GPU when there is one), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", env = "QUARRY_DEVICE")]
    device: DeviceChoice,
    /// `dummy`: deterministic random weights of the shape --model-config names (GPU
    /// benchmarks of large shapes; the tokenizer still comes from --model).
    #[arg(long, default_value = "auto", value_parser = parse_load_format)]
    load_format: LoadFormat,
    /// The shape of dummy weights: llama-3.1-8b, llama-3.1-70b, qwen2.5-7b or a Hugging Face
    /// config.json.
    #[arg(long)]
    model_config: Option<String>,
    /// Share of the GPU's memory the backend may take, KV cache included (vLLM's
    /// --gpu-memory-utilization).
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_utilization: f32,
    /// CPU threads for the model [default: all cores]
    #[arg(long)]
    threads: Option<usize>,
    /// KV cache capacity in tokens [default: from --kv-cache-memory]
    #[arg(long, conflicts_with = "kv_cache_memory")]
    kv_cache_tokens: Option<usize>,
    /// KV cache memory, e.g. 512MiB or 2GiB [default: a fifth of the memory available at
    /// start, at most 4 GiB]
    #[arg(long, value_parser = parse_size)]
    kv_cache_memory: Option<u64>,
    /// Tokens in one forward pass, over every request (vLLM's max_num_batched_tokens).
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Requests running at once.
    #[arg(long, default_value_t = 128)]
    max_num_seqs: usize,
    /// Run every GPU step eagerly: no CUDA graphs (captured at start for decode steps, and
    /// for speculative checks as they come).
    #[arg(long)]
    enforce_eager: bool,
    /// Make a request's output the same whatever else runs beside it (batch size, order,
    /// chunking, preemption, speculation): on the GPU every matrix product sums a row in one
    /// fixed order for any number of rows, instead of cuBLAS's choice per shape. Costs speed
    /// on large batches (docs/batch-invariance.md); the CPU is batch-invariant anyway.
    #[arg(long)]
    batch_invariant: bool,
    /// Split the model over this many GPUs (tensor parallelism), from --device's on: each
    /// holds a share of the heads and of the MLP, and the GPUs sum their parts after each
    /// attention and MLP.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
    tensor_parallel_size: u16,
    /// Serve with this many copies of the model (data parallelism; `serve`, `extract` and
    /// `bench interference`), each with its own engine and KV cache: copy r on the GPUs from
    /// --device's + r x --tensor-parallel-size on (on the CPU the copies share the cores and
    /// split the default cache). Each request goes to the copy whose prefix cache holds the
    /// start of its prompt, or to the least busy.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    data_parallel_size: u16,
    /// Disaggregated serving: the device that computes prompts (cpu or cuda:N), with
    /// --decode-device (--device is then not used). Each prompt's KV blocks then go to the
    /// decode device (over NCCL between GPUs), which decodes, so long prompts arriving never
    /// stretch its steps. Several, comma-separated, in any number against the decode devices
    /// (one prefill GPU for two decoders: `--prefill-device cuda:0 --decode-device
    /// cuda:1,cuda:2`): every decode engine reaches every prefill engine, a prompt goes to the
    /// least busy, and the decode engines are copies (--data-parallel-size).
    #[arg(long, requires = "decode_device", value_delimiter = ',')]
    prefill_device: Vec<DeviceChoice>,
    /// Disaggregated serving: the device that decodes (see --prefill-device); several,
    /// comma-separated.
    #[arg(long, requires = "prefill_device", value_delimiter = ',')]
    decode_device: Vec<DeviceChoice>,
    /// Plan and queue each step before the last one's tokens are read, so that the device
    /// does not wait for the host between steps (the tokens go from the GPU's draws straight
    /// into the next pass). Outputs are the same either way. While speculating, the steps in
    /// which drafting would gain less than this are pipelined. [default: on a GPU; not with
    /// --speculative-model]
    #[arg(long, conflicts_with = "no_async_scheduling")]
    async_scheduling: bool,
    /// Read each step's tokens before planning the next.
    #[arg(long)]
    no_async_scheduling: bool,
    /// Serve waiting requests by their priority (lowest first) instead of by arrival.
    #[arg(long)]
    priority_scheduling: bool,
    /// Turn off automatic prefix caching.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Speculative decoding: guess up to this many tokens per request and step, and check the
    /// guesses in the same forward pass (0: off). Outputs are the same either way.
    #[arg(long, default_value_t = 0)]
    speculative_tokens: usize,
    /// Who guesses, comma-separated: `ngram` (prompt lookup: what followed the output's last
    /// tokens earlier in the prompt and output) and `grammar` (the constraint's forced tokens).
    #[arg(long, default_value = "ngram,grammar", value_parser = parse_proposers)]
    speculative_proposers: Proposers,
    /// Check every draft the proposers make, up to --speculative-tokens, instead of only as
    /// many as each request's recent acceptance and the batch's load make worth it.
    #[arg(long)]
    speculative_always: bool,
    /// A smaller model with the same tokenizer to guess with (a GGUF file or model
    /// directory, on the same device, with a KV cache of its own); prompt lookup then stands
    /// aside.
    #[arg(long)]
    speculative_model: Option<PathBuf>,
    /// Take the KV cache's memory at start (servers), not as blocks are first used.
    #[arg(skip)]
    prefault_kv: Prefault,
}

/// Which proposers `--speculative-proposers` names.
#[derive(Clone, Copy, Debug)]
pub struct Proposers {
    ngram: bool,
    grammar: bool,
}

fn parse_proposers(text: &str) -> Result<Proposers, String> {
    let mut p = Proposers {
        ngram: false,
        grammar: false,
    };
    for name in text.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        match name {
            "ngram" => p.ngram = true,
            "grammar" => p.grammar = true,
            other => return Err(format!("`{other}` is not a proposer (ngram, grammar)")),
        }
    }
    if !(p.ngram || p.grammar) {
        return Err("name at least one proposer (ngram, grammar)".into());
    }
    Ok(p)
}

fn parse_load_format(text: &str) -> Result<LoadFormat, String> {
    match text {
        "auto" => Ok(LoadFormat::Auto),
        "dummy" => Ok(LoadFormat::Dummy),
        other => Err(format!("`{other}` is not a load format (auto, dummy)")),
    }
}

/// `512MiB`, `2GiB`, `1.5GB`, or plain bytes.
fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let number: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a size (e.g. 512MiB, 2GiB)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        u => return Err(format!("unknown size unit `{u}` (use B, KiB, MiB, GiB, KB, MB, GB)")),
    };
    if !(number.is_finite() && number > 0.0) {
        return Err(format!("`{text}`: the size must be positive"));
    }
    Ok((number * scale) as u64)
}

/// The default KV cache: a fifth of the memory available now, between 256 MiB and 4 GiB.
fn default_kv_cache_memory() -> u64 {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kib| kib * 1024)
    });
    (available.unwrap_or(4 << 30) / 5).clamp(256 << 20, 4 << 30)
}

impl ModelArgs {
    fn load(&self) -> anyhow::Result<(Box<dyn Backend>, Tokenizer)> {
        self.load_on(self.device)
    }

    /// The engine's client: one engine on --device, several copies of it
    /// (--data-parallel-size), or prefill and decode engines (on --prefill-device and
    /// --decode-device) joined by KV links.
    pub(crate) fn client(&self) -> anyhow::Result<(EngineClient, Arc<Tokenizer>, String)> {
        if !self.prefill_device.is_empty() {
            return self.disaggregated();
        }
        if self.data_parallel_size > 1 {
            return self.replicas();
        }
        let (engine, tokenizer) = self.engine()?;
        let device = engine.backend().device_name();
        Ok((EngineClient::start(engine), tokenizer, device))
    }

    /// A prefill engine on each --prefill-device and a decode engine on each --decode-device,
    /// every decode engine joined to every prefill engine by a KV link; the decode engines are
    /// copies behind one client.
    fn disaggregated(&self) -> anyhow::Result<(EngineClient, Arc<Tokenizer>, String)> {
        let nd = self.decode_device.len();
        anyhow::ensure!(
            self.data_parallel_size == 1 || usize::from(self.data_parallel_size) == nd,
            "--data-parallel-size {} with {nd} decode device(s): the decode engines are the copies; drop it",
            self.data_parallel_size
        );
        let mut gpus: Vec<usize> = self
            .prefill_device
            .iter()
            .chain(&self.decode_device)
            .filter_map(|d| match d {
                DeviceChoice::Cuda(n) => Some(*n),
                _ => None,
            })
            .collect();
        gpus.sort_unstable();
        if let Some(w) = gpus.windows(2).find(|w| w[0] == w[1]) {
            anyhow::bail!(
                "cuda:{} is named twice in --prefill-device/--decode-device: each engine needs a GPU of its own",
                w[0]
            );
        }
        anyhow::ensure!(
            self.tensor_parallel_size == 1,
            "--tensor-parallel-size with --prefill-device/--decode-device is not supported yet: each engine runs on one device"
        );
        anyhow::ensure!(
            self.speculative_model.is_none(),
            "--speculative-model with --prefill-device/--decode-device is not supported yet"
        );
        anyhow::ensure!(
            !self.no_prefix_caching,
            "disaggregated serving hands prompts over through the prefix cache: drop --no-prefix-caching"
        );
        let config = self.engine_config()?;
        let mut tokenizer = None;
        let mut load = |device: DeviceChoice| -> anyhow::Result<Box<dyn Backend>> {
            let (backend, tok) = self.load_on(device)?;
            tokenizer.get_or_insert(tok);
            Ok(backend)
        };
        let mut prefill: Vec<Box<dyn Backend>> =
            self.prefill_device.iter().map(|&d| load(d)).collect::<Result<_, _>>()?;
        let mut decode: Vec<Box<dyn Backend>> =
            self.decode_device.iter().map(|&d| load(d)).collect::<Result<_, _>>()?;
        let tokenizer = Arc::new(tokenizer.expect("at least one device"));
        let links = KvLink::join_all(&mut prefill, &self.prefill_device, &mut decode, &self.decode_device)?;
        let names = |side: &[Box<dyn Backend>]| side.iter().map(|b| b.device_name()).collect::<Vec<_>>().join(", ");
        let name = format!("prefill {}, decode {}", names(&prefill), names(&decode));
        let engines = |side: Vec<Box<dyn Backend>>| -> Vec<EngineCore> {
            side.into_iter()
                .map(|b| EngineCore::new(b, tokenizer.clone(), config))
                .collect()
        };
        let (prefill, decode) = (engines(prefill), engines(decode));
        let client = EngineClient::disaggregated(prefill, decode, &links).map_err(anyhow::Error::msg)?;
        Ok((client, tokenizer, name))
    }

    /// How many backends load the model: --data-parallel-size copies, or every prefill and
    /// decode engine (which share the CPU's default cache).
    fn backends(&self) -> usize {
        usize::from(self.data_parallel_size).max(self.prefill_device.len() + self.decode_device.len())
    }

    /// --data-parallel-size copies of the engine, each on devices of its own, behind one client.
    fn replicas(&self) -> anyhow::Result<(EngineClient, Arc<Tokenizer>, String)> {
        let copies = usize::from(self.data_parallel_size);
        let devices: Vec<DeviceChoice> = match self.device.resolve()? {
            crate::runtime::Device::Cpu => vec![DeviceChoice::Cpu; copies],
            crate::runtime::Device::Cuda(first) => {
                let (step, count) = (
                    usize::from(self.tensor_parallel_size),
                    crate::runtime::device::cuda_devices().map_err(anyhow::Error::msg)?,
                );
                let wanted = first + copies * step;
                anyhow::ensure!(
                    wanted <= count,
                    "--data-parallel-size {copies} x --tensor-parallel-size {step} from cuda:{first} needs GPUs up to cuda:{}; this machine has {count}",
                    wanted - 1
                );
                (0..copies).map(|r| DeviceChoice::Cuda(first + r * step)).collect()
            }
        };
        let mut cores = Vec::new();
        let mut tokenizer = None;
        for &device in &devices {
            let (core, tok) = self.engine_on(device)?;
            cores.push(core);
            tokenizer = Some(tok);
        }
        let names: Vec<String> = cores.iter().map(|c| c.backend().device_name()).collect();
        let client = EngineClient::start_replicas(cores).map_err(anyhow::Error::msg)?;
        let tokenizer = tokenizer.expect("at least two copies");
        Ok((client, tokenizer, format!("{copies} copies: {}", names.join(", "))))
    }

    fn load_on(&self, device: DeviceChoice) -> anyhow::Result<(Box<dyn Backend>, Tokenizer)> {
        if let Some(n) = self.threads {
            anyhow::ensure!(n > 0, "--threads must be at least 1");
            // Read once by candle's thread pool, which has not started yet.
            std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
            std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        }
        anyhow::ensure!(
            self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0,
            "--gpu-memory-utilization must be in (0, 1]"
        );
        let path = self.model.clone().unwrap_or_else(crate::model_path::default_model_path);
        let tokenizer = Tokenizer::from_model_file(&path)?;
        let model_config = match &self.model_config {
            None => None,
            Some(name) => Some(match ModelConfig::preset(name) {
                Some(c) => c,
                None => {
                    let text = std::fs::read_to_string(name).map_err(|e| {
                        anyhow::anyhow!("--model-config {name}: not a preset (llama-3.1-8b, llama-3.1-70b, qwen2.5-7b) nor a readable file: {e}")
                    })?;
                    ModelConfig::from_hf_json(&text)?
                }
            }),
        };
        // Without --kv-cache-*, the CPU's pool is a share of host memory (its options carry
        // the default); the GPU's, of device memory.
        let options = LoadOptions {
            load_format: self.load_format,
            model_config,
            kv_cache_tokens: self.kv_cache_tokens,
            kv_cache_bytes: self.kv_cache_memory,
            cpu: CpuOptions {
                kv_cache_bytes: Some(default_kv_cache_memory() / self.backends() as u64),
                prefault_kv: self.prefault_kv,
                ..Default::default()
            },
            gpu_memory_utilization: Some(self.gpu_memory_utilization),
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            for_drafts: false,
            enforce_eager: self.enforce_eager,
            batch_invariant: self.batch_invariant,
            tensor_parallel_size: self.tensor_parallel_size.into(),
        };
        let backend = crate::runtime::load(device, &path, options)?;
        Ok((backend, tokenizer))
    }
}

impl ModelArgs {
    /// The model and tokenizer behind an engine with the default configuration.
    fn engine(&self) -> anyhow::Result<(EngineCore, Arc<Tokenizer>)> {
        self.one_copy()?;
        self.engine_on(self.device)
    }

    /// Refuses --data-parallel-size for commands that run one engine.
    fn one_copy(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.data_parallel_size == 1,
            "--data-parallel-size serves through `quarry serve`, `extract` and `bench interference`; this command runs one engine"
        );
        Ok(())
    }

    /// `engine`, on `device`.
    fn engine_on(&self, device: DeviceChoice) -> anyhow::Result<(EngineCore, Arc<Tokenizer>)> {
        let draft = self.draft_model_on(device)?;
        let (backend, tokenizer) = self.load_on(device)?;
        let tokenizer = Arc::new(tokenizer);
        let config = self.engine_config()?;
        let mut engine = EngineCore::new(backend, tokenizer.clone(), config);
        if let Some(draft) = draft {
            check_draft(&*draft, &tokenizer)?;
            engine.set_draft_model(draft);
        }
        Ok((engine, tokenizer))
    }

    /// The model of `--speculative-model`, loaded before the main one (which may take a share
    /// of the GPU's memory) with a cache of `DRAFT_KV_TOKENS`.
    pub(crate) fn draft_model(&self) -> anyhow::Result<Option<Box<dyn Backend>>> {
        self.draft_model_on(self.device)
    }

    /// `draft_model`, on `device`.
    fn draft_model_on(&self, device: DeviceChoice) -> anyhow::Result<Option<Box<dyn Backend>>> {
        let Some(path) = &self.speculative_model else {
            return Ok(None);
        };
        anyhow::ensure!(
            self.speculative_tokens > 0,
            "--speculative-model guesses only with --speculative-tokens K (K > 0)"
        );
        let options = LoadOptions {
            kv_cache_tokens: Some(DRAFT_KV_TOKENS),
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            for_drafts: true,
            enforce_eager: self.enforce_eager,
            ..Default::default()
        };
        let backend = crate::runtime::load(device, path, options)
            .map_err(|e| anyhow::anyhow!("--speculative-model {}: {e}", path.display()))?;
        Ok(Some(backend))
    }

    /// The model's name as the API reports it: its file name without `.gguf`.
    fn model_name(&self) -> String {
        let path = self.model.clone().unwrap_or_else(crate::model_path::default_model_path);
        path.file_stem().unwrap_or_default().to_string_lossy().into_owned()
    }

    /// The model, tokenizer and engine configuration, for commands that build several engines
    /// over one backend.
    fn load_shared(&self) -> anyhow::Result<(Box<dyn Backend>, Arc<Tokenizer>, EngineConfig)> {
        self.one_copy()?;
        let (backend, tokenizer) = self.load()?;
        Ok((backend, Arc::new(tokenizer), self.engine_config()?))
    }

    fn engine_config(&self) -> anyhow::Result<EngineConfig> {
        anyhow::ensure!(
            self.max_num_batched_tokens > 0,
            "--max-num-batched-tokens must be at least 1"
        );
        anyhow::ensure!(self.max_num_seqs > 0, "--max-num-seqs must be at least 1");
        let path = self.model.clone().unwrap_or_else(crate::model_path::default_model_path);
        let mut config = EngineConfig {
            cache_key: cache_key(&path),
            prefix_caching: !self.no_prefix_caching,
            ..Default::default()
        };
        anyhow::ensure!(
            !(self.async_scheduling && self.speculative_model.is_some()),
            "--async-scheduling plans a step before the last one's tokens are known, which a draft \
             model's sequences follow: use it without --speculative-model"
        );
        config.async_scheduling = match (self.async_scheduling, self.no_async_scheduling) {
            (true, _) => crate::engine::AsyncScheduling::On,
            (_, true) => crate::engine::AsyncScheduling::Off,
            _ => crate::engine::AsyncScheduling::Auto,
        };
        config.scheduler.max_num_batched_tokens = self.max_num_batched_tokens;
        config.scheduler.max_num_seqs = self.max_num_seqs;
        if self.priority_scheduling {
            config.scheduler.policy = crate::engine::Policy::Priority;
        }
        config.speculative = (self.speculative_tokens > 0).then_some(crate::engine::SpeculativeConfig {
            tokens: self.speculative_tokens,
            ngram: self.speculative_proposers.ngram,
            grammar: self.speculative_proposers.grammar,
            adaptive: !self.speculative_always,
        });
        Ok(config)
    }
}

/// Tokens the draft model's KV cache holds, over every request it drafts for.
const DRAFT_KV_TOKENS: usize = 1 << 17;

/// A draft model must cover the tokenizer's vocabulary to guess in it.
pub(crate) fn check_draft(draft: &dyn Backend, tokenizer: &Tokenizer) -> anyhow::Result<()> {
    anyhow::ensure!(
        draft.config().vocab_size >= tokenizer.vocab_size(),
        "--speculative-model has {} tokens, the model's tokenizer {}: they must share the tokenizer",
        draft.config().vocab_size,
        tokenizer.vocab_size()
    );
    Ok(())
}

/// Keeps prefix caches of different model files apart.
fn cache_key(path: &std::path::Path) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    path.file_name().hash(&mut h);
    h.finish()
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    crate::logging::init(cli.log_format);
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Extract(args) => extract::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Serve(args) => serve::run(args),
        Command::Worker(args) => serve::worker(args),
        Command::Openapi(args) => serve::openapi(args),
        Command::ExportTokenizer(args) => export_tokenizer(args),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2 GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3 parsecs").unwrap_err().contains("parsecs"));
        assert!(parse_size("-1GiB").is_err());
    }
}
