//! Drive a workload through a gateway and summarise what happened.

use std::sync::Arc;
use std::time::{Duration, Instant};

use attache_e2e::client::{self, Outcome};
use serde::Serialize;
use tokio::sync::Semaphore;

use crate::workload::Item;

/// One system's row in a results table.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub system: String,
    pub requests: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p95_ms: f64,
    pub output_tok_per_s: f64,
    pub prefix_hit_rate: f64,
    pub errors: usize,
    pub wall_s: f64,
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Send every item with at most `concurrency` in flight; returns outcomes in item order.
pub async fn drive(
    label: &str,
    http: &reqwest::Client,
    url: &str,
    model: &str,
    items: &[Item],
    concurrency: usize,
) -> (Vec<Outcome>, Duration) {
    let sem = Arc::new(Semaphore::new(concurrency.max(1)));
    let start = Instant::now();
    let progress = crate::progress::Progress::start(label, items.len(), 1, Duration::from_secs(5));
    let mut handles = Vec::with_capacity(items.len());
    for it in items {
        let permit = sem.clone().acquire_owned().await;
        let http = http.clone();
        let url = url.to_string();
        let body = client::chat_body(model, &it.system, &it.user, it.max_tokens);
        let progress = progress.clone();
        handles.push(tokio::spawn(async move {
            let _p = permit;
            let o = client::post(&http, &url, body, &[]).await;
            progress.done();
            o
        }));
    }
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.unwrap_or_default());
    }
    (out, start.elapsed())
}

/// Summarise outcomes; `hits`/`queries` are the engines' prefix-cache counter deltas.
pub fn summarise(system: &str, outcomes: &[Outcome], wall: Duration, queries: f64, hits: f64) -> RunSummary {
    let mut ttft: Vec<f64> =
        outcomes.iter().filter(|o| o.ok()).filter_map(|o| o.ttft).map(|d| d.as_secs_f64() * 1000.0).collect();
    ttft.sort_by(f64::total_cmp);
    let tokens: u64 = outcomes.iter().filter(|o| o.ok()).map(|o| o.output_tokens).sum();
    let errors = outcomes.iter().filter(|o| !o.ok() || !o.done).count();
    RunSummary {
        system: system.into(),
        requests: outcomes.len(),
        ttft_p50_ms: round2(percentile(&ttft, 50.0)),
        ttft_p95_ms: round2(percentile(&ttft, 95.0)),
        output_tok_per_s: round2(tokens as f64 / wall.as_secs_f64().max(1e-9)),
        prefix_hit_rate: if queries > 0.0 { round4(hits / queries) } else { 0.0 },
        errors,
        wall_s: round2(wall.as_secs_f64()),
    }
}

pub fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}
fn round4(v: f64) -> f64 {
    (v * 10_000.0).round() / 10_000.0
}

/// Stamp a results document with the date and machine, write it as pretty JSON, and say where.
pub fn write_results(out: &std::path::Path, mut doc: serde_json::Value) -> anyhow::Result<()> {
    use anyhow::Context;
    doc["date"] = serde_json::json!(std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%dT%H:%M:%SZ")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()));
    if doc.get("build").is_none() {
        doc["build"] = serde_json::json!(std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()));
    }
    doc["machine"] =
        serde_json::json!(format!("{} cores", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)));
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    println!("\nwrote {}", out.display());
    Ok(())
}

/// Print a results table.
pub fn print_table(title: &str, rows: &[RunSummary]) {
    println!("\n{title}");
    println!(
        "{:<14} {:>8} {:>12} {:>12} {:>17} {:>16} {:>7}",
        "system", "requests", "ttft_p50_ms", "ttft_p95_ms", "output_tok_per_s", "prefix_hit_rate", "errors"
    );
    for r in rows {
        println!(
            "{:<14} {:>8} {:>12.2} {:>12.2} {:>17.2} {:>16.4} {:>7}",
            r.system, r.requests, r.ttft_p50_ms, r.ttft_p95_ms, r.output_tok_per_s, r.prefix_hit_rate, r.errors
        );
    }
}

