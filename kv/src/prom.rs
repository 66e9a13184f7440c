//! A Prometheus text-format parser, and the extraction of the engine metrics a router needs
//! from an exposition, under the names its engine's profile gives ([`crate::engine`]).
//!
//! The parser accepts any label order, escaped label values, `# HELP`/`# TYPE` comments and
//! optional timestamps; a malformed line is skipped and counted, never fatal.

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::engine::Engine;

/// One sample line. Its labels stay as written until one is asked for: a scrape reads the
/// labels of two or three samples, and the host parses 20,000 pages a second.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// The label block between the braces, already checked to parse.
    labels: &'a str,
    pub value: f64,
}

impl<'a> Sample<'a> {
    /// The value of label `k`, unescaped (borrowed unless it had escapes).
    pub fn label(&self, k: &str) -> Option<Cow<'a, str>> {
        self.labels().find(|(n, _)| *n == k).map(|(_, v)| v)
    }

    /// Every label, in order.
    pub fn labels(&self) -> impl Iterator<Item = (&'a str, Cow<'a, str>)> {
        let mut rest = self.labels;
        std::iter::from_fn(move || match next_label(&mut rest) {
            Some(Ok((n, raw))) => Some((n, unescape(raw))),
            _ => None,
        })
    }
}

/// Parsed exposition: samples plus the number of lines that could not be parsed.
#[derive(Debug, Default)]
pub struct Exposition<'a> {
    pub samples: Vec<Sample<'a>>,
    pub bad_lines: usize,
}

/// The next `name="value"` of a label block (`rest` starts after `{` or a previous label):
/// None at the closing brace, the name and the raw value (between the quotes, escapes kept)
/// otherwise, Err when malformed. `rest` moves past what was read.
fn next_label<'a>(rest: &mut &'a str) -> Option<Result<(&'a str, &'a str), ()>> {
    // Byte-wise: every delimiter is ASCII, so each index below is a char boundary.
    let b = rest.as_bytes();
    let mut i = b.iter().position(|c| *c != b' ' && *c != b',').unwrap_or(b.len());
    if b.get(i).is_none_or(|c| *c == b'}') {
        *rest = rest.get(i..).unwrap_or("");
        return None;
    }
    let mut label = || -> Option<(&'a str, &'a str)> {
        let name_start = i;
        i += b.get(i..)?.iter().position(|c| *c == b'=')?;
        let name = rest.get(name_start..i)?.trim();
        i += 1;
        i += b.get(i..)?.iter().position(|c| *c != b' ')?;
        (b.get(i) == Some(&b'"')).then_some(())?;
        i += 1;
        let value_start = i;
        loop {
            match b.get(i)? {
                b'\\' => i += 2,
                b'"' => break,
                _ => i += 1,
            }
        }
        Some((name, rest.get(value_start..i)?))
    };
    match label() {
        Some(found) => {
            *rest = rest.get(i + 1..).unwrap_or("");
            Some(Ok(found))
        }
        None => {
            *rest = "";
            Some(Err(()))
        }
    }
}

/// A label value without its escapes (`\n`, `\\`, `\"`).
fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        match (c, c == '\\') {
            (_, true) => match chars.next() {
                Some('n') => out.push('\n'),
                Some(e) => out.push(e),
                None => {}
            },
            (c, false) => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// Check a label block (`s` starts right after `{`): the block's text and what follows `}`.
fn parse_labels(s: &str) -> Option<(&str, &str)> {
    let mut rest = s;
    loop {
        match next_label(&mut rest) {
            Some(Ok(_)) => {}
            Some(Err(())) => return None,
            None => {
                let after = rest.strip_prefix('}')?;
                return Some((s.get(..s.len() - rest.len())?, after));
            }
        }
    }
}

fn parse_value(s: &str) -> Option<f64> {
    let v = s.split_whitespace().next()?;
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => v.parse().ok(),
    }
}

/// Parse a whole exposition.
pub fn parse(text: &str) -> Exposition<'_> {
    parse_only(text, |_| true)
}

