//! Replay: a recorded decision of the policy chain made again with another scorer in one slot,
//! and what changed over a log of them.
//!
//! A record ([`Recorded`]) holds what the picker combined: the scoring context (the request's
//! features and each candidate's metrics and expected prefix hit, no prompt text), the
//! scheduler's tiers, the score sheet and the primary it routed to. Replaying puts a
//! candidate's entry for `slot` in place of the slot's recorded one (the other slots' as
//! recorded) and picks again ([`crate::scoring::pick`], the picker's own rule). The host's
//! `attache policy replay` runs the candidate module in wasmtime to get its entry.

use serde::Serialize;

use crate::scoring::{pick, Arm, ScoreEntry, ScoreSheet, ScoringContext};

/// One recorded decision, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub at_unix_ms: u64,
    pub snapshot_version: u64,
    pub ctx: ScoringContext,
    pub tiers: Vec<u8>,
    pub sheet: ScoreSheet,
    /// The primary routed to, by position in `ctx.candidates`.
    pub picked: usize,
}

/// The decision made again: the primary the candidate's entry leads to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Replayed {
    pub recorded: usize,
    pub replayed: Option<usize>,
    /// Expected prefix hit and load (waiting + running) of each pick.
    pub hit: (f64, f64),
    pub load: (f64, f64),
}

impl Replayed {
    pub fn changed(&self) -> bool {
        self.replayed != Some(self.recorded)
    }
}

/// Make `r` again with `entry` as `slot`'s scores (its arm is taken as live; `None`: the slot
/// scored nothing, as a scorer that trapped).
pub fn decide(r: &Recorded, slot: &str, entry: Option<&ScoreEntry>) -> Replayed {
    let mut sheet = ScoreSheet::default();
    for e in r.sheet.entries.iter().filter(|e| e.arm.acts() && e.slot != slot) {
        sheet.entries.push(e.clone());
    }
    if let Some(e) = entry {
        sheet.entries.push(ScoreEntry { arm: Arm::Stable, slot: slot.to_owned(), ..e.clone() });
    }
    let (picked, _, _) = pick(&r.ctx, &sheet, &r.tiers);
    let replayed = picked.first().and_then(|a| r.ctx.candidates.iter().position(|c| c.address == *a));
    let at = |i: Option<usize>| i.and_then(|i| r.ctx.candidates.get(i));
    let hit = |i| at(i).map_or(0.0, |c| f64::from(c.prefix_hit));
    let load = |i| at(i).map_or(0.0, |c| f64::from(c.waiting + c.running));
    Replayed {
        recorded: r.picked,
        replayed,
        hit: (hit(Some(r.picked)), hit(replayed)),
        load: (load(Some(r.picked)), load(replayed)),
    }
}

/// What a replay changed over a log.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    pub decisions: usize,
    pub changed: usize,
    pub changed_share: f64,
    /// Mean expected prefix hit of the recorded picks, of the replayed ones, and the difference.
    pub hit_rate_recorded: f64,
    pub hit_rate_replayed: f64,
    pub hit_rate_delta: f64,
    /// Load imbalance of the picks: the busiest endpoint's share of the picks over an even
    /// share (1.0: even), recorded and replayed.
    pub imbalance_recorded: f64,
    pub imbalance_replayed: f64,
    /// Mean load (waiting + running) at the pick, replayed minus recorded.
    pub load_delta: f64,
}

