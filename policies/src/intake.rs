//! What a request's headers say before its body arrives, and the checks a host runs on the
//! headers and the body before it plans: which API the request calls, its session, the
//! flow-control and rollout headers, and the size and emptiness checks. The Envoy filter and
//! the endpoint picker both call these, in the same order, so a request is refused the same way
//! whichever host sees it.

use std::borrow::Cow;

use crate::error::{ErrorResponse, RequestError};
use crate::plugin_config::FilterConfig;
use crate::request::{Api, InferenceRequest};
use crate::session;

/// Header naming the reason of every answer the scheduler sends itself.
pub const ERROR_HEADER: &str = "x-attache-error";

/// What the request headers say.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Head {
    /// The inference API a `POST` calls; `None` for anything else (passed through unscheduled).
    pub api: Option<Api>,
    /// The endpoint the request's session token names (llm-d's stateless session header).
    pub token_endpoint: Option<String>,
    /// The session header's table key.
    pub session_key: Option<u64>,
    /// The headers flow control classifies on (objective, tenant, API key), as sent.
    pub flow_headers: Vec<(String, String)>,
    /// The first configured rollout session header's value (custom scorers' bucket).
    pub rollout_session: Option<String>,
    /// A Responses request in gateway mode: the tenant its ids belong to
    /// ([`crate::responses::tenant_of`]).
    pub tenant: Option<String>,
}

/// A route of the Responses API the gateway answers from its store (gateway mode): `GET` or
/// `DELETE /v1/responses/{id}`, `GET .../input_items`, `POST .../cancel`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreRoute {
    pub method: String,
    /// The path with its query.
    pub path: String,
    pub tenant: String,
}

/// The tenant of a request, from the flow-control tenant and API-key headers.
fn tenant<'h>(cfg: &FilterConfig, get: &impl Fn(&str) -> Option<Cow<'h, str>>) -> String {
    crate::responses::tenant_of(get(&cfg.flow.tenant_header).as_deref(), get(&cfg.flow.api_key_header).as_deref())
}

/// The Responses route the gateway's store answers, if the request is one.
pub fn store_route<'h>(cfg: &FilterConfig, get: impl Fn(&str) -> Option<Cow<'h, str>>) -> Option<StoreRoute> {
    if cfg.responses.mode != crate::responses::Mode::Gateway {
        return None;
    }
    let method = get(":method")?;
    let path = get(":path")?;
    let bare = path.split('?').next().unwrap_or_default();
    let rest = bare.strip_prefix("/v1/responses/")?;
    let ours = match (method.as_ref(), rest.split_once('/')) {
        ("GET" | "DELETE", None) => !rest.is_empty(),
        ("GET", Some((id, "input_items"))) | ("POST", Some((id, "cancel"))) => !id.is_empty(),
        _ => false,
    };
    ours.then(|| StoreRoute { method: method.into_owned(), path: path.into_owned(), tenant: tenant(cfg, &get) })
}

/// The response id a Responses API route names, in engine mode (the engine that produced it
/// holds it): `GET`, `DELETE /v1/responses/{id}` and below it, `POST .../cancel`. Such a
/// request goes to the endpoint bound to the id ([`session::response_key`]).
pub fn engine_route<'h>(cfg: &FilterConfig, get: impl Fn(&str) -> Option<Cow<'h, str>>) -> Option<String> {
    if cfg.responses.mode != crate::responses::Mode::Engine {
        return None;
    }
    let method = get(":method")?;
    let path = get(":path")?;
    let rest = path.split('?').next().unwrap_or_default().strip_prefix("/v1/responses/")?;
    let (id, sub) = rest.split_once('/').map_or((rest, None), |(i, s)| (i, Some(s)));
    let ours = match method.as_ref() {
        "GET" | "DELETE" => true,
        "POST" => sub == Some("cancel"),
        _ => false,
    };
    (ours && !id.is_empty()).then(|| id.to_owned())
}

