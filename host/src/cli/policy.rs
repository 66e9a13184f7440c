//! `attache policy`: signing keys and signatures, the admin API's upload, rollout, shadow and
//! decision-log operations, and offline replay of a decision log.

use std::path::PathBuf;

use anyhow::Context;
use attache_host::policy::{decisions, replay, signing};
use clap::Subcommand;

#[derive(Subcommand)]
pub enum PolicyCmd {
    /// Write a new Ed25519 signing key pair: DIR/attache.key (private, mode 0600) and
    /// DIR/attache.pub.
    Keygen {
        #[arg(long)]
        out: PathBuf,
    },
    /// Sign a Wasm module (WebAssembly tool-conventions signature section, as wasmsign2).
    Sign {
        #[arg(long)]
        key: PathBuf,
        #[arg(long = "in")]
        input: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    /// Verify a signed module against a public key (or a directory of `*.pub` keys); exits 0
    /// only on a valid signature by that key.
    Verify {
        #[arg(long)]
        pubkey: PathBuf,
        #[arg(long = "in")]
        input: PathBuf,
    },
    /// Upload a signed scorer module for a slot (verified and admitted by the host).
    Upload {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        slot: String,
        /// Version label, e.g. v3 or a git sha.
        #[arg(long)]
        version: String,
        #[arg(long = "in")]
        input: PathBuf,
        /// The module's configuration (JSON, or @file), checked by admission: a scorer's own
        /// params, or for the `scheduler` slot the scheduler's whole configuration.
        #[arg(long)]
        params: Option<String>,
    },
    /// Record a configuration-only version: a stored module (`--from`, a version or sha256)
    /// with new params, admitted under them. Roll it out like any version; no module moves.
    Configure {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        slot: String,
        /// The new version's label.
        #[arg(long)]
        version: String,
        /// The stored version (or sha256) whose module it runs.
        #[arg(long)]
        from: String,
        /// The configuration (JSON, or @file): for the `scheduler` slot the scheduler's whole
        /// configuration, for a scorer its params.
        #[arg(long)]
        params: String,
    },
    /// List uploaded modules.
    List {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        slot: Option<String>,
    },
    /// Start a canary: the module (sha256 or version) acts on `--canary` percent of sessions.
    Rollout {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        slot: String,
        #[arg(long)]
        module: String,
        /// e.g. 5% or 5
        #[arg(long, default_value = "5%")]
        canary: String,
        /// Weight the picker gives the scorer's 0..1 scores.
        #[arg(long, default_value_t = 1.0)]
        weight: f64,
    },
    /// Run a module (sha256 or version) in shadow: it scores every request beside the live
    /// version and acts on none; `status` reports how often it agrees. `rollback` ends it.
    Shadow {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        slot: String,
        #[arg(long)]
        module: String,
        /// Weight the picker would give its 0..1 scores.
        #[arg(long, default_value_t = 1.0)]
        weight: f64,
    },
    /// Make the slot's canary its stable version.
    Promote(SlotAction),
    /// Drop the slot's canary or shadow (or, without either, return to the previous stable
    /// version; before the first, to the bootstrap's filter).
    Rollback(SlotAction),
    /// Versions, canary counters, controller verdicts, Envoy ACKs and transitions.
    Status {
        #[command(flatten)]
        server: Server,
    },
    /// Save the host's decision log (sampled decisions of the policy chain) to a file.
    Decisions {
        #[command(flatten)]
        server: Server,
        #[arg(long)]
        out: PathBuf,
    },
    /// Run a candidate scorer or filter module over a decision log, offline, in wasmtime: each
    /// decision made again with its scores in the slot. Prints the decisions it changes and a
    /// JSON summary (changed share, expected hit-rate delta, load imbalance).
    Replay {
        /// A decision log (`attache policy decisions --out`).
        #[arg(long)]
        log: PathBuf,
        /// The candidate module (signed or not: nothing is deployed).
        #[arg(long)]
        module: PathBuf,
        /// The slot whose recorded scores it replaces.
        #[arg(long)]
        slot: String,
        /// Its params (JSON, or @file).
        #[arg(long)]
        params: Option<String>,
        /// The weight of its scores (default: the slot's recorded weight, else 1).
        #[arg(long)]
        weight: Option<f64>,
        /// Changed decisions to print (the summary counts them all).
        #[arg(long, default_value_t = 20)]
        show: usize,
        /// Only decisions made at or after this time (ms since the Unix epoch).
        #[arg(long, default_value_t = 0)]
        since_ms: u64,
    },
}

#[derive(clap::Args)]
pub struct SlotAction {
    #[command(flatten)]
    server: Server,
    #[arg(long)]
    slot: String,
    /// Recorded in the transition log.
    #[arg(long, default_value = "")]
    reason: String,
}

#[derive(clap::Args)]
pub struct Server {
    /// The host's admin address.
    #[arg(long, default_value = "http://127.0.0.1:9190")]
    server: String,
    /// Bearer token (default: $ATTACHE_ADMIN_TOKEN).
    #[arg(long, env = "ATTACHE_ADMIN_TOKEN", hide_env_values = true)]
    token: String,
}

impl Server {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.server.trim_end_matches('/'))
    }
}