/// Parse the samples whose metric name `keep` accepts; other lines are skipped unparsed (an
/// engine's page is mostly histogram buckets a router does not read).
pub fn parse_only<'a>(text: &'a str, keep: impl Fn(&str) -> bool) -> Exposition<'a> {
    let mut out = Exposition::default();
    // Byte-wise, with memchr: the format's separators are ASCII, and this loop is most of what
    // following 1,000 engines costs the host when an engine sends its whole page.
    let mut lines = text;
    while !lines.is_empty() {
        let end = memchr::memchr(b'\n', lines.as_bytes()).unwrap_or(lines.len());
        let (line, rest) = (lines.get(..end).unwrap_or(""), lines.get(end + 1..).unwrap_or(""));
        lines = rest;
        let line = line.trim_ascii();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = memchr::memchr3(b'{', b' ', b'\t', line.as_bytes()).unwrap_or(line.len());
        let Some(name) = line.get(..name_end) else {
            out.bad_lines += 1;
            continue;
        };
        if !keep(name) {
            continue;
        }
        let rest = line.get(name_end..).unwrap_or("");
        let parsed = if let Some(r) = rest.strip_prefix('{') {
            parse_labels(r).and_then(|(labels, r)| parse_value(r).map(|v| (labels, v)))
        } else {
            parse_value(rest).map(|v| ("", v))
        };
        match parsed {
            Some((labels, value)) if !name.is_empty() => out.samples.push(Sample { name, labels, value }),
            _ => out.bad_lines += 1,
        }
    }
    out
}

/// What the router reads from one engine's `/metrics`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineMetrics {
    pub waiting: f64,
    pub running: f64,
    /// 0..1; averaged over data-parallel engines.
    pub kv_usage: f64,
    pub block_size: Option<u32>,
    pub num_gpu_blocks: Option<u64>,
    pub prefix_cache_queries: f64,
    pub prefix_cache_hits: f64,
    /// The page had the prefix-cache query counter (the two above are 0 when it did not).
    pub prefix_cache_reported: bool,
    /// `vllm:lora_requests_info` newest series: running and waiting adapters, max.
    pub running_loras: Vec<String>,
    pub waiting_loras: Vec<String>,
    pub max_lora: Option<u32>,
    /// TTFT histogram totals (`*_time_to_first_token_seconds_sum` / `_count`), cumulative.
    pub ttft_sum: f64,
    pub ttft_count: f64,
    /// Queue-time histogram total (`vllm:request_queue_time_seconds_sum`), cumulative.
    pub queue_time_sum: f64,
    /// Inter-token latency histogram totals (`*_inter_token_latency_seconds_sum` / `_count`).
    pub itl_sum: f64,
    pub itl_count: f64,
    /// Served model names (the `model_name` label of the load gauges), sorted: what an
    /// endpoint serves when discovery did not say (Kubernetes pods).
    pub models: Vec<String>,
}

/// Error when an exposition lacks the metrics a router needs.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("exposition has none of the {engine} metrics {missing:?}")]
pub struct MissingMetrics {
    pub engine: String,
    pub missing: Vec<&'static str>,
}

fn first_present(exp: &Exposition<'_>, names: &[&'static str]) -> Option<Vec<f64>> {
    names.iter().find_map(|n| {
        let v: Vec<f64> = exp.samples.iter().filter(|s| s.name == *n).map(|s| s.value).collect();
        (!v.is_empty()).then_some(v)
    })
}