/// One request of an open-loop run, as sent.
pub struct Sent {
    /// 0 = warm-up, then the ladder's stages.
    pub stage: usize,
    /// Real time of sending, from the run's start.
    pub at: Duration,
    pub outcome: Outcome,
}

/// One stage's figures for one system (simulated time).
#[derive(Debug, Clone, Serialize)]
pub struct StageSummary {
    pub qps: f64,
    pub requests: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub output_tok_per_s: f64,
    pub errors: usize,
    /// Every request of the stage completed (no error, no timeout): the system sustained the
    /// stage's offered load.
    pub sustained: bool,
    /// TTFT p90 within the run's SLO.
    pub within_slo: bool,
}

fn completed(s: &Sent) -> bool {
    s.outcome.ok() && s.outcome.done
}

/// The summary row over the measured stages (stage > 0) and one row per stage, converting
/// real time to simulated time (`scale`). `rates[i]` is stage i's offered rate.
pub fn summarise_stages(
    system: &str,
    scale: f64,
    rates: &[f64],
    sent: &[Sent],
    hit_rate: f64,
    slo_ttft_p90_ms: f64,
) -> (RunSummary, Vec<StageSummary>) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0 / scale;
    let ttfts = |v: &[&Sent]| {
        let mut t: Vec<f64> = v.iter().filter(|s| completed(s)).filter_map(|s| s.outcome.ttft).map(ms).collect();
        t.sort_by(f64::total_cmp);
        t
    };
    let tokens = |v: &[&Sent]| v.iter().filter(|s| completed(s)).map(|s| s.outcome.output_tokens).sum::<u64>() as f64;
    // Throughput: tokens over the span from the first send to the last completion.
    let span = |v: &[&Sent]| {
        let first = v.iter().map(|s| s.at).min().unwrap_or_default();
        let last = v.iter().map(|s| s.at + s.outcome.total).max().unwrap_or_default();
        last.saturating_sub(first).as_secs_f64() / scale
    };
    let measured: Vec<&Sent> = sent.iter().filter(|s| s.stage > 0).collect();
    let all = ttfts(&measured);
    let row = RunSummary {
        system: system.into(),
        requests: measured.len(),
        ttft_p50_ms: round2(percentile(&all, 50.0)),
        ttft_p95_ms: round2(percentile(&all, 95.0)),
        output_tok_per_s: round2(tokens(&measured) / span(&measured).max(1e-9)),
        prefix_hit_rate: round4(hit_rate),
        errors: measured.iter().filter(|s| !completed(s)).count(),
        wall_s: round2(span(&measured) * scale),
    };
    let stages = rates
        .iter()
        .enumerate()
        .skip(1)
        .map(|(i, &qps)| {
            let v: Vec<&Sent> = sent.iter().filter(|s| s.stage == i).collect();
            let t = ttfts(&v);
            let errors = v.iter().filter(|s| !completed(s)).count();
            let p90 = percentile(&t, 90.0);
            StageSummary {
                qps,
                requests: v.len(),
                ttft_p50_ms: round2(percentile(&t, 50.0)),
                ttft_p90_ms: round2(p90),
                output_tok_per_s: round2(tokens(&v) / span(&v).max(1e-9)),
                errors,
                sustained: errors == 0 && !v.is_empty(),
                within_slo: errors == 0 && p90.is_finite() && p90 <= slo_ttft_p90_ms,
            }
        })
        .collect();
    (row, stages)
}

