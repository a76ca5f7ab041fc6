//! The HTTP service (axum): routes, API types, errors. It validates requests, builds prompts
//! and hands them to the engine through `EngineClient`; nothing here knows tensors.

pub mod batches;
pub mod error;
mod extract;
pub mod jobs;
mod linger;
mod metrics;
pub mod openai;
pub mod openapi;
mod request_id;
pub mod schemas;
mod ui;

use crate::service::ErrorKind;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::service::Service;
use api::Health;
use error::ApiError;

pub use crate::service::api;

/// Largest request body: a document of a few hundred pages.
pub const MAX_BODY_BYTES: usize = 4 << 20;
/// Largest batch job body: tens of thousands of documents.
pub const MAX_JOB_BYTES: usize = 256 << 20;

pub struct AppState {
    /// Every request's way into the engine: admission (`--max-pending`; past it, 429),
    /// extraction, schemas, metrics.
    pub service: Arc<Service>,
    /// Accepted bearer tokens; none means no authentication.
    pub api_keys: Vec<String>,
    /// This process's worker on the job store (which it also hands out to the handlers).
    pub jobs: Arc<crate::jobs::Worker>,
}

/// Counts a handler's result under `endpoint` where it failed (a success counts itself, when
/// its outcome is known).
pub(crate) fn count_error<T>(state: &AppState, endpoint: crate::service::Endpoint, result: &Result<T, ApiError>) {
    if let Err(e) = result {
        state.service.count(endpoint, e.detail.kind.as_str());
    }
}

/// `axum::Json` whose rejections are JSON errors (`ApiError`).
#[derive(FromRequest)]
#[from_request(via(Json), rejection(ApiError))]
pub struct ApiJson<T>(pub T);

/// `axum::extract::Query` whose rejections are JSON errors.
#[derive(FromRequestParts)]
#[from_request(via(Query), rejection(ApiError))]
pub struct ApiQuery<T>(pub T);

/// `axum::extract::Multipart` whose rejections (not a multipart form) are JSON errors.
pub struct ApiMultipart(pub axum::extract::Multipart);

impl<S: Send + Sync> FromRequest<S> for ApiMultipart {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        Ok(ApiMultipart(axum::extract::Multipart::from_request(req, state).await?))
    }
}

/// A raw body whose rejections (over the size limit) are JSON errors.
pub struct ApiBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        Ok(ApiBody(Bytes::from_request(req, state).await?))
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    let protected = Router::new()
        .route("/extract", post(extract::extract))
        .route("/schemas", post(schemas::register).get(schemas::list))
        .route("/schemas/{id}", get(schemas::get_one))
        .route("/jobs", post(jobs::create).layer(DefaultBodyLimit::max(MAX_JOB_BYTES)))
        .route("/jobs/{id}", get(jobs::status).delete(jobs::delete))
        .route("/jobs/{id}/results", get(jobs::results))
        .route("/jobs/{id}/retry", post(jobs::retry))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route(
            "/v1/files",
            post(batches::upload).layer(DefaultBodyLimit::max(MAX_JOB_BYTES)),
        )
        .route("/v1/files/{id}", get(batches::file_info).delete(batches::delete_file))
        .route("/v1/files/{id}/content", get(batches::file_bytes))
        .route("/v1/batches", post(batches::create).get(batches::list))
        .route("/v1/batches/{id}", get(batches::retrieve))
        .route("/v1/batches/{id}/cancel", post(batches::cancel))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics::metrics))
        .route("/openapi.json", get(openapi_json))
        .route("/ui", get(ui::page))
        .route("/ui/app.js", get(ui::script))
        .route("/ui/app.css", get(ui::style))
        .merge(protected)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(linger::linger))
        .layer(middleware::from_fn(request_id::request_id))
        .with_state(state)
}

