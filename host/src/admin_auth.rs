//! Bearer-token authentication for the admin API. Every `/v1/*` route requires the token when
//! one is configured; `/healthz` stays open for probes. The host refuses to serve the admin API
//! on a non-loopback address without a token.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Tokens shorter than this are refused at start-up.
pub const MIN_TOKEN_LEN: usize = 16;

/// A bearer token, compared in constant time.
#[derive(Clone)]
pub struct BearerToken(Arc<str>);

impl BearerToken {
    /// The token from `file`, else `$ATTACHE_ADMIN_TOKEN`; None when neither is set.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Option<Self>> {
        let token = match file {
            Some(p) => std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            None => match std::env::var("ATTACHE_ADMIN_TOKEN") {
                Ok(t) => t,
                Err(_) => return Ok(None),
            },
        };
        let token = token.trim();
        if token.len() < MIN_TOKEN_LEN {
            anyhow::bail!("the admin bearer token must have at least {MIN_TOKEN_LEN} characters");
        }
        Ok(Some(Self(token.into())))
    }

    /// Whether an `Authorization` header value carries this token.
    pub fn authorized(&self, header: Option<&str>) -> bool {
        let Some(given) = header.and_then(|h| h.strip_prefix("Bearer ")) else {
            return false;
        };
        let (a, b) = (given.trim().as_bytes(), self.0.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

/// The 401 every refused request gets: JSON body and `WWW-Authenticate: Bearer`.
pub fn unauthorized() -> Response {
    let body = serde_json::json!({"error": "unauthorized", "message": "a valid bearer token is required"});
    let mut r = (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
    r.headers_mut().insert("www-authenticate", HeaderValue::from_static("Bearer"));
    r
}

/// Middleware: `/healthz` passes; everything else needs the token.
pub async fn require(State(token): State<BearerToken>, req: Request, next: Next) -> Response {
    // Health and the host's own metrics carry no secrets: probes and Prometheus need no token.
    if matches!(req.uri().path(), "/healthz" | "/metrics") {
        return next.run(req).await;
    }
    let header = req.headers().get("authorization").and_then(|v| v.to_str().ok());
    if !token.authorized(header) {
        return unauthorized();
    }
    next.run(req).await
}

/// Refuse an admin API reachable from other machines without a token.
pub fn check_exposure(listen: SocketAddr, token: Option<&BearerToken>) -> anyhow::Result<()> {
    if token.is_none() && !listen.ip().is_loopback() {
        anyhow::bail!(
            "admin_listen {listen} is not a loopback address: set admin_token_file (or ATTACHE_ADMIN_TOKEN) so the admin API requires a bearer token"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_exposure() {
        let t = BearerToken("0123456789abcdef".into());
        assert!(t.authorized(Some("Bearer 0123456789abcdef")));
        assert!(!t.authorized(Some("Bearer 0123456789abcdeF")));
        assert!(!t.authorized(Some("0123456789abcdef")));
        assert!(!t.authorized(None));
        assert!(check_exposure("127.0.0.1:9190".parse().unwrap(), None).is_ok());
        assert!(check_exposure("0.0.0.0:9190".parse().unwrap(), None).is_err());
        assert!(check_exposure("0.0.0.0:9190".parse().unwrap(), Some(&t)).is_ok());
        let dir = std::env::temp_dir().join(format!("attache-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("short"), "abc\n").unwrap();
        assert!(BearerToken::load(Some(&dir.join("short"))).is_err());
        std::fs::write(dir.join("ok"), "0123456789abcdef\n").unwrap();
        assert!(BearerToken::load(Some(&dir.join("ok")))
            .unwrap()
            .is_some_and(|t| t.authorized(Some("Bearer 0123456789abcdef"))));
    }
}
