//! The request parser for all three APIs, then what the filter does with a parsed request:
//! prefix block hashes, and (when the reference model's tokenizer is present) chat-template
//! rendering and tokenization for precise routing.
//! Input: byte 0 picks the API, byte 1 bit 0 turns on tokenization; the rest is the body.
#![no_main]

use std::sync::{Mutex, OnceLock};

use attache_policies::config::{PreciseConfig, PrefixConfig};
use attache_policies::prompt_tokens::PromptTokenizer;
use attache_policies::request::{self, Api};
use libfuzzer_sys::fuzz_target;

fn tokenizer() -> Option<&'static Mutex<PromptTokenizer>> {
    static T: OnceLock<Option<Mutex<PromptTokenizer>>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/reference/vllm/model");
        let cfg = PreciseConfig {
            enabled: true,
            tokenizer_json: std::fs::read_to_string(dir.join("tokenizer.json")).ok(),
            chat_template: std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
            ..PreciseConfig::default()
        };
        PromptTokenizer::load_checked(&cfg).ok().map(|(t, _)| Mutex::new(t))
    })
    .as_ref()
}

fuzz_target!(|data: &[u8]| {
    let [api, flags, body @ ..] = data else { return };
    let api = match api % 3 {
        0 => Api::Completions,
        1 => Api::ChatCompletions,
        _ => Api::Responses,
    };
    let Ok(req) = request::parse(api, body) else { return };
    let cfg = PrefixConfig::default();
    let hashes = attache_policies::prefix::block_hashes(&cfg, &req.model, req.cache_salt.as_deref(), &req.prompt);
    assert!(hashes.len() <= body.len() / cfg.block_size_tokens + 1, "more blocks than the body can hold");
    if flags & 1 == 1 {
        if let Some(t) = tokenizer() {
            if let Ok(mut t) = t.lock() {
                let _ = t.request(&req, 8192);
            }
        }
    }
});
