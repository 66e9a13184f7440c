//! The bodies of the fuzz targets, written once.
//!
//! `tests/fuzz/fuzz_targets/*.rs` hand libFuzzer's input to these functions (`cargo xtask
//! fuzz`, nightly); `tests/fuzz-targets/tests/replay.rs` replays every checked-in corpus seed and regression
//! through the same functions on the stable toolchain, as part of `cargo xtask unit`. Each
//! function must return normally for any input: a panic is the bug a fuzzer reports.

use std::sync::{Mutex, OnceLock};

use attache_host::policy::signing::{self, TrustStore};
use attache_kv::engine::Engine;
use attache_kv::events as kv_events;
use attache_kv::prom;
use attache_policies::config::{PreciseConfig, PrefixConfig};
use attache_policies::prompt_tokens::PromptTokenizer;
use attache_policies::request::{self, Api};

/// A target's body: it must return normally for any input.
pub type Target = fn(&[u8]);

/// Every target, by the name of its corpus folder (`tests/fuzz/corpus/<name>`).
pub const TARGETS: &[(&str, Target)] = &[
    ("request_parse", request_parse),
    ("snapshot_decode", snapshot_decode),
    ("kv_event_decode", kv_event_decode),
    ("prom_parse", prom_parse),
    ("signature_verify", signature_verify),
];

/// Whether the reference model's tokenizer and chat template load, so `request_parse`
/// exercises tokenization too.
pub fn reference_tokenizer_loads() -> bool {
    tokenizer().is_some()
}

fn tokenizer() -> Option<&'static Mutex<PromptTokenizer>> {
    static T: OnceLock<Option<Mutex<PromptTokenizer>>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = attache_fixtures::vllm("model");
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

/// The request parser for all three APIs, then what the filter does with a parsed request:
/// prefix block hashes, and (with the reference model's tokenizer) chat-template rendering and
/// tokenization for precise routing. Byte 0 picks the API, byte 1 bit 0 turns on
/// tokenization; the rest is the body.
pub fn request_parse(data: &[u8]) {
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
}

/// The filter's snapshot decoder: protobuf bytes from shared data into the scheduler's pool.
pub fn snapshot_decode(data: &[u8]) {
    if let Ok(pool) = attache_scheduler_filter::shared::snapshot::decode_pool(data) {
        // Whatever decodes must be usable by the scheduler without panicking.
        for e in &pool.endpoints {
            let _ = e.base_model();
            let _ = e.fresh_metrics(1000);
        }
    }
}

/// The vLLM KV-event decoder (attache-kv): the three ZMQ frames, then the msgpack batch. The input
/// is the payload frame; its first 8 bytes also serve as the sequence frame.
pub fn kv_event_decode(data: &[u8]) {
    let seq = data.get(..8).unwrap_or(&[0; 8]);
    if let Ok(m) = kv_events::split_frames(&[b"kv@fuzz@m", seq, data]) {
        let _ = kv_events::decode_batch(m.payload);
    }
}

/// The host's Prometheus text-format parser and the engine-metrics extraction on top of it.
pub fn prom_parse(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let exp = prom::parse(&text);
    let _ = prom::names(&exp);
    let _ = prom::engine_metrics(&text, Engine::Vllm);
    let _ = prom::engine_metrics(&text, Engine::Sglang);
}

fn trust() -> &'static TrustStore {
    static T: OnceLock<TrustStore> = OnceLock::new();
    T.get_or_init(|| {
        // Written by the seed generator next to the corpus; a missing key gives an empty store
        // (everything refused).
        let pk = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/keys/fuzz.pub")).unwrap_or_default();
        signing::trust(&[pk.as_slice()]).unwrap_or_default()
    })
}

/// The module signature verifier: any bytes, against the trust store of the seed key. Only
/// the seed modules signed by that key may verify; anything else must be refused, not panic.
pub fn signature_verify(data: &[u8]) {
    if let Ok(v) = trust().verify(data) {
        assert_eq!(v.sha256, signing::sha256_hex(data), "verified hash is the module's");
        assert!(!v.signers.is_empty(), "a verified module names its signer");
    }
}
