//! `GET /metrics`: the service's metrics in the Prometheus text format.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use super::AppState;

#[utoipa::path(
    get,
    path = "/metrics",
    tag = "service",
    responses((status = 200, description = "Prometheus / OpenMetrics text", content_type = "application/openmetrics-text", body = String))
)]
pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let text = state.service.render_metrics();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
}
