//! The Responses API's own routes, answered from the store in OpenAI's shapes:
//! - `GET /v1/responses/{id}`: the response object;
//! - `DELETE /v1/responses/{id}`: `{"id", "object": "response.deleted", "deleted": true}`;
//! - `GET /v1/responses/{id}/input_items`: a list page of the turn's input items (`limit`
//!   1–100, default 20; `order` `desc` (default) or `asc`; `after` an item id);
//! - `POST /v1/responses/{id}/cancel`: 400 for a response that is not a background one
//!   (background responses are cancelled through their job first: `Responses::serve`).
//!
//! Unknown ids, and ids of another tenant, are 404 with the same message.

use std::time::Instant;

use serde_json::{json, Value};

use super::store::ResponseStore;

/// An answer: HTTP status and JSON body.
pub type Answer = (u16, String);

pub fn error(status: u16, kind: &str, param: Option<&str>, message: &str) -> Answer {
    (status, json!({"error": {"message": message, "type": kind, "param": param, "code": status}}).to_string())
}

fn not_found(id: &str) -> Answer {
    error(404, "invalid_request_error", Some("response_id"), &format!("Response with id '{id}' not found."))
}

/// The id of a stored response's `i`-th input item: unique, stable, and needing no storage.
fn item_id(response_id: &str, i: usize) -> String {
    let tail = response_id.strip_prefix("resp_").unwrap_or(response_id);
    format!("msg_{tail}_{i}")
}

/// A query parameter's value (no percent-decoding: ids and the values used here need none).
fn param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query.split('&').find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == name).map(|(_, v)| v))
}

/// The response id a route names.
pub fn id_of(path: &str) -> Option<&str> {
    let rest = path.split('?').next()?.strip_prefix("/v1/responses/")?;
    rest.split('/').next().filter(|id| !id.is_empty())
}

/// Answer `method path` for `tenant`.
pub fn serve(store: &mut ResponseStore, tenant: &str, method: &str, path: &str, now: Instant) -> Answer {
    let (path, query) = path.split_once('?').unwrap_or((path, ""));
    let Some(rest) = path.strip_prefix("/v1/responses/") else {
        return error(404, "invalid_request_error", None, &format!("No route for {method} {path}."));
    };
    let mut parts = rest.splitn(2, '/');
    let id = parts.next().unwrap_or_default();
    let sub = parts.next();
    if id.is_empty() {
        return error(404, "invalid_request_error", Some("response_id"), "No response id in the path.");
    }
    match (method, sub) {
        ("GET", None) => store.response(tenant, id, now).map_or_else(|| not_found(id), |b| (200, b)),
        ("DELETE", None) => {
            if store.delete(tenant, id) {
                (200, json!({"id": id, "object": "response.deleted", "deleted": true}).to_string())
            } else {
                not_found(id)
            }
        }
        ("GET", Some("input_items")) => input_items(store, tenant, id, query, now),
        ("POST", Some("cancel")) => match store.response(tenant, id, now) {
            Some(_) => error(400, "invalid_request_error", None, "Cannot cancel a synchronous response."),
            None => not_found(id),
        },
        _ => error(405, "invalid_request_error", None, &format!("{method} is not allowed on {path}.")),
    }
}

fn input_items(store: &mut ResponseStore, tenant: &str, id: &str, query: &str, now: Instant) -> Answer {
    let limit = match param(query, "limit").map(str::parse::<usize>) {
        None => 20,
        Some(Ok(n)) if (1..=100).contains(&n) => n,
        Some(_) => {
            return error(400, "invalid_request_error", Some("limit"), "limit must be an integer from 1 to 100.")
        }
    };
    let asc = match param(query, "order") {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(_) => return error(400, "invalid_request_error", Some("order"), "order must be 'asc' or 'desc'."),
    };
    let Some((items, _)) = store.input_items(tenant, id, now) else { return not_found(id) };
    let items: Vec<Value> = serde_json::from_str(&items).unwrap_or_default();
    let mut listed: Vec<Value> =
        items.into_iter().enumerate().map(|(i, item)| listed_item(item, &item_id(id, i))).collect();
    if !asc {
        listed.reverse();
    }
    let start = match param(query, "after") {
        None => 0,
        Some(after) => match listed.iter().position(|i| i["id"] == after) {
            Some(p) => p + 1,
            None => return error(400, "invalid_request_error", Some("after"), &format!("No input item '{after}'.")),
        },
    };
    let page: Vec<Value> = listed.iter().skip(start).take(limit).cloned().collect();
    let has_more = start + page.len() < listed.len();
    let first = page.first().map(|i| i["id"].clone()).unwrap_or(Value::Null);
    let last = page.last().map(|i| i["id"].clone()).unwrap_or(Value::Null);
    (200, json!({"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": has_more}).to_string())
}

