//! Where the binaries are.

use std::path::{Path, PathBuf};

use anyhow::bail;

#[derive(Debug, Clone)]
pub struct Paths {
    pub root: PathBuf,
    pub target: PathBuf,
    pub host_bin: PathBuf,
    pub sim_bin: PathBuf,
    pub wasm: PathBuf,
    pub envoy: PathBuf,
}

impl Paths {
    /// A Wasm module built for wasm32-wasip1 next to the scheduler's (`attache_scorer_slo_ttft`).
    pub fn module(&self, crate_name: &str) -> PathBuf {
        self.wasm.with_file_name(format!("{crate_name}.wasm"))
    }
}

fn find_envoy(root: &Path) -> Option<PathBuf> {
    let lib = root.join(".venv/lib");
    for py in std::fs::read_dir(&lib).ok()?.flatten() {
        let p = py.path().join("site-packages/envoy/_bin/envoy");
        if p.exists() {
            return Some(p);
        }
    }
    None
}

impl Paths {
    /// Resolve paths from `ATTACHE_*` variables, else the workspace defaults. Errors name
    /// the command that builds what is missing.
    pub fn discover() -> anyhow::Result<Self> {
        let root = attache_fixtures::repo_root();
        // The binaries of the profile this program was built with (`target/<profile>/`): the
        // e2e tests run `ci` binaries, the demo and benchmarks `release` ones.
        let own_profile = std::env::current_exe().ok().and_then(|exe| {
            let dir = exe.parent()?;
            let dir = if dir.ends_with("deps") { dir.parent()? } else { dir };
            Some(dir.to_path_buf())
        });
        // The target folder: $CARGO_TARGET_DIR, else the one this program was built in (so a
        // binary run by hand finds its siblings), else the workspace's.
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .or_else(|| own_profile.as_ref().and_then(|d| d.parent()).map(PathBuf::from))
            .unwrap_or_else(|| root.join("target"));
        let target = if target.is_relative() { root.join(target) } else { target };
        let bin_dir = std::env::var_os("ATTACHE_BIN_DIR")
            .map(PathBuf::from)
            .or(own_profile)
            .unwrap_or_else(|| target.join("release"));
        let wasm = std::env::var_os("ATTACHE_WASM")
            .map(PathBuf::from)
            .unwrap_or_else(|| target.join("wasm32-wasip1/wasm/attache_scheduler_filter.wasm"));
        let envoy = std::env::var_os("ATTACHE_ENVOY").map(PathBuf::from).or_else(|| find_envoy(&root));
        let p = Paths {
            host_bin: bin_dir.join("attache"),
            sim_bin: bin_dir.join("attache-sim"),
            wasm,
            envoy: envoy.unwrap_or_else(|| root.join(".venv/lib/python3/site-packages/envoy/_bin/envoy")),
            root,
            target,
        };
        for (what, path) in
            [("host", &p.host_bin), ("simulator", &p.sim_bin), ("Wasm filter", &p.wasm), ("Envoy 1.40", &p.envoy)]
        {
            if !path.exists() {
                bail!("{what} not found at {}; run `cargo xtask build` (release: demo, benchmarks) or `cargo xtask e2e` (the ci profile) first", path.display());
            }
        }
        Ok(p)
    }
}