/// `attache policy decisions`: the host's decision log, saved as it is stored.
async fn save_decisions(server: &Server, out: &std::path::Path) -> anyhow::Result<()> {
    let resp = reqwest::Client::new()
        .get(server.url("/v1/policy/decisions"))
        .bearer_auth(&server.token)
        .send()
        .await
        .with_context(|| format!("contacting {}", server.server))?;
    let status = resp.status();
    let bytes = resp.bytes().await?;
    if !status.is_success() {
        anyhow::bail!("{status}: {}", String::from_utf8_lossy(&bytes));
    }
    let (records, torn) = decisions::parse(&bytes);
    std::fs::write(out, &bytes).with_context(|| format!("writing {}", out.display()))?;
    let note = if torn { " (the last one torn)" } else { "" };
    println!("{}: {} decisions{note}", out.display(), records.len());
    Ok(())
}

/// `attache policy replay`: print the changed decisions (up to `show`) and the summary.
fn replay_log(
    log: &std::path::Path,
    module: &std::path::Path,
    (slot, weight, since_ms): (String, Option<f64>, u64),
    params: Option<String>,
    show: usize,
) -> anyhow::Result<()> {
    let read = |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let bytes = read(log)?;
    let (logged, torn) = decisions::parse(&bytes);
    if torn {
        eprintln!("{}: the last record is torn; replaying the {} before it", log.display(), logged.len());
    }
    let mut records = Vec::with_capacity(logged.len());
    for (i, d) in logged.iter().enumerate().filter(|(_, d)| d.at_unix_ms >= since_ms) {
        match decisions::recorded(d) {
            Ok(r) => records.push(r),
            Err(e) => eprintln!("record {i} skipped: {e}"),
        }
    }
    anyhow::ensure!(!records.is_empty(), "{}: no decisions to replay", log.display());
    let params = match params {
        Some(p) => serde_json::from_str(&inline(&p)?).context("--params is not JSON")?,
        None => serde_json::Value::Null,
    };
    let opts = replay::ReplayOptions { slot, params, weight };
    let (replays, summary) = replay::run(&read(module)?, &records, &opts)?;
    for (i, (r, d)) in records.iter().zip(&replays).enumerate().filter(|(_, (_, d))| d.changed()).take(show) {
        println!("{}", replay::describe(i, r, d));
    }
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(())
}

/// A `--params` value: JSON as given, or `@file` for the file's contents.
fn inline(value: &str) -> anyhow::Result<String> {
    match value.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("--params @{path}")),
        None => Ok(value.to_owned()),
    }
}

/// Send an admin API request; print the JSON answer; fail with the API's message.
async fn api(server: &Server, req: reqwest::RequestBuilder) -> anyhow::Result<()> {
    let resp = req.bearer_auth(&server.token).send().await.with_context(|| format!("contacting {}", server.server))?;
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.unwrap_or(serde_json::Value::Null);
    if !status.is_success() {
        anyhow::bail!(
            "{} ({}): {}",
            status,
            body["error"].as_str().unwrap_or("error"),
            body["message"].as_str().unwrap_or("no message")
        );
    }
    println!("{}", serde_json::to_string_pretty(&body)?);
    Ok(())
}

