//! File-described scenarios for the side-by-side comparison (`bench/scenarios/*.json`): the
//! simulated pool, the workload and its arrival process. A scenario expands into a fixed,
//! seeded plan of sessions (a single request is a one-turn session), so every system gets the
//! same requests at the same (simulated) times.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use attache_policies::rng::SplitMix64;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    pub description: String,
    pub pool: Pool,
    pub workload: Workload,
    pub arrivals: Arrivals,
    /// Simulated seconds before a request is counted as failed (inference-perf's 300).
    #[serde(default = "default_timeout")]
    pub request_timeout_s: f64,
    /// A stage is within the SLO when its TTFT p90 is at most this (simulated ms).
    #[serde(default = "default_slo")]
    pub slo_ttft_p90_ms: f64,
    #[serde(default)]
    pub seed: u64,
    /// The inference API the clients call.
    #[serde(default)]
    pub api: ApiKind,
    /// Clients and window of the closed-loop throughput run (`--closed-loop` overrides).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub closed_loop: Option<ClosedLoop>,
}

/// Clients and duration of a closed-loop run (`CONCURRENCY:SECONDS`, simulated seconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClosedLoop {
    pub concurrency: usize,
    pub seconds: f64,
}

impl std::str::FromStr for ClosedLoop {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (c, d) = s.split_once(':').ok_or_else(|| format!("{s:?}: expected CONCURRENCY:SECONDS"))?;
        let concurrency = c.trim().parse::<usize>().map_err(|e| format!("concurrency {c:?}: {e}"))?;
        let seconds = d.trim().parse::<f64>().map_err(|e| format!("seconds {d:?}: {e}"))?;
        if concurrency == 0 || !(seconds > 0.0 && seconds.is_finite()) {
            return Err(format!("{s:?}: concurrency and seconds must be positive"));
        }
        Ok(Self { concurrency, seconds })
    }
}

/// Which API a scenario's requests use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiKind {
    /// Streaming `/v1/chat/completions` with text (what every peer routes on).
    #[default]
    Chat,
    /// Anthropic's streaming `/v1/messages`, as Claude Code sends it: system blocks led by a
    /// per-request billing header, tool definitions, and turns that append the assistant's
    /// tool call and the tool's result.
    Messages,
    /// vLLM's token-in `/inference/v1/generate`, streamed.
    Generate,
}

impl ApiKind {
    pub fn path(self) -> &'static str {
        match self {
            ApiKind::Chat => "/v1/chat/completions",
            ApiKind::Messages => "/v1/messages",
            ApiKind::Generate => "/inference/v1/generate",
        }
    }
}

fn default_timeout() -> f64 {
    300.0
}
fn default_slo() -> f64 {
    2000.0
}

/// The simulated pool (the same for every system).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    pub engines: u16,
    /// Share of the cluster's KV cache the workload's resident prompts fill (sizes the KV);
    /// ignored when `num_gpu_blocks` is given.
    #[serde(default = "default_kv_share")]
    pub kv_share: f64,
    #[serde(default)]
    pub num_gpu_blocks: Option<usize>,
    #[serde(default = "default_block")]
    pub block_size: usize,
    #[serde(default = "default_seqs")]
    pub max_num_seqs: usize,
    #[serde(default = "default_batched")]
    pub max_num_batched_tokens: usize,
    #[serde(default = "one")]
    pub prefill_scale: f64,
    #[serde(default = "one")]
    pub decode_scale: f64,
    #[serde(default = "default_stream_interval")]
    pub stream_interval: usize,
    /// Engines and arrivals run this many times faster than modelled (0.25: 4x).
    pub time_scale: f64,
}

fn default_kv_share() -> f64 {
    0.732
}
fn default_block() -> usize {
    16
}
fn default_seqs() -> usize {
    256
}
fn default_batched() -> usize {
    8192
}
fn one() -> f64 {
    1.0
}
fn default_stream_interval() -> usize {
    1
}

