//! The `quarry` command line: one subcommand per job, each a thin layer over the library.

mod bench;
mod extract;
mod generate;

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};

use crate::engine::{EngineConfig, EngineCore};
use crate::runtime::cpu::{CpuBackend, CpuOptions};
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
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming tokens to stdout.
    Generate(generate::GenerateArgs),
    /// Extract one JSON object matching a schema from a document.
    Extract(extract::ExtractArgs),
    /// Measure the engine's speed.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

/// Options every command that loads a model shares.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// GGUF model file [default: models/SmolLM2-135M-Instruct.Q4_1.gguf, or $QUARRY_MODEL]
    #[arg(long)]
    model: Option<PathBuf>,
    /// CPU threads for the model [default: all cores]
    #[arg(long)]
    threads: Option<usize>,
    /// KV cache capacity in tokens.
    #[arg(long, default_value_t = 16384)]
    kv_cache_tokens: usize,
}

impl ModelArgs {
    fn load(&self) -> anyhow::Result<(CpuBackend, Tokenizer)> {
        if let Some(n) = self.threads {
            anyhow::ensure!(n > 0, "--threads must be at least 1");
            // Read once by candle's thread pool, which has not started yet.
            std::env::set_var("CANDLE_NUM_THREADS", n.to_string());
            std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        }
        let path = self.model.clone().unwrap_or_else(crate::model_path::default_model_path);
        let tokenizer = Tokenizer::from_model_file(&path)?;
        let options = CpuOptions {
            kv_cache_tokens: self.kv_cache_tokens,
            ..Default::default()
        };
        let backend = CpuBackend::load(&path, &options)?;
        Ok((backend, tokenizer))
    }
}

impl ModelArgs {
    /// The model and tokenizer behind an engine with the default configuration.
    fn engine(&self) -> anyhow::Result<(EngineCore, Arc<Tokenizer>)> {
        let (backend, tokenizer) = self.load()?;
        let tokenizer = Arc::new(tokenizer);
        let path = self.model.clone().unwrap_or_else(crate::model_path::default_model_path);
        let config = EngineConfig {
            cache_key: cache_key(&path),
            ..Default::default()
        };
        Ok((EngineCore::new(Box::new(backend), tokenizer.clone(), config), tokenizer))
    }
}

/// Keeps prefix caches of different model files apart.
fn cache_key(path: &std::path::Path) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    path.file_name().hash(&mut h);
    h.finish()
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Extract(args) => extract::run(args),
        Command::Bench(cmd) => bench::run(cmd),
    }
}
