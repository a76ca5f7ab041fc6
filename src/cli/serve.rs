//! `quarry serve`: the HTTP service on the engine; `quarry openapi`: its OpenAPI document.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use std::time::Duration;

use super::ModelArgs;
use crate::extract::Extractor;
use crate::jobs::{self, Worker, WorkerConfig};
use crate::runtime::cpu::Prefault;
use crate::server::{self, AppState};
use crate::service::Service;

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
    /// Most engine requests waiting or running at once (at least 1); past it, /extract and
    /// the OpenAI endpoints answer 429 with Retry-After and job items wait.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    max_pending: u64,
    /// Folder of ready-made schemas, addressed by file name without `.json`.
    #[arg(long, default_value = "schemas")]
    schemas: PathBuf,
    #[command(flatten)]
    jobs: JobArgs,
}

/// Where batch jobs are kept, and how this process works on them.
#[derive(Args)]
pub struct JobArgs {
    /// Where Quarry keeps its state (the default job store, `jobs.sqlite3`)
    /// [default: $XDG_DATA_HOME/quarry or ~/.local/share/quarry]
    #[arg(long, env = "QUARRY_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// The job store: `sqlite:PATH`, or a `postgres://` URL that every process working on the
    /// same jobs shares [default: SQLite in --state-dir]
    #[arg(long, env = "QUARRY_JOB_STORE")]
    job_store: Option<String>,
    /// Seconds a claimed job item stays this process's without a heartbeat; a process that
    /// dies gives its items back after this long.
    #[arg(long, default_value_t = 30.0)]
    job_lease: f64,
    /// Job items this process runs at once (0: it runs none, and only accepts and serves
    /// jobs that other processes on the same store run).
    #[arg(long, default_value_t = 32)]
    job_concurrency: usize,
    /// Hours a finished job (its results) and an uploaded file are kept before they are
    /// deleted (e.g. 168 for a week); 0, the default, keeps them until deleted (`DELETE
    /// /jobs/{id}`, `DELETE /v1/files/{id}`).
    #[arg(long, default_value_t = 0.0)]
    job_retention: f64,
}

impl JobArgs {
    /// The store and this process's worker on it; an unreachable store is an error here,
    /// before anything is served.
    pub fn worker(&self) -> anyhow::Result<Arc<Worker>> {
        anyhow::ensure!(
            self.job_lease.is_finite() && self.job_lease >= 1.0,
            "--job-lease must be at least 1 second"
        );
        let dir = self.state_dir.clone().unwrap_or_else(jobs::default_state_dir);
        let store = jobs::open(self.job_store.as_deref(), &dir)?;
        let retention = Duration::try_from_secs_f64(self.job_retention * 3600.0)
            .map_err(|_| anyhow::anyhow!("--job-retention must be a number of hours, 0 or more"))?;
        let config = WorkerConfig {
            slots: self.job_concurrency,
            lease: Duration::from_secs_f64(self.job_lease),
            retention: (!retention.is_zero()).then_some(retention),
            ..WorkerConfig::default()
        };
        Ok(Worker::new(store, config))
    }
}

pub fn run(mut args: ServeArgs) -> anyhow::Result<()> {
    // A server's memory is claimed before it reports ready: its footprint stays flat under
    // load. Backing the pool in the background instead slowed the first requests (under
    // `scripts/bench-server load`, p99 13 s against 5 s).
    args.model.prefault_kv = Prefault::AtLoad;
    let addr = SocketAddr::new(args.host, args.port);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(server::serve_when_ready(addr, move || {
        app_state(
            &args.model,
            &args.schemas,
            &args.jobs,
            args.api_key,
            args.max_pending as usize,
        )
    }))
}

/// The server's state: the job store first (an unreachable one fails before the model
/// loads), then the model and its engine.
fn app_state(
    model_args: &ModelArgs,
    schemas: &std::path::Path,
    job_args: &JobArgs,
    api_keys: Vec<String>,
    max_pending: usize,
) -> anyhow::Result<Arc<AppState>> {
    let schemas = crate::service::schemas::SchemaRegistry::load(schemas)?;
    let jobs = job_args.worker()?;
    let (client, tokenizer, device) = model_args.client()?;
    let model = model_args.model_name();
    let steps = match client.pipelining() {
        true => "steps pipelined (--no-async-scheduling turns it off)",
        false => "steps not pipelined",
    };
    let invariant = match client.batch_invariant() {
        true => "batch-invariant",
        false => "not batch-invariant (--batch-invariant makes it so)",
    };
    tracing::info!("quarry: model {model} on {device}; {steps}; {invariant}");
    let extractor = Arc::new(Extractor::new(client, tokenizer));
    Ok(Arc::new(AppState {
        service: Arc::new(Service::new(model, device, extractor, schemas, max_pending)),
        api_keys,
        jobs,
    }))
}

#[derive(Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Folder of ready-made schemas, for batch lines that name one by `schema_id`.
    #[arg(long, default_value = "schemas")]
    schemas: PathBuf,
    #[command(flatten)]
    jobs: JobArgs,
}

/// `quarry worker`: works on the store's jobs (extraction jobs and batches) and serves no
/// HTTP, until Ctrl-C or SIGTERM; then finishes the items it has and stops.
pub fn worker(mut args: WorkerArgs) -> anyhow::Result<()> {
    args.model.prefault_kv = Prefault::AtLoad;
    anyhow::ensure!(
        args.jobs.job_concurrency > 0,
        "a worker needs --job-concurrency of at least 1"
    );
    let state = app_state(&args.model, &args.schemas, &args.jobs, Vec::new(), usize::MAX)?;
    tracing::info!("quarry: worker {} on the job store", state.jobs.owner());
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(server::work(state))
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
