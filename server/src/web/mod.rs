//! The web page served at `/`: a chat page (plain HTML, CSS and JavaScript under `server/web/`) embedded in
//! the binary with `include_str!`, so it needs no network and no build step at run time. The page talks to
//! the same HTTP APIs as every other client (`/api/models*`, `/v1/chat/completions` streamed).

use crate::http::body::{bytes_response, RespBody};
use bytes::Bytes;
use hyper::{header, Response, StatusCode};

/// One embedded file: its path under `/`, content type and text.
struct Asset {
    path: &'static str,
    content_type: &'static str,
    text: &'static str,
}

const ASSETS: &[Asset] = &[
    Asset {
        path: "/index.html",
        content_type: "text/html; charset=utf-8",
        text: include_str!("../../web/index.html"),
    },
    Asset {
        path: "/app.js",
        content_type: "text/javascript; charset=utf-8",
        text: include_str!("../../web/app.js"),
    },
    Asset {
        path: "/markdown.js",
        content_type: "text/javascript; charset=utf-8",
        text: include_str!("../../web/markdown.js"),
    },
    Asset {
        path: "/style.css",
        content_type: "text/css; charset=utf-8",
        text: include_str!("../../web/style.css"),
    },
];

/// The page's response for a GET of `path` (with any trailing `/` already removed, so `/` arrives as an
/// empty path), or `None` when `path` is not one of the page's files.
pub fn asset(path: &str) -> Option<Response<RespBody>> {
    let wanted = if path.is_empty() { "/index.html" } else { path };
    let asset = ASSETS.iter().find(|a| a.path == wanted)?;
    let mut resp = bytes_response(
        StatusCode::OK,
        asset.content_type,
        Bytes::from_static(asset.text.as_bytes()),
    );
    // The files change with the binary only; a reload after an upgrade must not keep old scripts.
    resp.headers_mut().insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    Some(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_the_page_and_unknown_paths_are_not_assets() {
        let root = asset("").expect("the page at /");
        assert_eq!(
            root.headers()[header::CONTENT_TYPE],
            "text/html; charset=utf-8"
        );
        assert!(asset("/app.js").is_some());
        assert!(asset("/v1/models").is_none());
        assert!(asset("/../Cargo.toml").is_none());
    }

    #[test]
    fn the_page_loads_only_embedded_files() {
        // No network at run time: every script and stylesheet the page names is one of the assets.
        let page = ASSETS[0].text;
        for attr in ["src=\"", "href=\""] {
            for piece in page.split(attr).skip(1) {
                let target = piece.split('"').next().unwrap_or_default();
                assert!(
                    ASSETS.iter().any(|a| a.path == target),
                    "index.html refers to {target}, which is not embedded"
                );
            }
        }
    }
}
