//! The ext_proc messages the picker reads and writes, as GIE's endpoint-picker protocol uses
//! them (`docs/proposals/004-endpoint-picker-protocol`): headers in and out, the destination
//! as a header and as `envoy.lb` dynamic metadata, the subset hint and the served endpoint from
//! the metadata context, body chunks, and immediate answers.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse,
    ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value, Struct, Value};

/// The dynamic-metadata namespace of the destination and the served endpoint.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The key of the destination, in `envoy.lb` (and the request header of the same name).
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// The key the gateway reports the endpoint that served under, in `envoy.lb`.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The namespace and key of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Request headers only the gateway may set: removed from what the client sent.
pub const GATEWAY_HEADERS: [&str; 2] = [SERVED_KEY, SUBSET_KEY];
/// Body chunks sent back to Envoy are at most this long (llm-d's bound, under ext_proc's 64 KiB
/// advice for `FULL_DUPLEX_STREAMED`).
pub const MAX_CHUNK: usize = 62_000;

/// `append_action: OVERWRITE_IF_EXISTS_OR_ADD`.
const OVERWRITE: i32 = 2;

/// Headers as `(lower-case name, value)`; a value that is not UTF-8 is kept lossily.
pub fn headers_of(map: Option<&HeaderMap>) -> Vec<(String, String)> {
    let Some(map) = map else { return Vec::new() };
    map.headers
        .iter()
        .map(|h| {
            let v = if h.raw_value.is_empty() { h.value.clone() } else { String::from_utf8_lossy(&h.raw_value).into() };
            (h.key.to_ascii_lowercase(), v)
        })
        .collect()
}

/// A string (or the strings of a list) under `namespace`/`key` of the metadata context.
fn strings(md: Option<&Metadata>, namespace: &str, key: &str) -> Option<Vec<String>> {
    let v = md?.filter_metadata.get(namespace)?.fields.get(key)?;
    match v.kind.as_ref()? {
        value::Kind::StringValue(s) => Some(vec![s.clone()]),
        value::Kind::ListValue(l) => Some(
            l.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(value::Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
        ),
        _ => None,
    }
}

/// The gateway's subset hint: `None` when it sent none (the whole pool).
pub fn subset_hint(md: Option<&Metadata>) -> Option<Vec<String>> {
    strings(md, SUBSET_NAMESPACE, SUBSET_KEY)
}

/// The endpoint the gateway reports served the request.
pub fn served(md: Option<&Metadata>) -> Option<String> {
    strings(md, LB_NAMESPACE, SERVED_KEY)?.into_iter().next().filter(|s| !s.is_empty())
}

fn header(name: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: name.to_owned(), raw_value: value.as_bytes().to_vec(), ..Default::default() }),
        append_action: OVERWRITE,
        ..Default::default()
    }
}

/// Set `set` and remove `remove` (request or response headers).
pub fn mutation(set: &[(&str, String)], remove: Vec<String>) -> Option<HeaderMutation> {
    if set.is_empty() && remove.is_empty() {
        return None;
    }
    Some(HeaderMutation { set_headers: set.iter().map(|(k, v)| header(k, v)).collect(), remove_headers: remove })
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": destination}}`.
pub fn destination_metadata(destination: &str) -> Struct {
    let lb = Struct {
        fields: HashMap::from([(
            DESTINATION_KEY.to_owned(),
            Value { kind: Some(value::Kind::StringValue(destination.to_owned())) },
        )]),
    };
    Struct { fields: HashMap::from([(LB_NAMESPACE.to_owned(), Value { kind: Some(value::Kind::StructValue(lb)) })]) }
}

fn common(header_mutation: Option<HeaderMutation>, clear_route_cache: bool) -> Option<CommonResponse> {
    Some(CommonResponse { header_mutation, clear_route_cache, ..Default::default() })
}

/// Continue the request headers, mutated; with the destination's metadata when there is one.
pub fn request_headers(m: Option<HeaderMutation>, destination: Option<&str>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(HeadersResponse {
            response: common(m, destination.is_some()),
        })),
        dynamic_metadata: destination.map(destination_metadata),
        ..Default::default()
    }
}