/// An input item as the listing shows it: with an id, and a message's string content as one
/// `input_text` part.
fn listed_item(mut item: Value, id: &str) -> Value {
    let Some(obj) = item.as_object_mut() else { return item };
    if obj.get("role").is_some() {
        obj.entry("type").or_insert_with(|| json!("message"));
        if let Some(Value::String(text)) = obj.get("content") {
            let kind =
                if obj.get("role").and_then(Value::as_str) == Some("assistant") { "output_text" } else { "input_text" };
            let parts = json!([{"type": kind, "text": text}]);
            obj.insert("content".into(), parts);
        }
    }
    obj.entry("id").or_insert_with(|| json!(id));
    item
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::responses::store::{Limits, NewResponse};

    fn store() -> (ResponseStore, Instant) {
        let mut s = ResponseStore::new(Limits {
            max_responses: 10,
            max_bytes: 1 << 20,
            ttl: std::time::Duration::from_secs(60),
        });
        let now = Instant::now();
        let input = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                           {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "again"}]}]);
        let resp = json!({"id": "resp_a", "object": "response", "status": "completed", "output": []});
        let r = NewResponse {
            tenant: "t",
            id: "resp_a",
            previous_id: None,
            input_items: &input.to_string(),
            response: &resp.to_string(),
        };
        s.store(&r, now).unwrap();
        (s, now)
    }

    fn body(a: &Answer) -> Value {
        serde_json::from_str(&a.1).unwrap()
    }

    #[test]
    fn routes_name_their_response() {
        assert_eq!(id_of("/v1/responses/resp_1"), Some("resp_1"));
        assert_eq!(id_of("/v1/responses/resp_1/input_items?limit=2"), Some("resp_1"));
        assert_eq!(id_of("/v1/responses/resp_1?x=1"), Some("resp_1"));
        assert_eq!(id_of("/v1/responses/"), None);
        assert_eq!(id_of("/v1/chat/completions"), None);
    }

    #[test]
    fn get_lists_and_deletes_in_openai_shapes_for_the_owner_only() {
        let (mut s, now) = store();
        let got = serve(&mut s, "t", "GET", "/v1/responses/resp_a", now);
        assert_eq!((got.0, body(&got)["status"].as_str()), (200, Some("completed")));
        assert_eq!(serve(&mut s, "other", "GET", "/v1/responses/resp_a", now).0, 404);

        let page = serve(&mut s, "t", "GET", "/v1/responses/resp_a/input_items?limit=2&order=asc", now);
        let v = body(&page);
        assert_eq!((page.0, v["object"].as_str(), v["has_more"].as_bool()), (200, Some("list"), Some(true)));
        assert_eq!(v["data"][1]["content"][0], json!({"type": "input_text", "text": "hi"}));
        assert_eq!(v["data"][0]["type"], "message");
        let after = v["last_id"].as_str().unwrap().to_owned();
        let next =
            body(&serve(&mut s, "t", "GET", &format!("/v1/responses/resp_a/input_items?order=asc&after={after}"), now));
        assert_eq!((next["data"].as_array().map(Vec::len), next["has_more"].as_bool()), (Some(1), Some(false)));
        let desc = body(&serve(&mut s, "t", "GET", "/v1/responses/resp_a/input_items", now));
        assert_eq!(desc["data"][0]["content"][0]["text"], "again", "newest first by default");
        assert_eq!(serve(&mut s, "t", "GET", "/v1/responses/resp_a/input_items?limit=0", now).0, 400);

        assert_eq!(serve(&mut s, "t", "POST", "/v1/responses/resp_a/cancel", now).0, 400);
        assert_eq!(serve(&mut s, "other", "DELETE", "/v1/responses/resp_a", now).0, 404);
        let del = serve(&mut s, "t", "DELETE", "/v1/responses/resp_a", now);
        assert_eq!(body(&del), json!({"id": "resp_a", "object": "response.deleted", "deleted": true}));
        let gone = serve(&mut s, "t", "GET", "/v1/responses/resp_a", now);
        assert_eq!(gone.0, 404);
        assert_eq!(body(&gone)["error"]["message"], "Response with id 'resp_a' not found.");
    }
}