/// `promote` or `rollback` a slot.
async fn transition(a: &SlotAction, action: &str) -> anyhow::Result<()> {
    let req = reqwest::Client::new()
        .post(a.server.url(&format!("/v1/policy/slots/{}/{action}", a.slot)))
        .json(&serde_json::json!({"reason": a.reason}));
    api(&a.server, req).await
}

/// Run a `policy` subcommand.
pub async fn run(cmd: PolicyCmd) -> anyhow::Result<()> {
    let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));

    match cmd {
        PolicyCmd::Keygen { out } => {
            let (key, public, fp) = signing::keygen(&out)?;
            println!("wrote {} and {} (key {fp})", key.display(), public.display());
        }
        PolicyCmd::Sign { key, input, out } => {
            let signed = signing::sign(&read(&key)?, &read(&input)?)?;
            std::fs::write(&out, &signed).with_context(|| format!("writing {}", out.display()))?;
            println!("signed {} -> {} (sha256 {})", input.display(), out.display(), signing::sha256_hex(&signed));
        }
        PolicyCmd::Verify { pubkey, input } => {
            let store = signing::TrustStore::load(&pubkey)?;
            let v = store.verify(&read(&input)?).map_err(|e| anyhow::anyhow!("{}: {e}", input.display()))?;
            println!("{}: valid signature by {} (sha256 {})", input.display(), v.signers.join(", "), v.sha256);
        }
        PolicyCmd::Upload { server, slot, version, input, params } => {
            let mut query = vec![("slot", slot), ("version", version)];
            if let Some(p) = params {
                query.push(("params", inline(&p)?));
            }
            let req = reqwest::Client::new().post(server.url("/v1/policy/modules")).query(&query).body(read(&input)?);
            api(&server, req).await?;
        }
        PolicyCmd::Configure { server, slot, version, from, params } => {
            let params: serde_json::Value = serde_json::from_str(&inline(&params)?).context("--params is not JSON")?;
            let body = serde_json::json!({"version": version, "from": from, "params": params});
            let req = reqwest::Client::new().post(server.url(&format!("/v1/policy/slots/{slot}/configs"))).json(&body);
            api(&server, req).await?;
        }
        PolicyCmd::List { server, slot } => {
            let mut req = reqwest::Client::new().get(server.url("/v1/policy/modules"));
            if let Some(s) = slot {
                req = req.query(&[("slot", s)]);
            }
            api(&server, req).await?;
        }
        PolicyCmd::Rollout { server, slot, module, canary, weight } => {
            let percent: f64 = canary
                .trim()
                .trim_end_matches('%')
                .parse()
                .with_context(|| format!("--canary {canary:?}: expected a percentage like 5%"))?;
            let body = serde_json::json!({"module": module, "canary_percent": percent, "weight": weight});
            let req = reqwest::Client::new().post(server.url(&format!("/v1/policy/slots/{slot}/rollout"))).json(&body);
            api(&server, req).await?;
        }
        PolicyCmd::Shadow { server, slot, module, weight } => {
            let body = serde_json::json!({"module": module, "weight": weight});
            let req = reqwest::Client::new().post(server.url(&format!("/v1/policy/slots/{slot}/shadow"))).json(&body);
            api(&server, req).await?;
        }
        PolicyCmd::Promote(a) => transition(&a, "promote").await?,
        PolicyCmd::Rollback(a) => transition(&a, "rollback").await?,
        PolicyCmd::Status { server } => {
            api(&server, reqwest::Client::new().get(server.url("/v1/policy/status"))).await?;
        }
        PolicyCmd::Decisions { server, out } => save_decisions(&server, &out).await?,
        PolicyCmd::Replay { log, module, slot, params, weight, show, since_ms } => {
            let opts = (slot, weight, since_ms);
            replay_log(&log, &module, opts, params, show)?;
        }
    }
    Ok(())
}
