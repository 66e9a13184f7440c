//! Policy-module signatures: the WebAssembly tool-conventions format (`wasmsign2`, Ed25519), a
//! `signature` custom section first in the module over the SHA-256 of every following section.
//!
//! The host is the only publisher of modules to Envoy, so it verifies every module against its
//! trust store before anything else looks at it, and says precisely why a module is refused:
//! not signed at all, changed after signing, or signed by no trusted key.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmsign2::{KeyPair, Module, PublicKey, PublicKeySet, SecretKey, Section, WSError};

/// Why a module's signature is refused. Each case has its own message, for operators.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignatureError {
    #[error(
        "module is not signed: it has no tool-conventions `signature` section (sign it with `attache policy sign`)"
    )]
    Unsigned,
    #[error("module was modified after it was signed: its content hash {actual} is not the signed one")]
    Tampered { actual: String },
    #[error("module is signed, but by no key in the trust store ({trusted} trusted key(s))")]
    UntrustedKey { trusted: usize },
    #[error("module is not a valid WebAssembly binary or its signature section is malformed: {0}")]
    Malformed(String),
}

/// A module that passed verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// SHA-256 of the whole signed module, as Envoy pins it.
    pub sha256: String,
    /// Fingerprints (first 8 bytes of SHA-256 of the public key, hex) of the trusted keys that
    /// signed it.
    pub signers: Vec<String>,
}

/// Public keys whose signatures the host accepts.
#[derive(Debug)]
pub struct TrustStore {
    keys: PublicKeySet,
}

impl Default for TrustStore {
    fn default() -> Self {
        Self::empty()
    }
}

/// Hex SHA-256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Short, stable name of a public key.
pub fn fingerprint(pk: &PublicKey) -> String {
    hex(&Sha256::digest(pk.to_bytes())[..8])
}

impl TrustStore {
    pub fn empty() -> Self {
        Self { keys: PublicKeySet::empty() }
    }

    /// Load public keys from a file, or from every `*.pub` file of a directory. Raw, PEM, DER
    /// and OpenSSH Ed25519 keys are accepted.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let mut me = Self::empty();
        let files: Vec<PathBuf> = if path.is_dir() {
            let mut v: Vec<PathBuf> = std::fs::read_dir(path)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "pub"))
                .collect();
            v.sort();
            v
        } else {
            vec![path.to_path_buf()]
        };
        for f in files {
            let bytes = std::fs::read(&f).map_err(|e| anyhow::anyhow!("reading {}: {e}", f.display()))?;
            me.add(&bytes).map_err(|e| anyhow::anyhow!("{}: not an Ed25519 public key: {e}", f.display()))?;
        }
        Ok(me)
    }

    /// Trust one more key (any encoding `wasmsign2` reads).
    pub fn add(&mut self, key: &[u8]) -> Result<String, WSError> {
        let pk = PublicKey::from_any(key)?;
        let fp = fingerprint(&pk);
        self.keys.insert(pk)?;
        Ok(fp)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Verify `module` (the signed bytes).
    pub fn verify(&self, module: &[u8]) -> Result<Verified, SignatureError> {
        match self.keys.verify(&mut std::io::Cursor::new(module), None) {
            Ok(signers) => {
                let mut signers: Vec<String> = signers.into_iter().map(fingerprint).collect();
                signers.sort();
                Ok(Verified { sha256: sha256_hex(module), signers })
            }
            Err(WSError::NoSignatures) => Err(SignatureError::Unsigned),
            Err(WSError::VerificationFailed) | Err(WSError::VerificationFailedForPredicates) => {
                Err(self.classify_failure(module))
            }
            Err(e) => Err(SignatureError::Malformed(e.to_string())),
        }
    }

    /// A signature that no trusted key validates: either the content changed after signing
    /// (its hash is not among the signed hashes) or the signer is not trusted.
    fn classify_failure(&self, module: &[u8]) -> SignatureError {
        let parsed = match Module::deserialize(&mut std::io::Cursor::new(module)) {
            Ok(m) => m,
            Err(e) => return SignatureError::Malformed(e.to_string()),
        };
        let mut sections = parsed.sections.iter();
        let header = match sections.next() {
            Some(s @ Section::Custom(c)) if c.is_signature_header() => s,
            _ => return SignatureError::Unsigned,
        };
        let Section::Custom(header) = header else { return SignatureError::Unsigned };
        let data = match header.signature_data() {
            Ok(d) => d,
            Err(e) => return SignatureError::Malformed(e.to_string()),
        };
        let mut hasher = Sha256::new();
        for s in sections {
            let mut buf = Vec::new();
            if let Err(e) = s.serialize(&mut buf) {
                return SignatureError::Malformed(e.to_string());
            }
            hasher.update(&buf);
        }
        let actual = hasher.finalize().to_vec();
        let signed = data.signed_hashes_set.iter().any(|set| set.hashes.contains(&actual));
        if signed {
            SignatureError::UntrustedKey { trusted: self.len() }
        } else {
            SignatureError::Tampered { actual: hex(&actual) }
        }
    }
}

