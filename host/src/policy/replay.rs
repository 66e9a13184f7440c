//! `attache policy replay`: a candidate scorer module run in wasmtime over a decision log
//! (the admission emulator, with each record's scoring context as a sample), each decision
//! made again with its scores in the slot (policies::replay), and what changed.

use std::time::Duration;

use attache_policies::replay::{self, Recorded, Replayed, Summary};
use attache_policies::scoring::{ScoreEntry, ScoreSheet, BUCKETS, SCORES_PROPERTY};
use serde_json::{json, Value};

use super::admission::{self, AdmissionConfig};

/// What to replay with.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// The slot whose recorded entry the candidate replaces.
    pub slot: String,
    /// The candidate's params.
    pub params: Value,
    /// The weight its scores get; `None`: the slot's recorded weight (else 1).
    pub weight: Option<f64>,
}

/// Records run per wasmtime instance: a module keeps state between requests as it would in
/// one Envoy worker.
const CHUNK: usize = 512;

/// The weight the slot's recorded entries carried, if any did.
fn recorded_weight(records: &[Recorded], slot: &str) -> Option<f64> {
    records.iter().flat_map(|r| &r.sheet.entries).find(|e| e.slot == slot && e.arm.acts()).map(|e| e.weight)
}

/// Run `module` over `records`; each record made again with its entry for the slot.
pub fn run(module: &[u8], records: &[Recorded], opts: &ReplayOptions) -> anyhow::Result<(Vec<Replayed>, Summary)> {
    let weight = opts.weight.or_else(|| recorded_weight(records, &opts.slot)).unwrap_or(1.0);
    let plugin_config = json!({"slot": opts.slot, "arm": "stable", "version": "replay", "weight": weight,
                               "buckets": [0, BUCKETS], "params": opts.params});
    let mut replays = Vec::with_capacity(records.len());
    for chunk in records.chunks(CHUNK) {
        let cfg = AdmissionConfig {
            plugin_config: plugin_config.to_string().into_bytes(),
            samples: chunk.iter().map(|r| admission::context_sample(&r.ctx)).collect(),
            budget_per_request: Duration::from_secs(1),
            budget_to_start: Duration::from_secs(5),
            ..AdmissionConfig::default()
        };
        let report = admission::admit(module, &cfg).map_err(|e| anyhow::anyhow!("the module failed: {e}"))?;
        for (r, outcome) in chunk.iter().zip(&report.outcomes) {
            let entry: Option<ScoreEntry> = outcome
                .properties
                .iter()
                .find(|(k, _)| k == SCORES_PROPERTY)
                .and_then(|(_, v)| ScoreSheet::decode(v).ok())
                .and_then(|s| s.entries.into_iter().find(|e| e.slot == opts.slot));
            replays.push(replay::decide(r, &opts.slot, entry.as_ref()));
        }
    }
    let summary = replay::summarize(records, &replays);
    Ok((replays, summary))
}

/// One changed decision, as the replay prints it.
pub fn describe(i: usize, r: &Recorded, d: &Replayed) -> String {
    let addr = |k: Option<usize>| k.and_then(|k| r.ctx.candidates.get(k)).map_or("(none)", |c| c.address.as_str());
    format!(
        "#{i} at {} snapshot {} model {}: {} -> {} (expected hit {:.2} -> {:.2}, load {:.1} -> {:.1})",
        r.at_unix_ms,
        r.snapshot_version,
        r.ctx.model,
        addr(Some(d.recorded)),
        addr(d.replayed),
        d.hit.0,
        d.hit.1,
        d.load.0,
        d.load.1
    )
}
