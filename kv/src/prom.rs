//! A Prometheus text-format parser, and the extraction of the engine metrics a router needs
//! from an exposition, under the names its engine's profile gives ([`crate::engine`]).
//!
//! The parser accepts any label order, escaped label values, `# HELP`/`# TYPE` comments and
//! optional timestamps; a malformed line is skipped and counted, never fatal.

use std::collections::BTreeMap;

use crate::engine::Engine;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

impl Sample<'_> {
    pub fn label(&self, k: &str) -> Option<&str> {
        self.labels.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str())
    }
}

/// Parsed exposition: samples plus the number of lines that could not be parsed.
#[derive(Debug, Default)]
pub struct Exposition<'a> {
    pub samples: Vec<Sample<'a>>,
    pub bad_lines: usize,
}

fn parse_labels(s: &str) -> Option<(Vec<(&str, String)>, &str)> {
    // s starts right after '{'; returns labels and the rest after '}'.
    let mut labels = Vec::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start_matches([' ', ',']);
        if let Some(r) = rest.strip_prefix('}') {
            return Some((labels, r));
        }
        let eq = rest.find('=')?;
        let name = rest.get(..eq)?.trim();
        rest = rest.get(eq + 1..)?.trim_start();
        rest = rest.strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                '"' => break i,
                c => value.push(c),
            }
        };
        rest = rest.get(end + 1..)?;
        labels.push((name, value));
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
    // Byte-wise: the format's separators are ASCII, and this loop is most of what following
    // 1,000 engines costs the host (a char-wise scan and trim took twice as long).
    for line in text.split('\n') {
        let line = line.trim_ascii();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.bytes().position(|b| b == b'{' || b.is_ascii_whitespace()).unwrap_or(line.len());
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
            parse_value(rest).map(|v| (Vec::new(), v))
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
    /// `vllm:lora_requests_info` newest series: running and waiting adapters, max.
    pub running_loras: Vec<String>,
    pub waiting_loras: Vec<String>,
    pub max_lora: Option<u32>,
    /// TTFT histogram totals (`*_time_to_first_token_seconds_sum` / `_count`), cumulative.
    pub ttft_sum: f64,
    pub ttft_count: f64,
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
            || n.strip_prefix(names.ttft).is_some_and(|r| r == "_sum" || r == "_count")
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
        .map(str::to_owned)
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
    m.prefix_cache_hits = exp.samples.iter().filter(|s| s.name == names.prefix_cache_hits).map(|s| s.value).sum();
    let ttft = names.ttft;
    let total = |suffix: &str| -> f64 {
        exp.samples.iter().filter(|s| s.name.strip_prefix(ttft).is_some_and(|r| r == suffix)).map(|s| s.value).sum()
    };
    m.ttft_sum = total("_sum");
    m.ttft_count = total("_count");
    // LoRA: the series with the largest value (a timestamp) is the current one.
    let lora = exp.samples.iter().filter(|s| s.name == names.lora_info).max_by(|a, b| a.value.total_cmp(&b.value));
    if let Some(l) = lora {
        let split = |v: Option<&str>| -> Vec<String> {
            v.unwrap_or("").split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect()
        };
        m.running_loras = split(l.label("running_lora_adapters"));
        m.waiting_loras = split(l.label("waiting_lora_adapters"));
        m.max_lora = l.label("max_lora").and_then(|v| v.parse().ok());
    }
    Ok(m)
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
        assert_eq!(e.samples[0].label("b"), Some("x\"y,z"));
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
    }
}
