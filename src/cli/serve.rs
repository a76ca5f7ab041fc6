//! `quarry serve`: the HTTP service on the engine; `quarry openapi`: its OpenAPI document.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use super::ModelArgs;
use crate::engine::EngineClient;
use crate::extract::Extractor;
use crate::runtime::cpu::Prefault;
use crate::server::{self, AppState};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// 0 picks a free port (printed on stderr).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on the API (repeatable; also $QUARRY_API_KEY).
    #[arg(long, env = "QUARRY_API_KEY")]
    api_key: Vec<String>,
    /// Most requests waiting or running at once; past it, /extract answers 429 with
    /// Retry-After.
    #[arg(long, default_value_t = 1024)]
    max_pending: usize,
    /// Folder of ready-made schemas, addressed by file name without `.json`.
    #[arg(long, default_value = "schemas")]
    schemas: PathBuf,
}

pub fn run(mut args: ServeArgs) -> anyhow::Result<()> {
    // A server's memory is claimed before it reports ready: its footprint stays flat under
    // load. Backing the pool in the background instead slowed the first requests (under
    // `scripts/bench-server load`, p99 13 s against 5 s).
    args.model.prefault_kv = Prefault::AtLoad;
    let schemas = server::schemas::SchemaRegistry::load(&args.schemas)?;
    let (engine, tokenizer) = args.model.engine()?;
    let model = args.model.model_name();
    let device = engine.backend().device_name();
    eprintln!("quarry: model {model} on {device}");
    let mut metrics = server::metrics::Metrics::default();
    metrics.register_device(&device);
    let state = Arc::new(AppState {
        extractor: Arc::new(Extractor::new(EngineClient::start(engine), tokenizer)),
        schemas,
        model,
        device,
        api_keys: args.api_key,
        metrics,
        max_pending: args.max_pending,
        jobs: Default::default(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(server::serve(state, SocketAddr::new(args.host, args.port)))
}

#[derive(Args)]
pub struct OpenApiArgs {
    /// Write the document here instead of stdout (openapi/openapi.json in this repository).
    #[arg(long)]
    output: Option<PathBuf>,
}

pub fn openapi(args: OpenApiArgs) -> anyhow::Result<()> {
    let spec = server::openapi::spec_json();
    match args.output {
        Some(path) => std::fs::write(&path, spec).map_err(|e| anyhow::anyhow!("{}: {e}", path.display())),
        None => {
            print!("{spec}");
            Ok(())
        }
    }
}
