//! Who may talk to the server: the `Host` check (against DNS rebinding), the `Origin` check with CORS for
//! the origins `--cors-origin` allows (against other web pages driving the API), the JSON content type of
//! request bodies, and the API key.
//!
//! A browser sends `Origin` on every cross-origin POST, and a "simple" cross-origin request (no
//! preflight) can only carry `text/plain`, form or multipart bodies. So a state change is refused when
//! its `Origin` is neither this server nor an allowed origin, and a body must be JSON: together a page on
//! another site can neither switch the model nor start a generation. Reading is guarded by the browser's
//! same-origin policy (no `Access-Control-Allow-Origin` is sent to a foreign origin) and, against DNS
//! rebinding (a foreign name resolving to 127.0.0.1), by refusing `Host` names the server does not
//! answer to.

use super::errors::{ApiError, Kind};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::Method;

/// The access rules of one server, built once from its flags.
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// The port the server listens on (a `Host` with another port is not for this server).
    pub port: u16,
    /// `--allowed-host` names (lower case), each `NAME` or `NAME:PORT`; `*` allows any.
    pub allowed_hosts: Vec<String>,
    /// `--cors-origin` origins (lower case, no trailing `/`), e.g. `http://localhost:3000`; `*` allows any.
    pub cors_origins: Vec<String>,
    /// `--api-key`: required on every route but `/health` and the web page's files.
    pub api_key: Option<String>,
}

/// Where a request's `Origin` stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// No `Origin` header (curl, SDKs, same-origin GETs), or this server's own origin (its web page).
    Own,
    /// An origin `--cors-origin` allows: answered with CORS headers naming it.
    Allowed(String),
    /// Any other origin (another site, or `null` from a sandboxed frame or a file).
    Foreign(String),
}

impl Access {
    /// Checks the `Host` header: the loopback names and any IP literal (a page cannot make a browser send
    /// an IP literal of a host other than the one it was loaded from, so rebinding needs a DNS name), with
    /// this server's port; other names only when `--allowed-host` names them.
    pub fn check_host(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(host) = headers.get(header::HOST) else {
            return Err(ApiError::bad_request("the request has no Host header"));
        };
        let host = host.to_str().unwrap_or("").trim().to_ascii_lowercase();
        if self.host_allowed(&host) {
            return Ok(());
        }
        Err(ApiError::new(
            Kind::Forbidden,
            format!(
                "the Host {:?} is not one this server answers to; start it with --allowed-host NAME to allow a name",
                truncate(&host, 100)
            ),
        ))
    }

    fn host_allowed(&self, host: &str) -> bool {
        if self.allowed_hosts.iter().any(|h| h == "*" || h == host) {
            return true;
        }
        let Some((name, port)) = split_host(host) else {
            return false;
        };
        // No port is port 80: only a server on 80 is reached so.
        let port_ok = match port {
            Some(p) => p == self.port,
            None => self.port == 80,
        };
        if !port_ok {
            return false;
        }
        name == "localhost"
            || name.parse::<std::net::Ipv4Addr>().is_ok()
            || name
                .strip_prefix('[')
                .and_then(|n| n.strip_suffix(']'))
                .is_some_and(|n| n.parse::<std::net::Ipv6Addr>().is_ok())
            || self.allowed_hosts.iter().any(|h| h == name)
    }

    /// Classifies the request's `Origin` against its (already checked) `Host`.
    pub fn origin(&self, headers: &HeaderMap) -> Origin {
        let Some(value) = headers.get(header::ORIGIN) else {
            return Origin::Own;
        };
        let origin = value
            .to_str()
            .unwrap_or("")
            .trim()
            .trim_end_matches('/')
            .to_ascii_lowercase();
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if !host.is_empty() && origin == format!("http://{host}") {
            return Origin::Own;
        }
        if origin != "null" && self.cors_origins.iter().any(|o| o == "*" || *o == origin) {
            // The header's own spelling goes back in Access-Control-Allow-Origin.
            return Origin::Allowed(value.to_str().unwrap_or("").trim().to_string());
        }
        Origin::Foreign(origin)
    }

    /// Whether the API key (when one is set) is present: `Authorization: Bearer KEY` (the scheme in any
    /// case, as RFC 9110 says) or `x-api-key: KEY`.
    pub fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(key) = &self.api_key else {
            return true;
        };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, token) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            });
        let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        bearer.is_some_and(|b| same_secret(b, key))
            || x_api_key.is_some_and(|k| same_secret(k, key))
    }
}

/// A refusal for a state change from a foreign origin.
pub fn foreign_origin(origin: &str, method: &Method, path: &str) -> ApiError {
    ApiError::new(
        Kind::Forbidden,
        format!(
            "{method} {path} from the web origin {:?} is refused; start the server with --cors-origin ORIGIN to allow a site",
            truncate(origin, 100)
        ),
    )
}

