//! `attache policy`: signing keys and signatures, and the admin API's upload and rollout
//! operations.

use std::path::PathBuf;

use anyhow::Context;
use attache_host::policy::signing;
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
        /// The scorer's own configuration (JSON), checked by admission.
        #[arg(long)]
        params: Option<String>,
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
    /// Make the slot's canary its stable version.
    Promote(SlotAction),
    /// Drop the slot's canary (or, without one, return to the previous stable version).
    Rollback(SlotAction),
    /// Versions, canary counters, controller verdicts, Envoy ACKs and transitions.
    Status {
        #[command(flatten)]
        server: Server,
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
                query.push(("params", p));
            }
            let req = reqwest::Client::new().post(server.url("/v1/policy/modules")).query(&query).body(read(&input)?);
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
        PolicyCmd::Promote(a) => transition(&a, "promote").await?,
        PolicyCmd::Rollback(a) => transition(&a, "rollback").await?,
        PolicyCmd::Status { server } => {
            api(&server, reqwest::Client::new().get(server.url("/v1/policy/status"))).await?;
        }
    }
    Ok(())
}