/// Extract [`EngineMetrics`] under the names of `engine`'s profile.
pub fn engine_metrics(text: &str, engine: Engine) -> Result<EngineMetrics, MissingMetrics> {
    let names = engine.metrics();
    let exp = parse_only(text, |n| {
        names.waiting.contains(&n)
            || names.running.contains(&n)
            || names.kv_usage.contains(&n)
            || n == names.cache_info
            || n == names.prefix_cache_queries
            || n == names.prefix_cache_hits
            || n == names.lora_info
            || n == names.ttft_sum
            || n == names.ttft_count
            || n == names.queue_time_sum
            || names.itl_sum.contains(&n)
            || names.itl_count.contains(&n)
    });
    let waiting = first_present(&exp, names.waiting);
    let running = first_present(&exp, names.running);
    let kv = first_present(&exp, names.kv_usage);
    let (Some(waiting), Some(running), Some(kv)) = (waiting, running, kv) else {
        return Err(MissingMetrics {
            engine: engine.name().into(),
            missing: [names.waiting[0], names.running[0], names.kv_usage[0]].to_vec(),
        });
    };
    let mut models: Vec<String> = exp
        .samples
        .iter()
        .filter(|s| names.running.contains(&s.name))
        .filter_map(|s| s.label("model_name"))
        .filter(|v| !v.is_empty())
        .map(Cow::into_owned)
        .collect();
    models.sort_unstable();
    models.dedup();
    let mut m = EngineMetrics {
        models,
        waiting: waiting.iter().sum(),
        running: running.iter().sum(),
        kv_usage: kv.iter().sum::<f64>() / kv.len() as f64,
        ..Default::default()
    };
    if let Some(info) = exp.samples.iter().find(|s| s.name == names.cache_info) {
        m.block_size = info.label(names.block_size_label).and_then(|v| v.parse().ok());
        m.num_gpu_blocks = info.label(names.num_blocks_label).and_then(|v| v.parse().ok());
    }
    m.prefix_cache_queries = exp.samples.iter().filter(|s| s.name == names.prefix_cache_queries).map(|s| s.value).sum();
    m.prefix_cache_reported = exp.samples.iter().any(|s| s.name == names.prefix_cache_queries);
    m.prefix_cache_hits = exp.samples.iter().filter(|s| s.name == names.prefix_cache_hits).map(|s| s.value).sum();
    let total = |name: &str| -> f64 { exp.samples.iter().filter(|s| s.name == name).map(|s| s.value).sum() };
    m.ttft_sum = total(names.ttft_sum);
    m.ttft_count = total(names.ttft_count);
    m.queue_time_sum = total(names.queue_time_sum);
    // The first name of the pair that the page has (both count the same gaps).
    let present = |pair: [&'static str; 2]| pair.into_iter().find(|n| exp.samples.iter().any(|s| s.name == *n));
    if let (Some(sum), Some(count)) = (present(names.itl_sum), present(names.itl_count)) {
        m.itl_sum = total(sum);
        m.itl_count = total(count);
    }
    // LoRA: the series with the largest value (a timestamp) is the current one.
    let lora = exp.samples.iter().filter(|s| s.name == names.lora_info).max_by(|a, b| a.value.total_cmp(&b.value));
    if let Some(l) = lora {
        let split = |v: Option<Cow<'_, str>>| -> Vec<String> {
            v.unwrap_or_default().split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect()
        };
        m.running_loras = split(l.label("running_lora_adapters"));
        m.waiting_loras = split(l.label("waiting_lora_adapters"));
        m.max_lora = l.label("max_lora").and_then(|v| v.parse().ok());
    }
    Ok(m)
}

