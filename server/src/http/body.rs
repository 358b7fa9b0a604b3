//! Response bodies: whole JSON documents, and streams fed through a channel (SSE), whose closing tells
//! the generation that the client has gone.

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, SizeHint};
use hyper::{header, Response, StatusCode};
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::mpsc;

pub type RespBody = BoxBody<Bytes, Infallible>;

/// A body whose chunks come from a channel; it ends when every sender is dropped. Dropping the body (the
/// client disconnected) closes the channel, which the sender sees as `closed()`.
pub struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx
            .poll_recv(cx)
            .map(|chunk| chunk.map(|b| Ok(Frame::data(b))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// A streaming response and the sender that feeds it.
pub fn channel_response(content_type: &str) -> (Response<RespBody>, mpsc::Sender<Bytes>) {
    // A small buffer: a client that stops reading slows the generation instead of growing memory.
    let (tx, rx) = mpsc::channel(32);
    let body = ChannelBody { rx }.boxed();
    let mut resp = Response::new(body);
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_str(content_type)
            .unwrap_or(header::HeaderValue::from_static("text/event-stream")),
    );
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    (resp, tx)
}

/// A JSON response with `status`.
pub fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<RespBody> {
    let bytes = Bytes::from(serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec()));
    let mut resp = Response::new(Full::new(bytes).boxed());
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// A plain response with a content type (pages, text).
pub fn bytes_response(
    status: StatusCode,
    content_type: &'static str,
    body: Bytes,
) -> Response<RespBody> {
    let mut resp = Response::new(Full::new(body).boxed());
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    resp
}

/// One server-sent event: `data: <json>\n\n`, with an `event:` line when named (Anthropic names them).
pub fn sse_event(event: Option<&str>, data: &serde_json::Value) -> Bytes {
    let json = serde_json::to_string(data).unwrap_or_else(|_| "{}".into());
    match event {
        Some(name) => Bytes::from(format!("event: {name}\ndata: {json}\n\n")),
        None => Bytes::from(format!("data: {json}\n\n")),
    }
}
