//! A refused request's unread body is read off the connection (up to a bound) before the
//! refusal goes out. hyper closes a connection whose request body was left unread, and a
//! socket closed with unread bytes in it is reset: a client still sending a body too large for
//! its route would get a connection reset instead of its 413 (a lingering close, done here
//! because hyper does not do one). Past the bound (64 MiB over the route's limit) the
//! connection is closed as before.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;
use http_body::{Frame, SizeHint};
use tokio::sync::oneshot;

/// Most bytes read off a refused body; past them the connection is closed as before.
const DRAIN_BYTES: usize = 64 << 20;
/// Longest time spent reading a refused body (a slow sender is not waited for).
const DRAIN_TIME: Duration = Duration::from_secs(10);

/// Middleware: lends the handler the request body, gets back what it left unread, and reads
/// that off before the response is sent.
pub async fn linger(request: Request, next: Next) -> Response {
    let (back, mut returned) = oneshot::channel();
    let request = request.map(|body| {
        Body::new(Lent {
            body: Some(body),
            back: Some(back),
            read: false,
        })
    });
    let response = next.run(request).await;
    // Handed back only where the handler dropped the body before its end.
    if let Ok(rest) = returned.try_recv() {
        drain(rest).await;
    }
    response
}

async fn drain(body: Body) {
    let mut data = body.into_data_stream();
    let mut read = 0;
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        while let Some(Ok(chunk)) = data.next().await {
            read += chunk.len();
            if read > DRAIN_BYTES {
                break;
            }
        }
    })
    .await;
}

/// The request body as the handler sees it; dropped before its end, it goes back to `linger`.
struct Lent {
    body: Option<Body>,
    back: Option<oneshot::Sender<Body>>,
    /// Whether the handler started reading. A body refused unread (401, 404, 415, ...) is
    /// not drained: hyper has not sent `100 Continue` for it, so a client that waits for one
    /// never sends it, and nobody is made to upload what was refused at its headers.
    read: bool,
}

impl HttpBody for Lent {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.read = true;
        match self.body.as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.body
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint)
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let (Some(body), Some(back)) = (self.body.take(), self.back.take()) {
            if self.read && !body.is_end_stream() {
                let _ = back.send(body);
            }
        }
    }
}
