//! A system's figures over repeated, interleaved runs of one scenario, and how Attaché compares
//! with each other system on them ([`crate::spread`]: a win only when the intervals do not
//! overlap).

use std::fmt::Write as _;

use serde::Serialize;
use serde_json::{json, Value};

use crate::closed_loop::Throughput;
use crate::run::{round2, RunSummary};
use crate::spread::{verdict, Spread, Verdict};

/// One system's runs, one slot per seed (`None`: that seed's run is missing).
#[derive(Debug, Clone, Default)]
pub struct SystemSeeds {
    pub system: String,
    pub open: Vec<Option<RunSummary>>,
    pub closed: Vec<Option<Throughput>>,
    /// Attaché's expected prefix hit rate, per seed.
    pub expected_hit: Vec<Option<f64>>,
    /// The same before calibration against the engines' counters.
    pub believed_hit: Vec<Option<f64>>,
}

/// The figures of one system over its seeds.
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    pub system: String,
    pub seeds: usize,
    pub ttft_p50_ms: Option<Spread>,
    pub ttft_p95_ms: Option<Spread>,
    /// Open loop: what it completed of the ladder's offered load.
    pub output_tok_per_s: Option<Spread>,
    /// Closed loop: what it completes with the pool kept full.
    pub closed_output_tok_per_s: Option<Spread>,
    /// The engines' own prefix-cache hit rate.
    pub prefix_hit_rate: Option<Spread>,
    /// The same over the closed loop's counted window.
    pub closed_prefix_hit_rate: Option<Spread>,
    /// What Attaché expected of the endpoints it picked, calibrated against the engines'
    /// counters, and what its indexes believed before that.
    pub expected_hit_rate: Option<Spread>,
    pub believed_hit_rate: Option<Spread>,
    pub errors: usize,
}

fn spread_of<T>(v: &[Option<T>], f: impl Fn(&T) -> f64) -> Option<Spread> {
    let runs: Vec<f64> = v.iter().map(|r| r.as_ref().map_or(f64::NAN, &f)).collect();
    Spread::of(&runs)
}

impl SystemSeeds {
    pub fn new(system: &str, seeds: usize) -> Self {
        Self {
            system: system.to_owned(),
            open: vec![None; seeds],
            closed: vec![None; seeds],
            expected_hit: vec![None; seeds],
            believed_hit: vec![None; seeds],
        }
    }

    pub fn figures(&self) -> Figures {
        Figures {
            system: self.system.clone(),
            seeds: self.open.iter().filter(|r| r.is_some()).count(),
            ttft_p50_ms: spread_of(&self.open, |r| r.ttft_p50_ms),
            ttft_p95_ms: spread_of(&self.open, |r| r.ttft_p95_ms),
            output_tok_per_s: spread_of(&self.open, |r| r.output_tok_per_s),
            closed_output_tok_per_s: spread_of(&self.closed, |t| t.output_tok_per_s),
            prefix_hit_rate: spread_of(&self.open, |r| r.prefix_hit_rate),
            closed_prefix_hit_rate: spread_of(&self.closed, |t| t.prefix_hit_rate.unwrap_or(f64::NAN)),
            expected_hit_rate: spread_of(&self.expected_hit, |e| *e),
            believed_hit_rate: spread_of(&self.believed_hit, |e| *e),
            errors: self.open.iter().flatten().map(|r| r.errors).sum(),
        }
    }

    /// The mean over the seeds, as one summary row (the tables and checks of a single run).
    pub fn mean_row(&self) -> Option<RunSummary> {
        let f = self.figures();
        let runs: Vec<&RunSummary> = self.open.iter().flatten().collect();
        let first = runs.first()?;
        let mean = |s: &Option<Spread>| s.as_ref().map_or(f64::NAN, |s| round2(s.mean));
        Some(RunSummary {
            system: self.system.clone(),
            requests: runs.iter().map(|r| r.requests).sum::<usize>() / runs.len(),
            ttft_p50_ms: mean(&f.ttft_p50_ms),
            ttft_p95_ms: mean(&f.ttft_p95_ms),
            output_tok_per_s: mean(&f.output_tok_per_s),
            prefix_hit_rate: f.prefix_hit_rate.as_ref().map_or(0.0, |s| (s.mean * 1e4).round() / 1e4),
            errors: f.errors,
            wall_s: first.wall_s,
        })
    }
}

