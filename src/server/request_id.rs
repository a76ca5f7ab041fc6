//! Every request gets an id: the caller's `X-Request-Id` where it sent a usable one (up to 128
//! visible ASCII characters), else a fresh one. The id names the request's `tracing` span, so
//! each line logged while the request is served carries it, and goes back in the response's
//! `X-Request-Id`; one line logs the request's end with its status and duration.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

pub const HEADER: &str = "x-request-id";

pub async fn request_id(request: Request, next: Next) -> Response {
    let id = request
        .headers()
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(fresh, str::to_string);
    let span = tracing::info_span!("request", id = %id, method = %request.method(), path = %request.uri().path());
    let start = Instant::now();
    let mut response = next.run(request).instrument(span.clone()).await;
    span.in_scope(|| {
        tracing::info!(
            status = response.status().as_u16(),
            ms = (start.elapsed().as_secs_f64() * 1e3).round() as u64,
            "quarry: request done"
        )
    });
    if let Ok(v) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(HEADER, v);
    }
    response
}

/// A process-unique id: a random prefix chosen once, then a counter.
fn fresh() -> String {
    use std::hash::{BuildHasher, Hasher};
    static PREFIX: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let prefix = PREFIX.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(std::process::id() as u64);
        h.finish() as u32
    });
    format!("{prefix:08x}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}