/// What the clients send. Token counts are in the reference model's tokens (the engines and
/// Attaché's precise mode tokenize with it); text is drawn from a fixed word list.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Workload {
    /// llm-d's shared-prefix shape: `groups` long system prompts, `per_group` questions each.
    SharedPrefix { groups: usize, per_group: usize, system_tokens: usize, question_tokens: usize, output_tokens: u64 },
    /// Chat on a few shared system prompts; one turn per request.
    Chat { system_prompts: usize, system_tokens: usize, user_tokens: usize, output_tokens: u64 },
    /// Every prompt unique: nothing to reuse.
    Unique { prompt_tokens: usize, output_tokens: u64 },
    /// Coding-agent sessions: a tool preamble shared by all sessions, a per-session repository
    /// context, then `turns` turns each adding a tool output and the model's reply, with a
    /// tool-call pause between turns. A session's turns carry `x-session-id`.
    Agentic {
        preamble_tokens: usize,
        context_tokens: usize,
        turns: usize,
        turn_tokens: usize,
        output_tokens: u64,
        /// Tool-call pause between turns, uniform in [min, max] simulated seconds.
        pause_s: [f64; 2],
    },
    /// RL rollouts: each arrival is a group of `samples` requests for one prompt of
    /// `prompt_tokens` random token ids, sent at once (GRPO-style groups).
    Rollouts { prompt_tokens: usize, samples: usize, output_tokens: u64 },
}

/// Poisson arrivals over a ladder of stages; each arrival starts one session.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Arrivals {
    /// Unmeasured warm-up stages, `rate:seconds,...` (simulated).
    #[serde(default)]
    pub warmup: String,
    /// Measured stages, `rate:seconds,...`: session (= request, for one-turn workloads) starts
    /// per simulated second.
    pub ladder: String,
    /// Pause between stages, simulated seconds.
    #[serde(default)]
    pub interval_s: f64,
    /// Bursts: in every `period_s`, `on_share` of the arrivals land in its first `on_s`.
    #[serde(default)]
    pub burst: Option<Burst>,
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Burst {
    pub period_s: f64,
    pub on_s: f64,
    pub on_share: f64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Stage {
    pub rate: f64,
    pub seconds: f64,
}

pub fn parse_stages(s: &str) -> anyhow::Result<Vec<Stage>> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (q, d) = p.trim().split_once(':').context("stage must be rate:seconds")?;
            Ok(Stage { rate: q.trim().parse()?, seconds: d.trim().parse()? })
        })
        .collect()
}

/// One session of the plan.
#[derive(Debug, Clone)]
pub struct SessionPlan {
    /// Simulated seconds from the run's start.
    pub start_s: f64,
    /// 0 = warm-up, then 1.. for the ladder's stages.
    pub stage: usize,
    pub id: usize,
    pub system: Arc<str>,
    pub users: Vec<Arc<str>>,
    /// Pause before each turn after the first, simulated seconds.
    pub pauses_s: Vec<f64>,
    pub max_tokens: u64,
    pub session_header: bool,
    /// Token-id prompt (rollouts; the API is `generate`).
    pub prompt_ids: Option<Arc<[u32]>>,
    /// The rollout group (one per arrival; equals `id` for other workloads).
    pub group: usize,
}

/// Text of about `tokens` reference-model tokens, `words_per_token` calibrated by the caller.
pub struct TextGen {
    rng: SplitMix64,
    words_per_token: f64,
}

const WORDS: [&str; 48] = [
    "the", "cache", "engine", "token", "prefix", "block", "route", "pool", "policy", "tenant", "request", "queue",
    "latency", "filter", "snapshot", "index", "model", "decode", "prefill", "memory", "stream", "batch", "score",
    "weight", "server", "client", "header", "module", "signal", "metric", "budget", "window", "replica", "worker",
    "session", "context", "output", "input", "result", "error", "value", "table", "file", "line", "build", "test",
    "patch", "diff",
];

impl TextGen {
    pub fn new(seed: u64, words_per_token: f64) -> Self {
        Self { rng: SplitMix64::new(seed), words_per_token }
    }

    pub fn words(&mut self, n: usize) -> String {
        let mut s = String::with_capacity(n * 7);
        for i in 0..n {
            if i > 0 {
                s.push(' ');
            }
            s.push_str(WORDS[(self.rng.next_u64() % WORDS.len() as u64) as usize]);
        }
        s
    }

    pub fn tokens(&mut self, tokens: usize) -> String {
        self.words(((tokens as f64) * self.words_per_token).round().max(1.0) as usize)
    }