/// One figure of `a` against `b`: both intervals and the verdict.
fn compare_one(a: Option<&Spread>, b: Option<&Spread>, lower_better: bool) -> Option<Value> {
    let (a, b) = (a?, b?);
    let v = verdict(a, b, lower_better);
    Some(json!({
        "attache": [round2(a.min), round2(a.mean), round2(a.max)],
        "other": [round2(b.min), round2(b.mean), round2(b.max)],
        "ratio_of_means": if b.mean != 0.0 { (a.mean / b.mean * 1000.0).round() / 1000.0 } else { f64::NAN },
        "verdict": v,
    }))
}

/// Each Attaché mode against every other system: TTFT p50 and p95 (lower is better), and
/// output (higher is better; the closed loop's where it ran).
pub fn comparisons(figs: &[Figures]) -> Value {
    let mut out = serde_json::Map::new();
    for a in figs.iter().filter(|f| f.system.starts_with("attache")) {
        for b in figs.iter().filter(|f| !f.system.starts_with("attache")) {
            let output = match (&a.closed_output_tok_per_s, &b.closed_output_tok_per_s) {
                (Some(x), Some(y)) => compare_one(Some(x), Some(y), false),
                _ => compare_one(a.output_tok_per_s.as_ref(), b.output_tok_per_s.as_ref(), false),
            };
            out.insert(
                format!("{}_vs_{}", a.system, b.system),
                json!({
                    "ttft_p50_ms": compare_one(a.ttft_p50_ms.as_ref(), b.ttft_p50_ms.as_ref(), true),
                    "ttft_p95_ms": compare_one(a.ttft_p95_ms.as_ref(), b.ttft_p95_ms.as_ref(), true),
                    "output_tok_per_s": output,
                }),
            );
        }
    }
    Value::Object(out)
}

/// The verdict of a comparison's figure, for tables.
pub fn verdict_of(c: &Value, pair: &str, figure: &str) -> Option<Verdict> {
    serde_json::from_value(c.get(pair)?.get(figure)?.get("verdict")?.clone()).ok()
}

