//! The Helm chart (`charts/attache`) rendered by the real helm (installed under `.tools/helm`
//! by `cargo xtask test`), and the Kubernetes documents it renders.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// `helm template` on `charts/attache`.
#[derive(Debug, Clone)]
pub struct Helm {
    pub bin: PathBuf,
    pub chart: PathBuf,
}

impl Helm {
    /// The helm under `<root>/.tools/helm`, and the chart beside it.
    pub fn new(root: &Path) -> Self {
        Self { bin: root.join(".tools/helm/helm"), chart: root.join("charts/attache") }
    }

    /// `helm template <release> --namespace <namespace>` with a values file and `--set`s;
    /// Ok(rendered) or Err(helm's standard error).
    pub fn template(
        &self,
        release: &str,
        namespace: &str,
        values: Option<&Path>,
        sets: &[&str],
    ) -> Result<String, String> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(["template", release, "--namespace", namespace]).arg(&self.chart);
        if let Some(v) = values {
            cmd.arg("--values").arg(v);
        }
        for s in sets {
            cmd.args(["--set", s]);
        }
        match cmd.output() {
            Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
            Ok(out) => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
            Err(e) => Err(format!("running {}: {e}", self.bin.display())),
        }
    }
}

/// The documents of a rendering (empty ones left out).
pub fn documents(rendered: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(rendered)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// The documents of one kind.
pub fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}
