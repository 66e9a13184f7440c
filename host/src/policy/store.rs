//! The module store: content-addressed policy modules with a version history per policy slot.
//!
//! A module enters the store only after its signature verifies against the trust store and it
//! passes admission; it is kept as `<dir>/modules/<sha256>.wasm` (the name Envoy pins) and each
//! upload appends a record to `<dir>/history.jsonl`. Nothing is ever overwritten: rolling back is
//! pointing a slot at an older digest.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::admission::{self, AdmissionConfig, AdmissionError};
use super::signing::{SignatureError, TrustStore};

/// One uploaded version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleRecord {
    /// The policy slot the module is for (an ECDS resource name, e.g. `attache.scorer.latency`).
    pub slot: String,
    /// Operator-given version label.
    pub version: String,
    /// Hex SHA-256 of the signed module bytes.
    pub sha256: String,
    /// Fingerprints of the trusted keys that signed it.
    pub signers: Vec<String>,
    pub size: usize,
    /// Seconds since the Unix epoch.
    pub uploaded_at: u64,
    /// The scorer's own configuration (`params`), admitted with the module.
    #[serde(default)]
    pub params: serde_json::Value,
}

/// Why an upload was refused. Nothing is stored in any of these cases.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("signature refused: {0}")]
    Signature(#[from] SignatureError),
    #[error("admission refused: {0}")]
    Admission(#[from] AdmissionError),
    #[error("invalid slot or version: {0}")]
    InvalidName(String),
    #[error("module store I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("the module store holds its limit of {max} modules; raise policy.max_modules or remove unused modules from {dir}")]
    StoreFull { max: usize, dir: String },
}

/// Distinct modules a store keeps unless configured otherwise.
pub const DEFAULT_MAX_MODULES: usize = 256;

/// The store on disk.
#[derive(Debug)]
pub struct ModuleStore {
    dir: PathBuf,
    max_modules: usize,
}

fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

impl ModuleStore {
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir.join("modules"))?;
        Ok(Self { dir: dir.to_path_buf(), max_modules: DEFAULT_MAX_MODULES })
    }

    /// Keep at most `max` distinct modules.
    pub fn with_max_modules(mut self, max: usize) -> Self {
        self.max_modules = max;
        self
    }

    /// Distinct modules stored.
    pub fn module_count(&self) -> std::io::Result<usize> {
        Ok(std::fs::read_dir(self.dir.join("modules"))?
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "wasm"))
            .count())
    }

    /// Path of a stored module.
    pub fn module_path(&self, sha256: &str) -> PathBuf {
        self.dir.join("modules").join(format!("{sha256}.wasm"))
    }

    /// Verify, admit and store `bytes` as `version` of `slot`.
    pub fn upload(
        &self,
        trust: &TrustStore,
        admission: &AdmissionConfig,
        slot: &str,
        version: &str,
        params: &serde_json::Value,
        bytes: &[u8],
    ) -> Result<ModuleRecord, UploadError> {
        if !valid_name(slot) || !valid_name(version) {
            return Err(UploadError::InvalidName(format!("{slot:?} / {version:?}: use [A-Za-z0-9._-], 1-128 chars")));
        }
        let verified = trust.verify(bytes)?;
        admission::admit(bytes, admission)?;
        let path = self.module_path(&verified.sha256);
        if !path.exists() && self.module_count()? >= self.max_modules {
            return Err(UploadError::StoreFull {
                max: self.max_modules,
                dir: self.dir.join("modules").display().to_string(),
            });
        }
        if !path.exists() {
            // Write then rename: a reader never sees a partial module.
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, &path)?;
        }
        let record = ModuleRecord {
            slot: slot.into(),
            version: version.into(),
            sha256: verified.sha256,
            signers: verified.signers,
            size: bytes.len(),
            params: params.clone(),
            uploaded_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("history.jsonl"))?;
        writeln!(f, "{}", serde_json::to_string(&record).map_err(std::io::Error::other)?)?;
        Ok(record)
    }

    /// Take a module version uploaded through another host replica (policy state in
    /// Kubernetes): its signature is verified again and must give the recorded digest; the
    /// uploading replica admitted it under the same configuration.
    pub fn import(&self, trust: &TrustStore, record: &ModuleRecord, bytes: &[u8]) -> Result<(), UploadError> {
        if !valid_name(&record.slot) || !valid_name(&record.version) {
            return Err(UploadError::InvalidName(format!("{:?} / {:?}", record.slot, record.version)));
        }
        let verified = trust.verify(bytes)?;
        if verified.sha256 != record.sha256 {
            return Err(UploadError::Signature(SignatureError::Malformed(format!(
                "the shared module's digest is {}, its record says {}",
                verified.sha256, record.sha256
            ))));
        }
        let path = self.module_path(&verified.sha256);
        if !path.exists() {
            if self.module_count()? >= self.max_modules {
                return Err(UploadError::StoreFull {
                    max: self.max_modules,
                    dir: self.dir.join("modules").display().to_string(),
                });
            }
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, &path)?;
        }
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("history.jsonl"))?;
        writeln!(f, "{}", serde_json::to_string(record).map_err(std::io::Error::other)?)?;
        Ok(())
    }

    /// Every upload, oldest first (optionally for one slot).
    pub fn history(&self, slot: Option<&str>) -> std::io::Result<Vec<ModuleRecord>> {
        let text = match std::fs::read_to_string(self.dir.join("history.jsonl")) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str::<ModuleRecord>(l).ok())
            .filter(|r| slot.is_none_or(|s| r.slot == s))
            .collect())
    }

    /// The stored bytes of a digest, checked against it.
    pub fn load(&self, sha256: &str) -> std::io::Result<Vec<u8>> {
        let bytes = std::fs::read(self.module_path(sha256))?;
        if super::signing::sha256_hex(&bytes) != sha256 {
            return Err(std::io::Error::other(format!("stored module {sha256} is corrupt")));
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::policy::admission::tests::filter;

    #[test]
    fn a_full_store_refuses_new_modules_and_keeps_serving_stored_ones() {
        let dir = std::env::temp_dir().join(format!("attache-store-full-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = ModuleStore::open(&dir).unwrap().with_max_modules(1);
        let kp = wasmsign2::KeyPair::generate();
        let trust = super::super::signing::trust(&[&kp.pk.to_bytes()]).unwrap();
        let sign = |m: &[u8]| super::super::signing::sign(&kp.sk.to_bytes(), m).unwrap();
        let adm = AdmissionConfig::default();
        let (a, b) = (sign(&filter("(i32.const 0)")), sign(&filter("(i32.const 1)")));
        assert_ne!(a, b);
        let null = serde_json::Value::Null;
        let first = store.upload(&trust, &adm, "attache.scorer.demo", "v1", &null, &a).unwrap();
        let err = store.upload(&trust, &adm, "attache.scorer.demo", "v2", &null, &b).unwrap_err();
        assert!(matches!(err, UploadError::StoreFull { max: 1, .. }), "{err}");
        assert!(err.to_string().contains("policy.max_modules"), "{err}");
        // The same module again is not a new one.
        store.upload(&trust, &adm, "attache.scorer.demo", "v1-again", &null, &a).unwrap();
        assert_eq!(store.module_count().unwrap(), 1);
        assert_eq!(store.load(&first.sha256).unwrap(), a);
        assert_eq!(store.history(None).unwrap().len(), 2, "the refused upload left no record");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn uploads_are_verified_admitted_content_addressed_and_kept() {
        let dir = std::env::temp_dir().join(format!("attache-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = ModuleStore::open(&dir).unwrap();
        let kp = wasmsign2::KeyPair::generate();
        let trust = super::super::signing::trust(&[&kp.pk.to_bytes()]).unwrap();
        let module = filter("(i32.const 0)");
        let signed = super::super::signing::sign(&kp.sk.to_bytes(), &module).unwrap();
        let adm = AdmissionConfig::default();

        let r1 = store.upload(&trust, &adm, "attache.scorer.demo", "v1", &serde_json::Value::Null, &signed).unwrap();
        assert_eq!(store.load(&r1.sha256).unwrap(), signed);
        let r2 =
            store.upload(&trust, &adm, "attache.scorer.demo", "v1-again", &serde_json::Value::Null, &signed).unwrap();
        assert_eq!(r1.sha256, r2.sha256, "same bytes, same address");
        assert_eq!(store.history(Some("attache.scorer.demo")).unwrap().len(), 2);
        assert!(store.history(Some("other")).unwrap().is_empty());

        // Refusals store nothing.
        assert!(matches!(
            store.upload(&trust, &adm, "attache.scorer.demo", "v2", &serde_json::Value::Null, &module),
            Err(UploadError::Signature(SignatureError::Unsigned))
        ));
        let trapping = filter("(unreachable)");
        let signed_trap = super::super::signing::sign(&kp.sk.to_bytes(), &trapping).unwrap();
        assert!(matches!(
            store.upload(&trust, &adm, "attache.scorer.demo", "v3", &serde_json::Value::Null, &signed_trap),
            Err(UploadError::Admission(AdmissionError::Trap { .. }))
        ));
        assert!(matches!(
            store.upload(&trust, &adm, "../escape", "v4", &serde_json::Value::Null, &signed),
            Err(UploadError::InvalidName(_))
        ));
        assert_eq!(store.history(None).unwrap().len(), 2);
        let stored = std::fs::read_dir(dir.join("modules")).unwrap().count();
        assert_eq!(stored, 1, "refused modules must not be stored");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
