//! What each engine serves, from its OpenAI `GET /v1/models`: the base model(s) and every LoRA
//! adapter loaded now, including those loaded at run time (vLLM's `POST /v1/load_lora_adapter`).
//! vLLM lists an adapter with `parent` naming its base model; the scrape of `/metrics` only
//! names adapters while requests use them, so without this list a request for an idle adapter
//! would find no endpoint serving it (404).

use serde::Deserialize;

#[derive(Deserialize)]
struct List {
    data: Vec<Card>,
}

#[derive(Deserialize)]
struct Card {
    id: String,
    #[serde(default)]
    parent: Option<String>,
}

/// The served model names, base models (no `parent`) first, then adapters, each once.
pub fn parse(body: &str) -> Result<Vec<String>, serde_json::Error> {
    let list: List = serde_json::from_str(body)?;
    let (bases, adapters): (Vec<Card>, Vec<Card>) = list.data.into_iter().partition(|c| c.parent.is_none());
    let mut out: Vec<String> = Vec::new();
    for c in bases.into_iter().chain(adapters) {
        if !out.contains(&c.id) {
            out.push(c.id);
        }
    }
    Ok(out)
}

/// What an endpoint serves: the models declared for it (discovery), then those its metrics
/// name, then those its `/v1/models` lists, each once; the first is the base model.
pub fn merge(declared: &[String], from_metrics: &[String], listed: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for m in declared.iter().chain(from_metrics).chain(listed) {
        if !out.contains(m) {
            out.push(m.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM 0.32's shape (vllm/entrypoints/openai/serving_models.py): adapters after the base,
    /// with `parent` set and `max_model_len` null.
    const VLLM: &str = r#"{"object":"list","data":[
        {"id":"sql-lora","object":"model","created":1,"owned_by":"vllm","root":"/adapters/sql","parent":"tinyllama","max_model_len":null,"permission":[]},
        {"id":"tinyllama","object":"model","created":1,"owned_by":"vllm","root":"/models/tinyllama","parent":null,"max_model_len":2048,"permission":[]}]}"#;

    #[test]
    fn adapters_follow_their_base_model() {
        assert_eq!(parse(VLLM).unwrap(), ["tinyllama", "sql-lora"]);
        assert!(parse("{\"object\":\"list\"}").is_err());
        assert_eq!(
            merge(&["tinyllama".into()], &["tinyllama".into()], &parse(VLLM).unwrap()),
            ["tinyllama", "sql-lora"]
        );
        assert_eq!(merge(&[], &[], &["a".into(), "b".into()]), ["a", "b"]);
    }
}