/// The calibration of Attaché's index: per seed, its expected hit rate against the engines'.
pub fn calibration(figs: &[Figures], tolerance: f64) -> Value {
    let mut out = serde_json::Map::new();
    for f in figs.iter().filter(|f| f.system.starts_with("attache")) {
        let (Some(e), Some(h)) = (&f.expected_hit_rate, &f.prefix_hit_rate) else { continue };
        let gaps: Vec<f64> =
            e.runs.iter().zip(&h.runs).filter(|(x, y)| x.is_finite() && y.is_finite()).map(|(x, y)| x - y).collect();
        let worst = gaps.iter().copied().map(f64::abs).fold(0.0, f64::max);
        let believed = f.believed_hit_rate.as_ref().map(|b| b.runs.iter().map(|v| round3(*v)).collect::<Vec<_>>());
        out.insert(
            f.system.clone(),
            json!({"expected": e.runs.iter().map(|v| round3(*v)).collect::<Vec<_>>(),
                   "believed": believed,
                   "engine": h.runs.iter().map(|v| round3(*v)).collect::<Vec<_>>(),
                   "largest_gap": round3(worst), "target": format!("<= {tolerance}"),
                   "met": !gaps.is_empty() && worst <= tolerance}),
        );
    }
    Value::Object(out)
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

fn cell(s: Option<&Spread>, digits: usize) -> String {
    match s {
        Some(s) if s.runs.len() > 1 => format!("{:.d$} ({:.d$}–{:.d$})", s.mean, s.min, s.max, d = digits),
        Some(s) => format!("{:.d$}", s.mean, d = digits),
        None => "–".into(),
    }
}

/// The table of figures with their intervals (markdown).
pub fn markdown(figs: &[Figures]) -> String {
    let mut m = String::new();
    let _ = writeln!(
        m,
        "| system | seeds | TTFT p50 ms | TTFT p95 ms | output tok/s (open) | output tok/s (closed) | engine hit rate | index expected | index belief | hit rate (closed) | errors |"
    );
    let _ = writeln!(m, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for f in figs {
        let _ = writeln!(
            m,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            f.system,
            f.seeds,
            cell(f.ttft_p50_ms.as_ref(), 0),
            cell(f.ttft_p95_ms.as_ref(), 0),
            cell(f.output_tok_per_s.as_ref(), 0),
            cell(f.closed_output_tok_per_s.as_ref(), 0),
            cell(f.prefix_hit_rate.as_ref(), 3),
            cell(f.expected_hit_rate.as_ref(), 3),
            cell(f.believed_hit_rate.as_ref(), 3),
            cell(f.closed_prefix_hit_rate.as_ref(), 3),
            f.errors
        );
    }
    m
}

/// The same table, for the terminal.
pub fn print(title: &str, figs: &[Figures]) {
    println!("\n{title}: mean (lowest–highest) over the seeds");
    print!("{}", markdown(figs));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(system: &str, ttft: f64, out: f64, hit: f64) -> RunSummary {
        RunSummary {
            system: system.into(),
            requests: 10,
            ttft_p50_ms: ttft,
            ttft_p95_ms: ttft * 2.0,
            output_tok_per_s: out,
            prefix_hit_rate: hit,
            errors: 0,
            wall_s: 1.0,
        }
    }

    fn seeds(system: &str, rows: &[(f64, f64, f64)], expected: &[f64]) -> SystemSeeds {
        let mut s = SystemSeeds::new(system, rows.len());
        for (i, &(t, o, h)) in rows.iter().enumerate() {
            s.open[i] = Some(row(system, t, o, h));
            s.expected_hit[i] = expected.get(i).copied();
        }
        s
    }

    #[test]
    fn a_win_needs_separate_intervals_and_a_missing_seed_is_left_out() {
        let a = seeds("attache-precise", &[(100.0, 50.0, 0.8), (110.0, 52.0, 0.82)], &[0.85, 0.9]);
        let b = seeds("smg-cache-aware", &[(120.0, 51.0, 0.7), (130.0, 49.0, 0.72)], &[]);
        let mut c = seeds("round-robin", &[(105.0, 50.0, 0.5), (200.0, 50.0, 0.5)], &[]);
        c.open[1] = None;
        let figs = vec![a.figures(), b.figures(), c.figures()];
        let cmp = comparisons(&figs);
        assert_eq!(verdict_of(&cmp, "attache-precise_vs_smg-cache-aware", "ttft_p50_ms"), Some(Verdict::Win));
        assert_eq!(verdict_of(&cmp, "attache-precise_vs_smg-cache-aware", "output_tok_per_s"), Some(Verdict::Tie));
        // Round-robin's second seed is missing: its interval is its one run, 105, inside 100-110.
        assert_eq!(figs[2].seeds, 1);
        assert_eq!(verdict_of(&cmp, "attache-precise_vs_round-robin", "ttft_p50_ms"), Some(Verdict::Tie));
        assert!(cmp.get("smg-cache-aware_vs_round-robin").is_none(), "only Attaché is compared");
        let mean = a.mean_row().unwrap();
        assert_eq!((mean.ttft_p50_ms, mean.output_tok_per_s), (105.0, 51.0));
    }

    #[test]
    fn calibration_reports_the_largest_gap_over_the_seeds() {
        let a = seeds("attache-approx", &[(1.0, 1.0, 0.80), (1.0, 1.0, 0.70)], &[0.85, 0.85]);
        let cal = calibration(&[a.figures()], 0.1);
        assert_eq!(cal["attache-approx"]["largest_gap"], json!(0.15));
        assert_eq!(cal["attache-approx"]["met"], json!(false));
        let b = seeds("attache-approx", &[(1.0, 1.0, 0.80)], &[0.85]);
        assert_eq!(calibration(&[b.figures()], 0.1)["attache-approx"]["met"], json!(true));
    }
}