/// Continue the request body (buffered modes), with the request headers mutated and the
/// destination's metadata: where a gateway buffers, the decision rides on the body's answer.
pub fn request_body_decided(m: Option<HeaderMutation>, destination: &str) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestBody(BodyResponse { response: common(m, true) })),
        dynamic_metadata: Some(destination_metadata(destination)),
        ..Default::default()
    }
}

/// Continue the response headers, mutated.
pub fn response_headers(m: Option<HeaderMutation>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(HeadersResponse { response: common(m, false) })),
        ..Default::default()
    }
}

/// A body chunk, for the request (`request: true`) or the response: sent back as it came in
/// `FULL_DUPLEX_STREAMED` mode (`streamed`), or continued unchanged in the other modes.
pub fn body(request: bool, streamed: bool, chunk: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    let response = if streamed {
        let m = body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
            body: chunk,
            end_of_stream,
            ..Default::default()
        });
        Some(CommonResponse { body_mutation: Some(BodyMutation { mutation: Some(m) }), ..Default::default() })
    } else {
        None
    };
    let b = BodyResponse { response };
    let r = if request {
        processing_response::Response::RequestBody(b)
    } else {
        processing_response::Response::ResponseBody(b)
    };
    ProcessingResponse { response: Some(r), ..Default::default() }
}

/// A buffered body sent back in chunks of at most [`MAX_CHUNK`], the last one ending the stream.
pub fn request_body_chunks(body: Vec<u8>) -> Vec<ProcessingResponse> {
    if body.is_empty() {
        return vec![self::body(true, true, Vec::new(), true)];
    }
    let n = body.len().div_ceil(MAX_CHUNK);
    body.chunks(MAX_CHUNK).enumerate().map(|(i, c)| self::body(true, true, c.to_vec(), i + 1 == n)).collect()
}

/// Continue trailers, for the request (`request: true`) or the response.
pub fn trailers(request: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    let r = if request {
        processing_response::Response::RequestTrailers(t)
    } else {
        processing_response::Response::ResponseTrailers(t)
    };
    ProcessingResponse { response: Some(r), ..Default::default() }
}