/// Sum up replayed decisions (`records[i]` replayed as `replays[i]`).
pub fn summarize(records: &[Recorded], replays: &[Replayed]) -> Summary {
    let n = replays.len();
    if n == 0 {
        return Summary::default();
    }
    let nf = n as f64;
    let changed = replays.iter().filter(|r| r.changed()).count();
    let mean = |f: &dyn Fn(&Replayed) -> f64| replays.iter().map(f).sum::<f64>() / nf;
    let (hr, hp) = (mean(&|r| r.hit.0), mean(&|r| r.hit.1));
    let imbalance = |replayed: bool| {
        let mut picks: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
        let mut endpoints = std::collections::HashSet::new();
        for (rec, rep) in records.iter().zip(replays) {
            endpoints.extend(rec.ctx.candidates.iter().map(|c| c.address.as_str()));
            let i = if replayed { rep.replayed } else { Some(rep.recorded) };
            if let Some(c) = i.and_then(|i| rec.ctx.candidates.get(i)) {
                *picks.entry(c.address.as_str()).or_default() += 1;
            }
        }
        let max = picks.values().copied().max().unwrap_or(0) as f64;
        max / (nf / endpoints.len().max(1) as f64)
    };
    Summary {
        decisions: n,
        changed,
        changed_share: changed as f64 / nf,
        hit_rate_recorded: hr,
        hit_rate_replayed: hp,
        hit_rate_delta: hp - hr,
        imbalance_recorded: imbalance(false),
        imbalance_replayed: imbalance(true),
        load_delta: mean(&|r| r.load.1) - mean(&|r| r.load.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scoring::Candidate;

    fn record(hits: [f32; 3], picked: usize, live: Option<Vec<f32>>) -> Recorded {
        let mut sheet = ScoreSheet::default();
        if let Some(scores) = live {
            sheet.put(ScoreEntry {
                slot: "cost".into(),
                arm: Arm::Stable,
                version: "v1".into(),
                weight: 10.0,
                scores,
                removed: Vec::new(),
                chosen: None,
            });
        }
        Recorded {
            at_unix_ms: 1,
            snapshot_version: 9,
            ctx: ScoringContext {
                bucket: 1,
                seed: 3,
                max_endpoints: 2,
                model: "m".into(),
                prompt_tokens: 100,
                max_tokens: 8,
                stream: false,
                candidates: (0..3)
                    .map(|i| Candidate {
                        address: format!("10.0.0.{i}:8000"),
                        prefix_hit: hits[i],
                        waiting: i as f32,
                        score: 1.0,
                        ..Candidate::default()
                    })
                    .collect(),
            },
            tiers: Vec::new(),
            sheet,
            picked,
        }
    }

    #[test]
    fn the_recorded_entry_reproduces_the_decision_and_another_changes_it() {
        let r = record([1.0, 0.0, 0.5], 0, Some(vec![1.0, 0.0, 0.0]));
        let same = r.sheet.entries[0].clone();
        let again = decide(&r, "cost", Some(&same));
        assert!(!again.changed(), "{again:?}");
        let other = ScoreEntry { scores: vec![0.0, 0.0, 1.0], ..same.clone() };
        let moved = decide(&r, "cost", Some(&other));
        assert_eq!(moved.replayed, Some(2));
        assert_eq!((moved.hit, moved.load), ((1.0, 0.5), (0.0, 2.0)));
        // A shadow entry in the record is not live: replaying ignores it.
        let mut with_shadow = r.clone();
        with_shadow.sheet.put(ScoreEntry { arm: Arm::Shadow, ..other.clone() });
        assert!(!decide(&with_shadow, "cost", Some(&same)).changed());

        let records = vec![r.clone(), r.clone(), r.clone(), r];
        let replays = vec![again, moved, again, moved];
        let s = summarize(&records, &replays);
        assert_eq!((s.decisions, s.changed), (4, 2));
        assert!((s.changed_share - 0.5).abs() < 1e-9);
        assert!((s.hit_rate_delta + 0.25).abs() < 1e-9, "{s:?}");
        // Recorded: every pick on one of 3 endpoints (3.0); replayed: half on each of two (1.5).
        assert!((s.imbalance_recorded - 3.0).abs() < 1e-9 && (s.imbalance_replayed - 1.5).abs() < 1e-9, "{s:?}");
        assert!((s.load_delta - 1.0).abs() < 1e-9);
        assert_eq!(summarize(&[], &[]), Summary::default());
    }
}