    fn uniform(&mut self) -> f64 {
        ((self.rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

impl Scenario {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let s: Scenario = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        anyhow::ensure!(!parse_stages(&s.arrivals.ladder)?.is_empty(), "{}: empty ladder", path.display());
        anyhow::ensure!(s.pool.time_scale > 0.0 && s.pool.engines > 0, "{}: bad pool", path.display());
        Ok(s)
    }

    /// Warm-up (or an empty stage 0) followed by the ladder.
    pub fn stages(&self) -> anyhow::Result<Vec<Stage>> {
        let mut warm = parse_stages(&self.arrivals.warmup)?;
        if warm.is_empty() {
            warm.push(Stage { rate: 1.0, seconds: 0.0 });
        }
        warm.extend(parse_stages(&self.arrivals.ladder)?);
        Ok(warm)
    }

    /// Tokens the workload keeps resident at once (for sizing the KV cache when the pool does
    /// not give `num_gpu_blocks`). One-turn workloads count the shared prompts plus
    /// `RESIDENT_REQUESTS` requests' own tokens; agentic sessions count their full final context
    /// for at most `RESIDENT_SESSIONS` sessions.
    pub fn resident_tokens(&self, sessions: usize) -> usize {
        const RESIDENT_REQUESTS: usize = 64;
        const RESIDENT_SESSIONS: usize = 256;
        match &self.workload {
            Workload::SharedPrefix { groups, per_group, system_tokens, question_tokens, .. } => {
                groups * (system_tokens + per_group * question_tokens)
            }
            Workload::Chat { system_prompts, system_tokens, user_tokens, .. } => {
                system_prompts * system_tokens + RESIDENT_REQUESTS * user_tokens
            }
            Workload::Unique { prompt_tokens, .. } | Workload::Rollouts { prompt_tokens, .. } => {
                RESIDENT_REQUESTS * prompt_tokens
            }
            Workload::Agentic { preamble_tokens, context_tokens, turns, turn_tokens, output_tokens, .. } => {
                preamble_tokens
                    + sessions.min(RESIDENT_SESSIONS)
                        * (context_tokens + turns * (turn_tokens + *output_tokens as usize))
            }
        }
    }

    /// KV blocks per engine.
    pub fn blocks_per_engine(&self, sessions: usize) -> usize {
        self.pool.num_gpu_blocks.unwrap_or_else(|| {
            let resident = self.resident_tokens(sessions) as f64;
            ((resident / self.pool.kv_share) / f64::from(self.pool.engines) / self.pool.block_size as f64).ceil()
                as usize
        })
    }

    /// Arrival times (simulated seconds) and stages.
    pub fn arrivals(&self) -> anyhow::Result<Vec<(f64, usize)>> {
        let stages = self.stages()?;
        let mut rng = TextGen::new(self.seed ^ 0xa77, 1.0);
        let mut out = Vec::new();
        let mut start = 0.0;
        for (i, st) in stages.iter().enumerate() {
            let mut t = start;
            // Bursts thin a Poisson process at the peak rate: rate_on in the on-window,
            // rate_off outside, with the stage's mean rate.
            let (peak, accept): (f64, Box<dyn Fn(f64) -> f64>) = match self.arrivals.burst {
                Some(b) if b.on_s > 0.0 && b.period_s > b.on_s => {
                    let on = st.rate * b.on_share * b.period_s / b.on_s;
                    let off = st.rate * (1.0 - b.on_share) * b.period_s / (b.period_s - b.on_s);
                    let peak = on.max(off);
                    let t0 = start;
                    (peak, Box::new(move |t: f64| if (t - t0) % b.period_s < b.on_s { on / peak } else { off / peak }))
                }
                _ => (st.rate, Box::new(|_| 1.0)),
            };
            loop {
                t += -rng.uniform().ln() / peak.max(1e-9);
                if t >= start + st.seconds {
                    break;
                }
                if rng.uniform() < accept(t) {
                    out.push((t, i));
                }
            }
            start += st.seconds + self.arrivals.interval_s;
        }
        Ok(out)
    }

    /// The whole plan: one session per arrival.
    pub fn plan(&self, words_per_token: f64) -> anyhow::Result<Vec<SessionPlan>> {
        let arrivals = self.arrivals()?;
        let mut g = TextGen::new(self.seed, words_per_token);
        let mut plan = Vec::with_capacity(arrivals.len());
        match &self.workload {
            Workload::SharedPrefix { groups, per_group, system_tokens, question_tokens, output_tokens } => {
                let systems: Vec<Arc<str>> = (0..*groups)
                    .map(|i| Arc::from(format!("You are assistant {i}. {}", g.tokens(*system_tokens))))
                    .collect();
                let mut prompts: Vec<(Arc<str>, Arc<str>)> = Vec::with_capacity(groups * per_group);
                for s in &systems {
                    for _ in 0..*per_group {
                        prompts.push((s.clone(), Arc::from(g.tokens(*question_tokens))));
                    }
                }
                // One shuffle, then cycled (inference-perf's shared_prefix generator).
                for i in (1..prompts.len()).rev() {
                    let j = (g.rng.next_u64() % (i as u64 + 1)) as usize;
                    prompts.swap(i, j);
                }
                for (id, (t, stage)) in arrivals.into_iter().enumerate() {
                    let (system, user) = prompts[id % prompts.len()].clone();
                    plan.push(one_turn(id, t, stage, system, user, *output_tokens));
                }
            }
            Workload::Chat { system_prompts, system_tokens, user_tokens, output_tokens } => {
                let systems: Vec<Arc<str>> = (0..*system_prompts)
                    .map(|i| {
                        Arc::from(format!("You are the support assistant of product {i}. {}", g.tokens(*system_tokens)))
                    })
                    .collect();
                for (id, (t, stage)) in arrivals.into_iter().enumerate() {
                    let system = systems[(g.rng.next_u64() % systems.len().max(1) as u64) as usize].clone();
                    let user = Arc::from(format!("Customer {id}: {}", g.tokens(*user_tokens)));
                    plan.push(one_turn(id, t, stage, system, user, *output_tokens));
                }
            }
            Workload::Unique { prompt_tokens, output_tokens } => {
                for (id, (t, stage)) in arrivals.into_iter().enumerate() {
                    let user = Arc::from(format!("Request {id}: {}", g.tokens(*prompt_tokens)));
                    plan.push(one_turn(id, t, stage, Arc::from("You are a helpful assistant."), user, *output_tokens));
                }
            }
            Workload::Agentic { preamble_tokens, context_tokens, turns, turn_tokens, output_tokens, pause_s } => {
                let preamble = format!("You are a coding agent. Tools: {}", g.tokens(*preamble_tokens));
                for (id, (t, stage)) in arrivals.into_iter().enumerate() {
                    let system = Arc::from(format!("{preamble}\nRepository {id}: {}", g.tokens(*context_tokens)));
                    let users = (0..*turns)
                        .map(|k| Arc::from(format!("Tool output {k}: {}", g.tokens(*turn_tokens))))
                        .collect();
                    let pauses_s =
                        (0..*turns).map(|_| pause_s[0] + (pause_s[1] - pause_s[0]).max(0.0) * g.uniform()).collect();
                    plan.push(SessionPlan {
                        start_s: t,
                        stage,
                        id,
                        system,
                        users,
                        pauses_s,
                        max_tokens: *output_tokens,
                        session_header: true,
                        prompt_ids: None,
                        group: id,
                    });
                }
            }
            Workload::Rollouts { prompt_tokens, samples, output_tokens } => {
                // Ids of the reference model's vocabulary (2,048), past its special tokens.
                for (group, (t, stage)) in arrivals.into_iter().enumerate() {
                    let ids: Arc<[u32]> = (0..*prompt_tokens).map(|_| 3 + (g.rng.next_u64() % 2045) as u32).collect();
                    for _ in 0..*samples {
                        let mut p = one_turn(plan.len(), t, stage, Arc::from(""), Arc::from(""), *output_tokens);
                        p.prompt_ids = Some(ids.clone());
                        p.group = group;
                        plan.push(p);
                    }
                }
            }
        }
        Ok(plan)
    }
}

impl Scenario {
    /// At least `sessions` sessions for a closed-loop run, which takes them in order and ignores
    /// their start times: this scenario's plan with its ladder stretched (the same seed, so the
    /// same shared prompts), doubled until it is long enough.
    pub fn closed_plan(&self, words_per_token: f64, sessions: usize) -> anyhow::Result<Vec<SessionPlan>> {
        let mut stretch = 1.0;
        loop {
            let mut sc = self.clone();
            let longer = |s: &str| -> anyhow::Result<String> {
                Ok(parse_stages(s)?
                    .iter()
                    .map(|st| format!("{}:{}", st.rate, st.seconds * stretch))
                    .collect::<Vec<_>>()
                    .join(","))
            };
            sc.arrivals.ladder = longer(&self.arrivals.ladder)?;
            let plan = sc.plan(words_per_token)?;
            anyhow::ensure!(!plan.is_empty(), "scenario {} plans no sessions", self.name);
            if plan.len() >= sessions || stretch >= 1024.0 {
                return Ok(plan);
            }
            stretch *= 2.0;
        }
    }
}

fn one_turn(id: usize, t: f64, stage: usize, system: Arc<str>, user: Arc<str>, max_tokens: u64) -> SessionPlan {
    SessionPlan {
        start_s: t,
        stage,
        id,
        system,
        users: vec![user],
        pauses_s: vec![0.0],
        max_tokens,
        session_header: false,
        prompt_ids: None,
        group: id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(workload: &str, arrivals: &str) -> Scenario {
        serde_json::from_str(&format!(
            r#"{{"name": "t", "description": "d", "pool": {{"engines": 2, "time_scale": 1.0}},
                "workload": {workload}, "arrivals": {arrivals}, "seed": 3}}"#
        ))
        .unwrap()
    }

    #[test]
    fn bursts_put_their_share_of_arrivals_in_the_on_window() {
        let s = scenario(
            r#"{"kind": "unique", "prompt_tokens": 10, "output_tokens": 1}"#,
            r#"{"ladder": "20:1000", "burst": {"period_s": 10, "on_s": 2, "on_share": 0.8}}"#,
        );
        let a = s.arrivals().unwrap();
        let n = a.len() as f64;
        assert!((n - 20_000.0).abs() < 600.0, "mean rate kept: {n}");
        let on = a.iter().filter(|(t, _)| t % 10.0 < 2.0).count() as f64;
        assert!((on / n - 0.8).abs() < 0.02, "on share {}", on / n);
    }

    #[test]
    fn every_system_gets_the_same_plan_and_sessions_grow() {
        let s = scenario(
            r#"{"kind": "agentic", "preamble_tokens": 50, "context_tokens": 20, "turns": 3, "turn_tokens": 10,
                "output_tokens": 5, "pause_s": [1, 2]}"#,
            r#"{"warmup": "1:10", "ladder": "2:10,4:10", "interval_s": 5}"#,
        );
        let a = s.plan(1.0).unwrap();
        let b = s.plan(1.0).unwrap();
        assert_eq!(a.len(), b.len());
        assert!(a.iter().zip(&b).all(|(x, y)| x.system == y.system && x.users == y.users && x.start_s == y.start_s));
        assert!(a.iter().all(|p| p.users.len() == 3 && p.pauses_s.iter().all(|d| (1.0..=2.0).contains(d))));
        // Sessions share the tool preamble, not their repository context.
        let pre = |p: &SessionPlan| p.system.split('\n').next().map(str::to_owned);
        assert!(a.iter().all(|p| pre(p) == pre(&a[0])));
        assert_ne!(a[0].system, a[1].system);
        assert!(a.iter().any(|p| p.stage == 2) && a.iter().any(|p| p.stage == 0));
    }

    #[test]
    fn shared_prefix_cycles_one_shuffled_prompt_set() {
        let s = scenario(
            r#"{"kind": "shared_prefix", "groups": 3, "per_group": 2, "system_tokens": 30, "question_tokens": 5,
                "output_tokens": 1}"#,
            r#"{"ladder": "50:1"}"#,
        );
        let p = s.plan(1.0).unwrap();
        assert!(p.len() > 12);
        let systems: std::collections::HashSet<&str> = p.iter().map(|x| &*x.system).collect();
        assert_eq!(systems.len(), 3);
        assert!(p.iter().zip(p.iter().skip(6)).all(|(x, y)| x.users == y.users), "cycled every 6");
    }

