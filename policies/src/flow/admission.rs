//! Admission: whether a classified request may wait for the pool, or is answered now; and the
//! answers flow control gives (statuses, `Retry-After`, the reason header), in one place.

use super::{ClassError, RequestClass, Shed};
use crate::endpoint::PoolState;
use crate::error::{ErrorResponse, ScheduleError};

/// Why flow control answered a request itself.
pub const DROPPED_REASON_HEADER: &str = "x-attache-dropped-reason";

/// A request flow control answers instead of routing.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub response: ErrorResponse,
    /// Response headers beyond the JSON body's.
    pub headers: Vec<(&'static str, &'static str)>,
    /// The shed counter it moves, if it was shed (rather than refused as invalid).
    pub shed: Option<Shed>,
}

impl Refusal {
    /// A request shed for `shed`: 429 or 503, with `Retry-After` and the reason.
    pub fn shed(shed: Shed, detail: &str) -> Self {
        let kind = if shed.status() == 503 { "ServiceUnavailableError" } else { "rate_limit_error" };
        Self {
            response: ErrorResponse::new(shed.status(), shed.reason(), kind, None, detail),
            headers: vec![("retry-after", "1"), (DROPPED_REASON_HEADER, shed.reason())],
            shed: Some(shed),
        }
    }

    /// A request that could not be enqueued.
    pub fn not_queued(shed: Shed, priority: i32) -> Self {
        let detail = match shed {
            Shed::BandFull => format!("the queue of priority {priority} is full; retry later"),
            _ => "the flow-control queue is full; retry later".to_owned(),
        };
        Self::shed(shed, &detail)
    }

    /// A request that waited its whole TTL.
    pub fn expired(has_ready: bool, ttl_ms: u64) -> Self {
        if has_ready {
            Self::shed(Shed::Expired, &format!("waited {ttl_ms} ms for the saturated pool, the limit; retry later"))
        } else {
            Self::shed(Shed::NoEndpoints, "no ready endpoint in the inference pool within the queue TTL; retry later")
        }
    }
}

/// Admit a request to the queue, or refuse it, in this order: an unknown objective is 400; a
/// pool with no ready endpoint sheds it (503); an unknown model is 404; a sheddable request
/// (negative priority) on a saturated pool is shed (429). `continuing` marks a later turn of a
/// session already bound (turn priority).
pub fn admit(
    class: Result<RequestClass, ClassError>,
    continuing: bool,
    pool: &PoolState,
    model: &str,
    saturation: Option<f64>,
) -> Result<RequestClass, Refusal> {
    let mut class = class.map_err(|e| {
        let msg = format!("{e}; objectives come from InferenceObjective resources or the host's flow.objectives");
        Refusal {
            response: ErrorResponse::new(400, "unknown_objective", "invalid_request_error", None, &msg),
            headers: vec![(DROPPED_REASON_HEADER, "unknown_objective")],
            shed: None,
        }
    })?;
    class.continuing = continuing;
    if !pool.has_ready() {
        return Err(Refusal::shed(Shed::NoEndpoints, "no ready endpoint in the inference pool; retry later"));
    }
    if !pool.knows_model(model) {
        let e = ScheduleError::UnknownModel(model.to_owned());
        return Err(Refusal { response: ErrorResponse::from(&e), headers: Vec::new(), shed: None });
    }
    if class.sheddable() && saturation.is_some_and(|s| s >= 1.0) {
        let msg = format!("the pool is saturated and priority {} requests are sheddable; retry later", class.priority);
        return Err(Refusal::shed(Shed::Sheddable, &msg));
    }
    Ok(class)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Endpoint;

    fn pool() -> PoolState {
        PoolState { endpoints: vec![Endpoint::idle("10.0.0.1:8000".into(), "m")], ..Default::default() }
    }

    fn class(priority: i32) -> Result<RequestClass, ClassError> {
        Ok(RequestClass { priority, tenant: "t".into(), continuing: false })
    }

    #[test]
    fn refusals_in_order_with_status_and_reason() {
        let status = |r: Result<RequestClass, Refusal>| r.map_err(|e| (e.response.status, e.response.reason));
        let bad = Err(ClassError::UnknownObjective("x".into()));
        assert_eq!(status(admit(bad, false, &PoolState::default(), "m", None)), Err((400, "unknown_objective")));
        assert_eq!(status(admit(class(0), false, &PoolState::default(), "m", None)), Err((503, "no_endpoints")));
        assert_eq!(status(admit(class(0), false, &pool(), "zzz", None)), Err((404, "unknown_model")));
        assert_eq!(status(admit(class(-1), false, &pool(), "m", Some(1.0))), Err((429, "sheddable")));
        assert!(admit(class(-1), false, &pool(), "m", Some(0.9)).is_ok(), "not saturated yet");
        let admitted = admit(class(0), true, &pool(), "m", Some(5.0)).unwrap();
        assert!(admitted.continuing, "only sheddable requests are shed at admission");
    }

    #[test]
    fn shed_answers_carry_retry_after_and_the_reason() {
        let r = Refusal::not_queued(Shed::BandFull, 2);
        assert_eq!(r.response.status, 429);
        assert!(r.response.body.contains("priority 2"));
        assert_eq!(r.headers, vec![("retry-after", "1"), (DROPPED_REASON_HEADER, "band_full")]);
        assert_eq!(Refusal::expired(false, 100).response.status, 503);
        assert_eq!(Refusal::expired(true, 100).shed, Some(Shed::Expired));
    }
}