/// Listens on `addr` at once, answering 503 `starting` (and `GET /health` with `{"status":
/// "starting"}`) while `load` builds the state (the model loads), then serves the API on the
/// same server: a load balancer can tell a replica that is starting from one that is down.
/// One server from start to end, because handing the socket from a "starting" server to the
/// real one closed connections that were accepted but not yet read at the hand-over.
/// Serves until Ctrl-C or SIGTERM, then lets running requests finish.
pub async fn serve_when_ready(
    addr: SocketAddr,
    load: impl FnOnce() -> anyhow::Result<Arc<AppState>> + Send + 'static,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    let local = listener.local_addr()?;
    tracing::info!("quarry: starting on http://{local}");
    let api: Arc<std::sync::OnceLock<Router>> = Arc::default();
    let front = Router::new().fallback(until_ready).with_state(api.clone());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut serving = tokio::spawn(
        axum::serve(listener, front)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .into_future(),
    );
    let state = match tokio::task::spawn_blocking(load).await {
        Ok(Ok(state)) => state,
        failed => {
            let _ = stop.send(());
            let _ = serving.await;
            return Err(failed
                .map_err(anyhow::Error::from)
                .and_then(|r| r)
                .err()
                .expect("a failure"));
        }
    };
    let _ = api.set(router(state.clone()));
    // Tests and scripts read this line to find the port (`--port 0` picks a free one): from
    // here on the API answers.
    tracing::info!("quarry: listening on http://{local}");
    let worker = spawn_worker(&state);
    tokio::select! {
        _ = shutdown_signal() => {}
        ended = &mut serving => return Ok(ended??),
        why = backend_broken(&state) => {
            // Every request from here on would fail: better a clear exit that a supervisor
            // restarts than a server answering 500s. Job items in flight go back to the store
            // when their lease runs out.
            tracing::error!("quarry: the model's backend can run nothing more ({why}); exiting");
            state.jobs.stop();
            let _ = stop.send(());
            return Err(anyhow::anyhow!("the model's backend failed: {why}"));
        }
    }
    tracing::info!("quarry: draining running requests");
    // No new job items from the signal on (open streams may keep the server up a while):
    // those in flight finish and are written, the rest stay queued.
    state.jobs.stop();
    let _ = stop.send(());
    serving.await??;
    let _ = worker.await;
    tokio::task::spawn_blocking(move || state.service.shutdown()).await?;
    Ok(())
}

/// Resolves once the engine's backend says it can run nothing more (`Backend::broken`).
async fn backend_broken(state: &AppState) -> String {
    loop {
        if let Some(why) = state.service.stats().broken {
            return why;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// Every request goes to the API once it is loaded; before that, the starting answers.
async fn until_ready(State(api): State<Arc<std::sync::OnceLock<Router>>>, request: Request) -> Response {
    use tower::ServiceExt;
    match api.get() {
        Some(router) => match router.clone().oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        },
        None if request.uri().path() == "/health" => health_starting().await.into_response(),
        None => starting().await.into_response(),
    }
}

async fn health_starting() -> (StatusCode, Json<serde_json::Value>) {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(serde_json::json!({"status": "starting"})),
    )
}

async fn starting() -> ApiError {
    let mut e = ApiError::new(
        ErrorKind::Starting,
        "the server is loading its model; try again shortly",
    );
    e.retry_after = Some(1);
    e
}

/// Works on the job store until Ctrl-C or SIGTERM, serving nothing (`quarry worker`); then the
/// items in flight finish and are written, and the rest stay queued for other processes.
pub async fn work(state: Arc<AppState>) -> anyhow::Result<()> {
    let worker = spawn_worker(&state);
    shutdown_signal().await;
    tracing::info!("quarry: finishing the job items in flight");
    state.jobs.stop();
    let _ = worker.await;
    tokio::task::spawn_blocking(move || state.service.shutdown()).await?;
    Ok(())
}

fn spawn_worker(state: &Arc<AppState>) -> tokio::task::JoinHandle<()> {
    let service = state.service.clone();
    tokio::spawn(state.jobs.clone().run(
        move |work| {
            let service = service.clone();
            async move { crate::jobs::runners::run_item(&service, work).await }
        },
        crate::jobs::runners::failed_item,
    ))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

async fn require_key(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if state.api_keys.is_empty() {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|k| state.api_keys.iter().any(|a| a == k)) {
        return next.run(request).await;
    }
    ApiError::new(
        ErrorKind::Unauthorized,
        "a valid API key is required: `Authorization: Bearer KEY`",
    )
    .into_response()
}

#[utoipa::path(get, path = "/health", tag = "service", responses((status = 200, body = Health)))]
async fn health(State(state): State<Arc<AppState>>) -> Json<Health> {
    let s = state.service.stats();
    Json(Health {
        status: "ok".into(),
        model: state.service.model.clone(),
        device: state.service.device.clone(),
        batch_invariant: state.service.batch_invariant(),
        waiting: s.waiting,
        running: s.running,
        kv_blocks_free: s.kv_blocks_free,
        kv_blocks_total: s.kv_blocks_total,
    })
}

async fn openapi_json() -> impl IntoResponse {
    Json(openapi::spec())
}

async fn not_found() -> ApiError {
    ApiError::new(ErrorKind::NotFound, "no such route")
}
