//! One request's state. The HTTP context owns it; while the request waits in the flow-control
//! queue, the worker's queue holds it too, so the tick can route it.

use std::cell::RefCell;
use std::rc::Rc;

use attache_policies::flow::RequestClass;
use attache_policies::request::{Api, InferenceRequest};

/// A request parsed and classified, waiting in the flow-control queue.
pub struct Parked {
    pub req: InferenceRequest,
    pub body_len: usize,
    pub class: RequestClass,
}

/// One request's state.
#[derive(Default)]
pub struct RequestState {
    /// Envoy's context id of the stream.
    pub id: u32,
    pub api: Option<Api>,
    /// Set once the filter answered the request itself.
    pub answered: bool,
    /// The request carried an authorized debug header: explain its decision.
    pub explain: bool,
    /// The explanation, for the response's header.
    pub explanation: Option<String>,
    /// The plan, kept when custom scorers may re-pick: what was learned follows the endpoint
    /// that served the request (`SchedulerHttp::follow_served`).
    pub planned: Option<Box<attache_policies::plan::Plan>>,
    /// Endpoint counted in the worker's in-flight load, released when the request ends.
    pub dispatched: Option<String>,
    /// Uncached prompt tokens counted for `dispatched` until the engine has prefilled them.
    pub dispatched_tokens: u64,
    /// The first configured rollout session header's value (custom scorers' bucket).
    pub session: Option<String>,
    /// When the request headers arrived, µs.
    pub started_us: u64,
    /// Set when a scoring context went to scorer filters: each candidate's expected prefix hit,
    /// to grade the arm that acted once the response starts.
    pub handed_off: Option<Vec<(String, f32)>>,
    /// The request headers flow control classifies on (objective, tenant, API key).
    pub flow_headers: Vec<(String, String)>,
    /// Waiting in the flow-control queue.
    pub parked: Option<Parked>,
    /// Session affinity: the session's table key (from the session header), the endpoint the
    /// session token names, and the endpoint the session resolved to (policies::session).
    pub session_key: Option<u64>,
    pub token_endpoint: Option<String>,
    pub sticky: Option<String>,
    /// The endpoint to name in the response's session token.
    pub session_token: Option<String>,
    /// A Responses API response: bind its id to the endpoint that served it.
    pub learn_response: Option<String>,
    /// Waiting for the host's read-through of its `previous_response_id` (crate::lookup).
    pub lookup: Option<Lookup>,
    /// Gateway Responses state (crate::responses): the request's tenant, the store route
    /// waiting for the host's answer, the continuation waiting for its conversation, and the
    /// response being captured for the store.
    pub tenant: Option<String>,
    pub serving: Option<u32>,
    /// Its flow-control band, once classified (`None`: flow control is off).
    pub priority: Option<i32>,
    pub resolving: Option<Resolving>,
    pub capture: Option<crate::responses::Capture>,
    /// This filter's rollout arm scheduled the request: the primary's expected prefix hit, to
    /// grade the arm once the response starts (policies::arm).
    pub arm_hit: Option<f32>,
}

/// A request paused while the host looks up the binding its continuation needs.
pub struct Lookup {
    pub token: u32,
    pub key: u64,
    pub req: InferenceRequest,
    pub body_len: usize,
}

/// A continuation paused while the host resolves its `previous_response_id`.
pub struct Resolving {
    pub token: u32,
    pub api: Api,
    pub body: Vec<u8>,
    pub previous_id: String,
    pub started_us: u64,
}

impl RequestState {
    pub fn new(id: u32) -> Self {
        Self { id, ..Self::default() }
    }

    /// The value of a flow-control header the request carried.
    pub fn flow_header(&self, name: &str) -> Option<&str> {
        self.flow_headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The response's first bytes arrived: the engine has prefilled the prompt, so its tokens
    /// no longer queue ahead of others. Returns them with their endpoint, once; the request
    /// itself stays counted until it ends.
    pub fn prefilled(&mut self) -> Option<(&str, u64)> {
        let tokens = std::mem::take(&mut self.dispatched_tokens);
        self.dispatched.as_deref().filter(|_| tokens > 0).map(|a| (a, tokens))
    }

    /// The request ended: what it counted in the worker's in-flight load, to release.
    pub fn release(&mut self) -> Option<(String, u64)> {
        let tokens = std::mem::take(&mut self.dispatched_tokens);
        self.dispatched.take().map(|a| (a, tokens))
    }
}

pub type SharedRequest = Rc<RefCell<RequestState>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_headers_and_release() {
        let mut st = RequestState::new(7);
        st.flow_headers.push(("x-tenant".into(), "a".into()));
        assert_eq!((st.id, st.flow_header("x-tenant"), st.flow_header("x-other")), (7, Some("a"), None));
        assert_eq!(st.release(), None, "nothing dispatched");
        st.dispatched = Some("10.0.0.1:8000".into());
        st.dispatched_tokens = 40;
        assert_eq!(st.release(), Some(("10.0.0.1:8000".into(), 40)));
        assert_eq!((st.release(), st.dispatched_tokens), (None, 0), "released once");
    }

    #[test]
    fn prefilled_tokens_leave_before_the_request_does() {
        let mut st = RequestState::new(7);
        assert_eq!(st.prefilled(), None, "nothing dispatched");
        st.dispatched = Some("10.0.0.1:8000".into());
        st.dispatched_tokens = 40;
        assert_eq!(st.prefilled(), Some(("10.0.0.1:8000", 40)));
        assert_eq!(st.prefilled(), None, "once");
        assert_eq!(st.release(), Some(("10.0.0.1:8000".into(), 0)), "the request itself stays counted");
    }
}
