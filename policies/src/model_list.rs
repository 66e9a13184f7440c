//! The pool-wide `GET /v1/models`, answered by the gateway from the snapshot rather than by one
//! engine picked at random: every model a ready endpoint serves, and every LoRA adapter loaded
//! on one, each once, in vLLM's list shape (an adapter's `parent` is the base model of the
//! engine that has it). The filter and the endpoint picker answer with this body.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::endpoint::PoolState;

/// The path of the model list.
pub const PATH: &str = "/v1/models";

/// Whether a request asks for the model list: `GET /v1/models`, with or without a query.
pub fn is_model_list(method: Option<&str>, path: Option<&str>) -> bool {
    method == Some("GET") && path.is_some_and(|p| p.split('?').next() == Some(PATH))
}

/// The list as JSON, or None when no endpoint is ready (the request then goes to the pool as
/// any other would). `created_s` stamps every card, as vLLM does with the time of the request.
pub fn body(pool: &PoolState, created_s: u64) -> Option<String> {
    let ready: Vec<_> = pool.endpoints.iter().filter(|e| e.ready).collect();
    if ready.is_empty() {
        return None;
    }
    // id → parent (None for a base model); a name some engine serves as a base stays a base.
    let mut models: BTreeMap<&str, Option<&str>> = BTreeMap::new();
    for e in &ready {
        let Some((base, adapters)) = e.models.split_first() else { continue };
        models.insert(base, None);
        for a in adapters {
            models.entry(a).or_insert(Some(base));
        }
    }
    let card = |id: &str, parent: Option<&str>| -> Value {
        json!({"id": id, "object": "model", "created": created_s, "owned_by": "vllm", "root": id,
               "parent": parent, "max_model_len": null, "permission": []})
    };
    let data: Vec<Value> = models
        .iter()
        .filter(|(_, p)| p.is_none())
        .chain(models.iter().filter(|(_, p)| p.is_some()))
        .map(|(id, parent)| card(id, *parent))
        .collect();
    Some(json!({"object": "list", "data": data}).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorers::testing::ep;

    #[test]
    fn the_list_is_the_union_of_ready_endpoints_with_adapters_after_their_base() {
        let mut eps = vec![ep("a", 0.0, 0.0, 0), ep("b", 0.0, 0.0, 0), ep("c", 0.0, 0.0, 0)];
        eps[0].models = vec!["llama".into(), "sql-lora".into()];
        eps[1].models = vec!["llama".into()];
        eps[2].models = vec!["qwen".into(), "tweet-lora".into()];
        eps[2].ready = false;
        let pool = PoolState { endpoints: eps, ..PoolState::default() };
        let v: Value = serde_json::from_str(&body(&pool, 7).unwrap()).unwrap();
        let ids: Vec<(&str, &Value)> =
            v["data"].as_array().unwrap().iter().map(|c| (c["id"].as_str().unwrap(), &c["parent"])).collect();
        assert_eq!(
            ids,
            [("llama", &Value::Null), ("sql-lora", &json!("llama"))],
            "an unready engine's models are not listed"
        );
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][0]["created"], 7);
        let none = PoolState { endpoints: vec![], ..PoolState::default() };
        assert!(body(&none, 0).is_none());
        assert!(is_model_list(Some("GET"), Some("/v1/models?x=1")));
        assert!(!is_model_list(Some("POST"), Some("/v1/models")));
        assert!(!is_model_list(Some("GET"), Some("/v1/models/llama")));
    }
}