/// Text for an SVG document.
fn xml(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// One bar panel of [`bars_svg`]: its title and the figure it shows.
type BarPanel = (&'static str, fn(&RunSummary) -> f64);

/// An SVG of side-by-side bars, one panel per figure (TTFT p50 and p95, output, prefix hit
/// rate), one bar per system, each labelled with its value.
pub fn bars_svg(title: &str, rows: &[RunSummary]) -> String {
    const COLORS: [&str; 6] = ["#7f7f7f", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];
    let panels: [BarPanel; 4] = [
        ("TTFT p50 (ms), lower wins", |r| r.ttft_p50_ms),
        ("TTFT p95 (ms), lower wins", |r| r.ttft_p95_ms),
        ("output tok/s, higher wins", |r| r.output_tok_per_s),
        ("prefix hit rate, higher wins", |r| r.prefix_hit_rate),
    ];
    let (pw, ph, top, bottom) = (200.0, 220.0, 40.0, 30.0);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"18\" font-size=\"14\">{title}</text>\n",
        pw * panels.len() as f64 + 20.0,
        top + ph + bottom + 16.0 * rows.len() as f64,
        title = xml(title)
    );
    for (pi, (label, get)) in panels.iter().enumerate() {
        let ox = 10.0 + pi as f64 * pw;
        // A system with no successful request has no figure: it draws as 0.
        let value = |r: &RunSummary| Some(get(r)).filter(|v| v.is_finite() && *v > 0.0).unwrap_or(0.0);
        let max = rows.iter().map(value).fold(0.0, f64::max).max(1e-9);
        out.push_str(&format!("<text x=\"{}\" y=\"{}\" font-weight=\"bold\">{label}</text>\n", ox + 10.0, top));
        let bw = (pw - 40.0) / rows.len().max(1) as f64;
        let base = top + ph;
        out.push_str(&format!(
            "<line x1=\"{}\" y1=\"{base}\" x2=\"{}\" y2=\"{base}\" stroke=\"black\"/>\n",
            ox + 10.0,
            ox + pw - 20.0
        ));
        for (i, r) in rows.iter().enumerate() {
            let v = value(r);
            let h = (ph - 40.0) * v / max;
            let x = ox + 14.0 + i as f64 * bw;
            out.push_str(&format!(
                "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"{}\"/>\n\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
                base - h,
                bw - 8.0,
                COLORS[i % COLORS.len()],
                x + (bw - 8.0) / 2.0,
                base - h - 4.0,
                if v >= 100.0 {
                    format!("{v:.0}")
                } else if v >= 1.0 {
                    format!("{v:.1}")
                } else {
                    format!("{v:.3}")
                }
            ));
        }
    }
    for (i, r) in rows.iter().enumerate() {
        let y = top + ph + bottom + 16.0 * i as f64;
        out.push_str(&format!(
            "<rect x=\"10\" y=\"{:.1}\" width=\"12\" height=\"10\" fill=\"{}\"/><text x=\"28\" y=\"{y:.1}\">{}</text>\n",
            y - 9.0,
            COLORS[i % COLORS.len()],
            xml(&r.system)
        ));
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(system: &str, ttft: f64, tok: f64) -> RunSummary {
        RunSummary {
            system: system.into(),
            requests: 10,
            ttft_p50_ms: ttft,
            ttft_p95_ms: 2.0 * ttft,
            output_tok_per_s: tok,
            prefix_hit_rate: 0.5,
            errors: 0,
            wall_s: 1.0,
        }
    }

    #[test]
    fn bars_show_every_system_and_figure() {
        let svg = bars_svg("demo", &[row("round-robin", 176.9, 418.4), row("attache", 64.3, 528.4)]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        for want in [
            "round-robin",
            "attache",
            "TTFT p50 (ms)",
            "output tok/s",
            "prefix hit rate",
            ">528<",
            ">177<",
            ">64.3<",
            ">0.500<",
        ] {
            assert!(svg.contains(want), "missing {want}");
        }
        let odd = bars_svg("a < b", &[row("x&y", f64::NAN, -1.0)]);
        assert!(odd.contains("a &lt; b") && odd.contains("x&amp;y") && !odd.contains("NaN"), "{odd}");
        // The background, a bar per system in each of the four panels, a legend swatch each.
        assert_eq!(svg.matches("<rect").count(), 1 + 4 * 2 + 2);
    }
}