impl Head {
    /// The value of a flow-control header the request carried.
    pub fn flow_header(&self, name: &str) -> Option<&str> {
        self.flow_headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// Read the request headers through `get` (lower-case names, pseudo-headers included).
/// `end_of_stream`: the headers are the whole request. An inference call with a declared
/// length over the limit, or with no body, is refused here.
pub fn head<'h>(
    cfg: &FilterConfig,
    get: impl Fn(&str) -> Option<Cow<'h, str>>,
    end_of_stream: bool,
) -> Result<Head, ErrorResponse> {
    let api = match get(":method").as_deref() {
        Some("POST") => get(":path").as_deref().and_then(Api::from_path),
        _ => None,
    };
    let Some(api) = api else {
        return Ok(Head::default());
    };
    let mut head = Head { api: Some(api), ..Head::default() };
    let sc = &cfg.sessions;
    // Utility routes are routed by load alone: no session, no flow control.
    if sc.enabled && !api.is_utility() {
        head.token_endpoint = get(&sc.token_header).and_then(|t| session::endpoint_of_token(&t));
        head.session_key = sc.headers.iter().find_map(|h| get(h)).map(|v| session::session_key(&v));
    }
    let f = &cfg.flow;
    if flow_controlled(cfg, api) {
        for h in [&f.objective_header, &f.tenant_header, &f.api_key_header] {
            if let Some(v) = get(h) {
                head.flow_headers.push((h.clone(), v.into_owned()));
            }
        }
    }
    if api == Api::Responses && cfg.responses.mode == crate::responses::Mode::Gateway {
        head.tenant = Some(tenant(cfg, &get));
    }
    if cfg.scoring.context {
        head.rollout_session = cfg.scoring.session_headers.iter().find_map(|h| get(h)).map(Cow::into_owned);
    }
    if let Some(len) = get("content-length").and_then(|v| v.trim().parse::<usize>().ok()) {
        check_size(len, cfg.scheduler.max_body_bytes).map_err(|e| e.shaped(api.error_shape()))?;
    }
    if end_of_stream {
        return Err(ErrorResponse::from(&RequestError::EmptyBody).shaped(api.error_shape()));
    }
    Ok(head)
}

/// The session key of a request whose headers named none: an Anthropic Messages request's
/// `metadata.user_id`, when `sessions.messages_user_id` is on.
pub fn body_session_key(cfg: &FilterConfig, head_key: Option<u64>, req: &InferenceRequest) -> Option<u64> {
    let sc = &cfg.sessions;
    if head_key.is_some() || !sc.enabled || !sc.messages_user_id || req.api != Api::Messages {
        return head_key;
    }
    req.user.as_deref().filter(|u| !u.is_empty()).map(session::session_key)
}

/// A body of `size` bytes so far: 413 over `limit`.
pub fn check_size(size: usize, limit: usize) -> Result<(), ErrorResponse> {
    if size > limit {
        return Err(ErrorResponse::from(&RequestError::BodyTooLarge { size, limit }));
    }
    Ok(())
}

/// Whether flow control queues and gates a request of `api`: when it is on, every route but
/// the utility ones (routed by load alone, never queued, nothing charged to the gate).
pub fn flow_controlled(cfg: &FilterConfig, api: Api) -> bool {
    cfg.flow.enabled && !api.is_utility()
}

/// The response to a Responses API call teaches its id → endpoint binding (when sessions are on
/// and the engines keep Responses state).
pub fn learns_response(cfg: &FilterConfig, api: Api) -> bool {
    cfg.sessions.enabled && api == Api::Responses && cfg.responses.mode == crate::responses::Mode::Engine
}

/// The headers of an answer the scheduler sends itself: JSON, the reason, then `extra`
/// (flow control's `Retry-After` and drop reason).
pub fn answer_headers<'a>(reason: &'a str, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![("content-type", "application/json"), (ERROR_HEADER, reason)];
    headers.extend_from_slice(extra);
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers<'a>(list: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<Cow<'a, str>> + 'a {
        move |n| list.iter().find(|(k, _)| *k == n).map(|(_, v)| Cow::Borrowed(*v))
    }

    #[test]
    fn only_posts_to_inference_paths_are_scheduled() {
        let cfg = FilterConfig::default();
        for (method, path, api) in [
            ("POST", "/v1/chat/completions", Some(Api::ChatCompletions)),
            ("GET", "/v1/chat/completions", None),
            ("POST", "/health", None),
            ("GET", "/v1/models", None),
        ] {
            let h = head(&cfg, headers(&[(":method", method), (":path", path)]), false).unwrap();
            assert_eq!(h.api, api, "{method} {path}");
        }
        // A GET with no body is not refused as empty: it is not an inference call.
        assert_eq!(head(&cfg, headers(&[(":method", "GET"), (":path", "/v1/models")]), true).unwrap().api, None);
    }

    #[test]
    fn sessions_flow_and_rollout_headers_are_read() {
        let mut cfg = FilterConfig::default();
        cfg.flow.enabled = true;
        cfg.scoring.context = true;
        cfg.scoring.session_headers = vec!["x-user".into()];
        let token = session::token_for("10.0.0.9:8000");
        let list = [
            (":method", "POST"),
            (":path", "/v1/completions"),
            ("x-session-token", token.as_str()),
            ("x-session-id", "s1"),
            ("x-user", "u7"),
            (cfg.flow.tenant_header.as_str(), "team-a"),
        ];
        let h = head(&cfg, headers(&list), false).unwrap();
        assert_eq!(h.token_endpoint.as_deref(), Some("10.0.0.9:8000"));
        assert_eq!(h.session_key, Some(session::session_key("s1")));
        assert_eq!(h.rollout_session.as_deref(), Some("u7"));
        assert_eq!(h.flow_header(&cfg.flow.tenant_header), Some("team-a"));
        cfg.sessions.enabled = false;
        let h = head(&cfg, headers(&list), false).unwrap();
        assert_eq!((h.token_endpoint, h.session_key), (None, None), "sessions off");
    }

    #[test]
    fn oversized_and_empty_inference_calls_are_refused() {
        let mut cfg = FilterConfig::default();
        cfg.scheduler.max_body_bytes = 100;
        let post = [(":method", "POST"), (":path", "/v1/completions"), ("content-length", "101")];
        let e = head(&cfg, headers(&post), false).unwrap_err();
        assert_eq!((e.status, e.reason), (413, "body_too_large"));
        let e = head(&cfg, headers(&post[..2]), true).unwrap_err();
        assert_eq!(e.status, 400, "{}", e.body);
        assert!(check_size(100, 100).is_ok());
        assert_eq!(check_size(101, 100).unwrap_err().status, 413);
    }

    #[test]
    fn the_stores_routes_are_recognised_in_gateway_mode_only() {
        let mut cfg = FilterConfig::default();
        let route = |cfg: &FilterConfig, method: &'static str, path: &'static str| {
            store_route(cfg, |n| match n {
                ":method" => Some(Cow::Borrowed(method)),
                ":path" => Some(Cow::Borrowed(path)),
                "authorization" => Some(Cow::Borrowed("Bearer k")),
                _ => None,
            })
        };
        let r = route(&cfg, "GET", "/v1/responses/resp_1/input_items?limit=2").expect("input_items");
        assert_eq!((r.method.as_str(), r.path.as_str()), ("GET", "/v1/responses/resp_1/input_items?limit=2"));
        assert!(r.tenant.starts_with("key-"));
        for (m, p) in [
            ("GET", "/v1/responses/resp_1"),
            ("DELETE", "/v1/responses/resp_1"),
            ("POST", "/v1/responses/resp_1/cancel"),
        ] {
            assert!(route(&cfg, m, p).is_some(), "{m} {p}");
        }
        for (m, p) in [
            ("POST", "/v1/responses"),
            ("GET", "/v1/responses/"),
            ("PUT", "/v1/responses/r"),
            ("GET", "/v1/responses/r/x"),
        ] {
            assert!(route(&cfg, m, p).is_none(), "{m} {p}");
        }
        cfg.responses.mode = crate::responses::Mode::Engine;
        assert!(route(&cfg, "GET", "/v1/responses/resp_1").is_none(), "the engines answer in engine mode");
    }

    #[test]
    fn answers_carry_json_the_reason_and_extras() {
        let h = answer_headers("shed", &[("retry-after", "1")]);
        assert_eq!(h, vec![("content-type", "application/json"), (ERROR_HEADER, "shed"), ("retry-after", "1")]);
        let mut cfg = FilterConfig::default();
        assert!(!learns_response(&cfg, Api::Responses), "the gateway keeps Responses state by default");
        {
            let mut engine = cfg.clone();
            engine.responses.mode = crate::responses::Mode::Engine;
            let route = |c: &FilterConfig, m: &'static str, p: &'static str| {
                engine_route(c, |n| match n {
                    ":method" => Some(Cow::Borrowed(m)),
                    ":path" => Some(Cow::Borrowed(p)),
                    _ => None,
                })
            };
            assert_eq!(route(&engine, "GET", "/v1/responses/resp_1?stream=false").as_deref(), Some("resp_1"));
            assert_eq!(route(&engine, "POST", "/v1/responses/resp_1/cancel").as_deref(), Some("resp_1"));
            assert_eq!(route(&engine, "GET", "/v1/responses/resp_1/input_items").as_deref(), Some("resp_1"));
            assert_eq!(route(&engine, "POST", "/v1/responses/resp_1"), None);
            assert_eq!(route(&engine, "GET", "/v1/responses/"), None);
            assert_eq!(route(&cfg, "GET", "/v1/responses/resp_1"), None, "gateway mode answers these itself");
        }
        cfg.responses.mode = crate::responses::Mode::Engine;
        assert!(learns_response(&cfg, Api::Responses) && !learns_response(&cfg, Api::Completions));
        cfg.sessions.enabled = false;
        assert!(!learns_response(&cfg, Api::Responses));
        assert!(!flow_controlled(&cfg, Api::Completions), "flow control is off by default");
        cfg.flow.enabled = true;
        assert!(flow_controlled(&cfg, Api::Messages) && !flow_controlled(&cfg, Api::Tokenize));
    }
}
