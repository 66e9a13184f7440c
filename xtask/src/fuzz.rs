//! `cargo xtask fuzz [--seconds N] [TARGET...]`: the cargo-fuzz targets in `tests/fuzz`.
//!
//! Each target first replays its checked-in inputs (`corpus/<t>` seeds and
//! `regressions/<t>`: every crash ever found), then fuzzes for N seconds (default 600). New
//! corpus entries go to a scratch directory under the target dir, not into the repository;
//! a crash is written to `tests/fuzz/regressions/<t>/` so that it is replayed from then on.
//! `cargo xtask test` runs every target for a short bounded time.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

pub const TARGETS: &[&str] = &["request_parse", "snapshot_decode", "kv_event_decode", "prom_parse", "signature_verify"];

/// Build once, then replay and fuzz each target.
pub fn fuzz(root: &Path, args: &[String]) -> Result<()> {
    let mut seconds = 600u64;
    let mut targets: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => seconds = it.next().context("--seconds needs a value")?.parse().context("--seconds")?,
            t if TARGETS.contains(&t) => targets.push(t.to_string()),
            other => bail!("unknown fuzz argument {other:?}; targets: {}", TARGETS.join(", ")),
        }
    }
    if targets.is_empty() {
        targets = TARGETS.iter().map(|t| t.to_string()).collect();
    }
    ensure_cargo_fuzz()?;
    let target_dir = target_dir();
    crate::run(cargo_fuzz(root, &target_dir).args(["build", "--fuzz-dir", "tests/fuzz", "--sanitizer", "none"]))?;
    let mut summary = Vec::new();
    for t in &targets {
        let fuzz_dir = root.join("tests/fuzz");
        let regressions = fuzz_dir.join("regressions").join(t);
        std::fs::create_dir_all(&regressions)?;
        let scratch = target_dir.join("fuzz-corpus").join(t);
        std::fs::create_dir_all(&scratch)?;
        let started = std::time::Instant::now();
        // libFuzzer: the first directory receives new inputs; the others are read only.
        crate::run(
            cargo_fuzz(root, &target_dir)
                .args(["run", "--fuzz-dir", "tests/fuzz", "--sanitizer", "none", t])
                .arg(&scratch)
                .arg(fuzz_dir.join("corpus").join(t))
                .arg(&regressions)
                .arg("--")
                .arg(format!("-max_total_time={seconds}"))
                .arg(format!("-artifact_prefix={}/", regressions.display()))
                .args(["-rss_limit_mb=2048", "-max_len=1048576", "-timeout=10", "-print_final_stats=1"]),
        )
        .with_context(|| format!("fuzz target {t} found a crash: see tests/fuzz/regressions/{t}/"))?;
        summary.push(format!("{t}: {:.0} s, no crash", started.elapsed().as_secs_f64()));
    }
    println!("\nxtask fuzz summary:\n{}", summary.join("\n"));
    Ok(())
}

fn target_dir() -> PathBuf {
    std::env::var_os("ATTACHE_FUZZ_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| ".".into())).join(".cache/attache/fuzz-target")
    })
}

fn cargo_fuzz(root: &Path, target_dir: &Path) -> Command {
    let mut c = Command::new("cargo");
    // The nightly toolchain's cargo, not the stable one that runs xtask.
    c.env_remove("CARGO").env_remove("RUSTC").env_remove("RUSTUP_TOOLCHAIN");
    c.arg("+nightly").arg("fuzz").current_dir(root).env("CARGO_TARGET_DIR", target_dir);
    c
}

fn ensure_cargo_fuzz() -> Result<()> {
    let nightly = Command::new("rustup").args(["toolchain", "list"]).output().context("rustup")?;
    if !String::from_utf8_lossy(&nightly.stdout).contains("nightly") {
        crate::run(Command::new("rustup").args(["toolchain", "install", "nightly", "--profile", "minimal"]))?;
    }
    let have = Command::new("cargo").env_remove("CARGO").args(["fuzz", "--version"]).output();
    if !have.is_ok_and(|o| o.status.success()) {
        crate::run(Command::new("cargo").env_remove("CARGO").args(["install", "--locked", "cargo-fuzz@0.13.2"]))?;
    }
    Ok(())
}