/// 200 with a JSON body, answered by the picker (the model list).
pub fn ok_json(body: &str) -> ProcessingResponse {
    let set = [("content-type", "application/json".to_owned())];
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: 200 }),
            headers: mutation(&set, Vec::new()),
            body: body.as_bytes().to_vec(),
            details: "attache_epp_model_list".into(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Answer the request instead of routing it.
pub fn immediate(status: u16, reason: &str, body: &str, extra: &[(&str, &str)]) -> ProcessingResponse {
    let set: Vec<(&str, String)> =
        attache_policies::intake::answer_headers(reason, extra).into_iter().map(|(k, v)| (k, v.to_owned())).collect();
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(status) }),
            headers: mutation(&set, Vec::new()),
            body: body.as_bytes().to_vec(),
            details: format!("attache_epp_{reason}"),
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn md(namespace: &str, key: &str, v: value::Kind) -> Metadata {
        let inner = Struct { fields: HashMap::from([(key.to_owned(), Value { kind: Some(v) })]) };
        Metadata { filter_metadata: HashMap::from([(namespace.to_owned(), inner)]), ..Default::default() }
    }

    #[test]
    fn reads_the_subset_hint_and_the_served_endpoint() {
        let s = |x: &str| Value { kind: Some(value::Kind::StringValue(x.into())) };
        let list = value::Kind::ListValue(ListValue { values: vec![s("10.0.0.1:8000"), s("10.0.0.2:8000")] });
        let m = md(SUBSET_NAMESPACE, SUBSET_KEY, list);
        assert_eq!(subset_hint(Some(&m)), Some(vec!["10.0.0.1:8000".to_owned(), "10.0.0.2:8000".to_owned()]));
        assert_eq!(subset_hint(None), None);
        let empty = md(SUBSET_NAMESPACE, SUBSET_KEY, value::Kind::ListValue(ListValue::default()));
        assert_eq!(subset_hint(Some(&empty)), Some(vec![]), "an empty hint is a hint: nothing is allowed");
        let m = md(LB_NAMESPACE, SERVED_KEY, value::Kind::StringValue("10.0.0.2:8000".into()));
        assert_eq!(served(Some(&m)).as_deref(), Some("10.0.0.2:8000"));
        assert_eq!(served(Some(&md(LB_NAMESPACE, SERVED_KEY, value::Kind::BoolValue(true)))), None);
    }

    #[test]
    fn the_header_and_the_metadata_name_the_same_destination() {
        let m =
            mutation(&[(DESTINATION_KEY, "10.0.0.1:8000,10.0.0.2:8000".into())], vec!["x-prefiller-host-port".into()]);
        let r = request_headers(m, Some("10.0.0.1:8000,10.0.0.2:8000"));
        let Some(processing_response::Response::RequestHeaders(h)) = &r.response else { panic!("{r:?}") };
        let c = h.response.as_ref().unwrap();
        assert!(c.clear_route_cache);
        let hm = c.header_mutation.as_ref().unwrap();
        let set = hm.set_headers[0].header.as_ref().unwrap();
        assert_eq!(
            (set.key.as_str(), set.raw_value.as_slice(), set.value.as_str()),
            (DESTINATION_KEY, &b"10.0.0.1:8000,10.0.0.2:8000"[..], "")
        );
        assert_eq!(hm.set_headers[0].append_action, OVERWRITE);
        assert_eq!(hm.remove_headers, vec!["x-prefiller-host-port".to_owned()]);
        let lb = &r.dynamic_metadata.unwrap().fields[LB_NAMESPACE];
        let Some(value::Kind::StructValue(lb)) = &lb.kind else { panic!() };
        assert_eq!(
            lb.fields[DESTINATION_KEY].kind,
            Some(value::Kind::StringValue("10.0.0.1:8000,10.0.0.2:8000".into()))
        );
    }

    #[test]
    fn bodies_go_back_in_bounded_chunks_ending_once() {
        let chunks = request_body_chunks(vec![7u8; MAX_CHUNK * 2 + 5]);
        let sizes: Vec<(usize, bool)> = chunks
            .iter()
            .map(|r| match &r.response {
                Some(processing_response::Response::RequestBody(b)) => {
                    match &b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation {
                        Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body.len(), s.end_of_stream),
                        m => panic!("{m:?}"),
                    }
                }
                r => panic!("{r:?}"),
            })
            .collect();
        assert_eq!(sizes, vec![(MAX_CHUNK, false), (MAX_CHUNK, false), (5, true)]);
        assert_eq!(request_body_chunks(Vec::new()).len(), 1);
        let plain = body(false, false, vec![1], true);
        assert!(matches!(
            plain.response,
            Some(processing_response::Response::ResponseBody(BodyResponse { response: None }))
        ));
    }

    #[test]
    fn immediate_answers_carry_status_json_and_reason() {
        let r = immediate(429, "sheddable", "{\"error\":{}}", &[("retry-after", "1")]);
        let Some(processing_response::Response::ImmediateResponse(i)) = r.response else { panic!() };
        assert_eq!(i.status.unwrap().code, 429);
        assert_eq!(i.body, b"{\"error\":{}}");
        let names: Vec<&str> =
            i.headers.as_ref().unwrap().set_headers.iter().map(|h| h.header.as_ref().unwrap().key.as_str()).collect();
        assert_eq!(names, ["content-type", "x-attache-error", "retry-after"]);
        assert_eq!(i.details, "attache_epp_sheddable");
    }
}
