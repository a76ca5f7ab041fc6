//! The review page (`/ui`): a record beside its document, each field's confidence and the words
//! it came from (src/server/ui/*). The files are embedded in the binary, so the page works
//! wherever the server does, with no build step and nothing fetched from elsewhere; it talks to
//! the API like any other client, with the key its user types in.

use axum::http::header;
use axum::response::IntoResponse;

const PAGE: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/app.css");

pub async fn page() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE)
}

pub async fn script() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], SCRIPT)
}

pub async fn style() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE)
}