/// `attache policy keygen`: a new Ed25519 key pair as `DIR/attache.key` and `DIR/attache.pub`.
pub fn keygen(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf, String)> {
    std::fs::create_dir_all(dir)?;
    let kp = KeyPair::generate();
    let (key, public) = (dir.join("attache.key"), dir.join("attache.pub"));
    if key.exists() {
        anyhow::bail!("{} exists; refusing to overwrite a signing key", key.display());
    }
    write_private(&key, &kp.sk.to_bytes())?;
    std::fs::write(&public, kp.pk.to_bytes())?;
    Ok((key, public, fingerprint(&kp.pk)))
}

#[cfg(unix)]
fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(bytes)?;
    Ok(())
}

#[cfg(not(unix))]
fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(path, bytes)?;
    Ok(())
}

/// `attache policy sign`: embed a signature by `key` into `module` (any earlier signature is
/// replaced). Returns the signed bytes.
pub fn sign(key: &[u8], module: &[u8]) -> anyhow::Result<Vec<u8>> {
    let sk = SecretKey::from_any(key).map_err(|e| anyhow::anyhow!("not an Ed25519 secret key: {e}"))?;
    let m = Module::deserialize(&mut std::io::Cursor::new(module))
        .map_err(|e| anyhow::anyhow!("not a WebAssembly module: {e}"))?;
    let signed = sk.sign(m, None).map_err(|e| anyhow::anyhow!("signing failed: {e}"))?;
    let mut out = Vec::with_capacity(module.len() + 256);
    signed.serialize(&mut out).map_err(|e| anyhow::anyhow!("writing the signed module: {e}"))?;
    Ok(out)
}

/// A trust store holding exactly the given public keys.
pub fn trust(keys: &[&[u8]]) -> Result<TrustStore, WSError> {
    let mut t = TrustStore::empty();
    for k in keys {
        t.add(k)?;
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The smallest valid module: one exported empty function `f` (`() -> ()`).
    fn module() -> Vec<u8> {
        include_bytes!("../../tests/fixtures/minimal.wasm").to_vec()
    }

    #[test]
    fn signed_module_verifies_and_each_failure_is_distinct() {
        let kp = KeyPair::generate();
        let other = KeyPair::generate();
        let store = trust(&[&kp.pk.to_bytes()]).unwrap();
        let signed = sign(&kp.sk.to_bytes(), &module()).unwrap();

        let ok = store.verify(&signed).unwrap();
        assert_eq!(ok.sha256, sha256_hex(&signed));
        assert_eq!(ok.signers, vec![fingerprint(&kp.pk)]);

        assert_eq!(store.verify(&module()), Err(SignatureError::Unsigned));

        let by_other = sign(&other.sk.to_bytes(), &module()).unwrap();
        assert_eq!(store.verify(&by_other), Err(SignatureError::UntrustedKey { trusted: 1 }));

        // Flip one byte of the function body's end marker region: same length, other content.
        let mut tampered = signed.clone();
        let last = tampered.len() - 2;
        tampered[last] = 0x01; // `nop` instead of nothing
        assert!(
            matches!(store.verify(&tampered), Err(SignatureError::Tampered { .. })),
            "{:?}",
            store.verify(&tampered)
        );

        assert!(matches!(store.verify(b"not wasm"), Err(SignatureError::Malformed(_))));
        // An empty trust store trusts nothing.
        assert_eq!(TrustStore::empty().verify(&signed), Err(SignatureError::UntrustedKey { trusted: 0 }));
    }

    #[test]
    fn keygen_writes_a_usable_pair_and_never_overwrites() {
        let dir = std::env::temp_dir().join(format!("attache-keygen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (key, public, fp) = keygen(&dir).unwrap();
        let store = TrustStore::load(&public).unwrap();
        assert_eq!(store.len(), 1);
        let signed = sign(&std::fs::read(&key).unwrap(), &module()).unwrap();
        assert_eq!(store.verify(&signed).unwrap().signers, vec![fp]);
        // A directory of .pub files is a trust store too.
        assert_eq!(TrustStore::load(&dir).unwrap().len(), 1);
        assert!(keygen(&dir).is_err(), "an existing key must not be overwritten");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