/// Requires a JSON body type (`application/json` or a `+json` type, parameters allowed): browsers cannot
/// send one cross-origin without a preflight, which only allowed origins pass.
pub fn require_json(headers: &HeaderMap) -> Result<(), ApiError> {
    let value = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mime = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json")) {
        return Ok(());
    }
    Err(ApiError::new(
        Kind::UnsupportedMediaType,
        if value.is_empty() {
            "the request needs `Content-Type: application/json`".to_string()
        } else {
            format!(
                "the request's Content-Type {:?} is not JSON; send `Content-Type: application/json`",
                truncate(value, 100)
            )
        },
    ))
}

/// The CORS headers of a response to an allowed origin.
pub fn add_cors(headers: &mut HeaderMap, origin: &str) {
    if let Ok(v) = HeaderValue::from_str(origin) {
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
    headers.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("Retry-After"),
    );
}

/// The headers of a preflight answer for an allowed origin: the methods the API has, and the headers the
/// browser asked for (the API reads only `Authorization`, `x-api-key`, `Content-Type` and SDK headers,
/// all harmless to allow).
pub fn add_preflight(headers: &mut HeaderMap, request_headers: Option<&HeaderValue>) {
    headers.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, HEAD, POST, OPTIONS"),
    );
    let allow = request_headers.cloned().unwrap_or(HeaderValue::from_static(
        "authorization, content-type, x-api-key",
    ));
    headers.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, allow);
    headers.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static("600"),
    );
}

/// `name` and port of a `Host` value (`[v6]:port` kept bracketed); `None` when malformed.
fn split_host(host: &str) -> Option<(&str, Option<u16>)> {
    if host.starts_with('[') {
        let end = host.find(']')?;
        let (name, rest) = host.split_at(end + 1);
        return match rest.strip_prefix(':') {
            Some(p) => Some((name, Some(p.parse().ok()?))),
            None if rest.is_empty() => Some((name, None)),
            None => None,
        };
    }
    match host.rsplit_once(':') {
        Some((name, p)) => Some((name, Some(p.parse().ok()?))),
        None => Some((host, None)),
    }
}

/// Compares a secret without stopping at the first differing byte (the time does not tell how much of a
/// guess was right).
fn same_secret(given: &str, key: &str) -> bool {
    let (a, b) = (given.as_bytes(), key.as_bytes());
    let mut diff = u8::from(a.len() != b.len());
    for (i, &k) in b.iter().enumerate() {
        diff |= a.get(i).copied().unwrap_or(!k) ^ k;
    }
    diff == 0
}

/// At most `max` bytes of `s` (on a character boundary), with `…` when cut: names and values from a
/// request are echoed in errors, never at any length.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).expect("header"));
        }
        h
    }

    fn access() -> Access {
        Access {
            port: 8080,
            allowed_hosts: vec!["box.lan".into()],
            cors_origins: vec!["http://localhost:3000".into()],
            api_key: Some("k".into()),
        }
    }

    #[test]
    fn hosts() {
        let a = access();
        for ok in [
            "127.0.0.1:8080",
            "localhost:8080",
            "[::1]:8080",
            "LocalHost:8080",
            "192.168.1.5:8080",
            "box.lan:8080",
        ] {
            assert!(a.check_host(&headers(&[("host", ok)])).is_ok(), "{ok}");
        }
        for bad in [
            "evil.example:8080",
            "localhost:9999",
            "localhost",
            "127.0.0.1.evil.example:8080",
            "[::1",
            "",
        ] {
            assert!(a.check_host(&headers(&[("host", bad)])).is_err(), "{bad}");
        }
        assert!(a.check_host(&HeaderMap::new()).is_err());
    }

    #[test]
    fn origins() {
        let a = access();
        let host = ("host", "127.0.0.1:8080");
        assert_eq!(a.origin(&headers(&[host])), Origin::Own);
        assert_eq!(
            a.origin(&headers(&[host, ("origin", "http://127.0.0.1:8080")])),
            Origin::Own
        );
        assert_eq!(
            a.origin(&headers(&[host, ("origin", "http://localhost:3000")])),
            Origin::Allowed("http://localhost:3000".into())
        );
        assert!(matches!(
            a.origin(&headers(&[host, ("origin", "https://evil.example")])),
            Origin::Foreign(_)
        ));
        assert!(matches!(
            a.origin(&headers(&[host, ("origin", "null")])),
            Origin::Foreign(_)
        ));
    }

    #[test]
    fn keys_and_types() {
        let a = access();
        assert!(a.authorized(&headers(&[("authorization", "Bearer k")])));
        assert!(a.authorized(&headers(&[("authorization", "bearer k")])));
        assert!(a.authorized(&headers(&[("x-api-key", "k")])));
        assert!(!a.authorized(&headers(&[("authorization", "Bearer kk")])));
        assert!(!a.authorized(&headers(&[("authorization", "Basic k")])));
        assert!(!a.authorized(&HeaderMap::new()));
        assert!(require_json(&headers(&[(
            "content-type",
            "application/json; charset=utf-8"
        )]))
        .is_ok());
        assert!(require_json(&headers(&[("content-type", "application/vnd.x+json")])).is_ok());
        assert!(require_json(&headers(&[("content-type", "text/plain")])).is_err());
        assert!(require_json(&HeaderMap::new()).is_err());
        assert_eq!(truncate("abcdef", 3), "abc…");
    }
}