/// The page prometheus_client serves for a `name[]` request: the samples whose name is one of
/// `names` (exact sample names: `_total`, `_sum`, `_count` included), each family's `# HELP`
/// and `# TYPE` lines before its first kept sample, nothing else. What the simulator serves
/// below `/metrics/`, as vLLM does ([`crate::engine::Engine::filtered_metrics_path`]).
pub fn restrict(page: &str, names: &[&str]) -> String {
    let mut out = String::new();
    let mut family: Vec<&str> = Vec::new();
    let mut emitted = false;
    let mut after_samples = false;
    for line in page.lines() {
        if line.starts_with('#') {
            if after_samples {
                (family, emitted, after_samples) = (Vec::new(), false, false);
            }
            family.push(line);
            continue;
        }
        after_samples = true;
        let name_end = memchr::memchr3(b'{', b' ', b'\t', line.as_bytes()).unwrap_or(line.len());
        if names.contains(&line.get(..name_end).unwrap_or("")) {
            if !emitted {
                for c in &family {
                    out.push_str(c);
                    out.push('\n');
                }
                emitted = true;
            }
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Group samples by name, for debugging and tests.
pub fn names<'a>(exp: &'a Exposition<'a>) -> BTreeMap<&'a str, usize> {
    let mut m = BTreeMap::new();
    for s in &exp.samples {
        *m.entry(s.name).or_insert(0) += 1;
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_escapes_and_special_values() {
        let e = parse("# HELP x y\nfoo{a=\"1\",b=\"x\\\"y,z\"} 3.5 1700000000\nbar 1e3\nbaz{le=\"+Inf\"} +Inf\nbroken{a=\"1\" 2\n{}\n");
        assert_eq!(e.samples.len(), 3);
        assert_eq!(e.samples[0].label("b").as_deref(), Some("x\"y,z"));
        assert_eq!(e.samples[0].labels().map(|(n, _)| n).collect::<Vec<_>>(), ["a", "b"]);
        let esc = parse("x{a=\"1\\n2\\\\\"} 1\n").samples;
        assert_eq!(esc[0].label("a").as_deref(), Some("1\n2\\"));
        assert_eq!(e.samples[0].value, 3.5);
        assert_eq!(e.samples[1].value, 1000.0);
        assert!(e.samples[2].value.is_infinite());
        assert_eq!(e.bad_lines, 2);
    }

    #[test]
    fn vllm_and_sglang_and_fallback_names() {
        let v = "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\nvllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 1.0\n\
                 vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 4.0\nvllm:gpu_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
                 vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 1.0\n\
                 vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"c\",waiting_lora_adapters=\"d\"} 2.0\n";
        let m = engine_metrics(v, Engine::Vllm).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_usage), (3.0, 4.0, 0.25));
        assert_eq!(m.running_loras, vec!["c"]);
        assert_eq!(m.waiting_loras, vec!["d"]);
        assert_eq!(m.models, vec!["m"], "served models come from the load gauges' model_name");
        let s = "sglang:num_queue_reqs{tp_rank=\"0\"} 5\nsglang:num_running_reqs 1\nsglang:token_usage 0.5\nsglang:cache_config_info{page_size=\"64\",num_pages=\"100\"} 1\n";
        let m = engine_metrics(s, Engine::Sglang).unwrap();
        assert_eq!(
            (m.waiting, m.running, m.kv_usage, m.block_size, m.num_gpu_blocks),
            (5.0, 1.0, 0.5, Some(64), Some(100))
        );
        assert!(engine_metrics("foo 1\n", Engine::Vllm).is_err());
    }

    #[test]
    fn real_vllm_0_32_capture() {
        // Ground truth: /metrics of a real vLLM 0.32.0 (tests/fixtures/vllm-0.32/).
        let text = attache_fixtures::read_vllm("metrics.under-load.txt").unwrap();
        let e = parse(&text);
        assert_eq!(e.bad_lines, 0);
        let m = engine_metrics(&text, Engine::Vllm).unwrap();
        assert_eq!(m.block_size, Some(32));
        assert_eq!(m.num_gpu_blocks, Some(64));
        assert_eq!((m.running, m.waiting), (8.0, 0.0));
        assert!((m.kv_usage - 0.5079365).abs() < 1e-6, "kv {}", m.kv_usage);
        assert!(m.ttft_count > 0.0 && m.ttft_sum > 0.0, "ttft {} / {}", m.ttft_sum, m.ttft_count);
        assert!((m.queue_time_sum - 0.000_338_692).abs() < 1e-9, "queue time {}", m.queue_time_sum);
        // Time per output token: 408 inter-token gaps over 2.017 s, about 4.9 ms each.
        assert_eq!(m.itl_count, 408.0);
        assert!((m.itl_sum - 2.017_019_713).abs() < 1e-6, "itl {}", m.itl_sum);
    }

    #[test]
    fn the_filtered_page_gives_what_the_whole_page_gives() {
        let text = attache_fixtures::read_vllm("metrics.under-load.txt").unwrap();
        let names: Vec<&str> = Engine::Vllm.metrics().sample_names().collect();
        let small = restrict(&text, &names);
        assert_eq!(engine_metrics(&small, Engine::Vllm).unwrap(), engine_metrics(&text, Engine::Vllm).unwrap());
        assert!(small.len() * 10 < text.len(), "{} of {} bytes", small.len(), text.len());
        assert!(small.contains("# TYPE vllm:num_requests_running gauge\n"), "{small}");
        assert!(!small.contains("_bucket"), "{small}");
        assert_eq!(parse(&small).bad_lines, 0);
        // An empty filtered page (multi-process vLLM) says what is missing.
        assert!(engine_metrics("", Engine::Vllm).is_err());
    }
}