    #[test]
    fn rollout_groups_share_one_prompt_and_start_together() {
        let s = scenario(
            r#"{"kind": "rollouts", "prompt_tokens": 64, "samples": 4, "output_tokens": 8}"#,
            r#"{"ladder": "5:10"}"#,
        );
        let p = s.plan(1.0).unwrap();
        assert!(p.len() >= 4 * 20 && p.len().is_multiple_of(4));
        for g in p.chunks(4) {
            assert!(g
                .iter()
                .all(|x| x.group == g[0].group && x.start_s == g[0].start_s && x.prompt_ids == g[0].prompt_ids));
            assert!(g[0]
                .prompt_ids
                .as_ref()
                .is_some_and(|ids| ids.len() == 64 && ids.iter().all(|&t| (3..2048).contains(&t))));
        }
        assert_ne!(p[0].prompt_ids, p[4].prompt_ids, "groups differ");
    }

    #[test]
    fn closed_loop_parses_concurrency_and_seconds_and_refuses_nonsense() {
        assert_eq!("32:60".parse::<ClosedLoop>(), Ok(ClosedLoop { concurrency: 32, seconds: 60.0 }));
        assert!("0:60".parse::<ClosedLoop>().is_err());
        assert!("8:-1".parse::<ClosedLoop>().is_err());
        assert!("8".parse::<ClosedLoop>().is_err());
    }

    #[test]
    fn shipped_scenarios_parse() {
        let dir = attache_fixtures::repo_root().join("bench/scenarios");
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let s = Scenario::load(&e.unwrap().path()).unwrap();
            assert!(!s.plan(1.0).unwrap().is_empty(), "{}", s.name);
            n += 1;
        }
        assert!(n >= 4);
    }
}
