//! The decision log: sampled decisions of the policy chain, sent by the Envoys' pickers
//! (`SnapshotService/Share`), kept on disk for `attache policy replay` and for admission's
//! samples.
//!
//! Format: `<store_dir>/decisions.log`, a sequence of `attache.v1.Decision` messages, each
//! preceded by its length (protobuf varint, as `prost`'s length-delimited encoding). Bounded:
//! once the file passes half of `max_bytes` it becomes `decisions.log.1` (replacing the older
//! one) and a new file starts, so the two hold at most `max_bytes` and the newest records. A
//! record holds no prompt text (see `policies::replay`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use attache_policies::replay::Recorded;
use attache_policies::scoring::{ScoreSheet, ScoringContext};
use attache_proto::v1;
use prost::Message;
use tracing::warn;

/// Where decisions are kept, and how many bytes at most.
#[derive(Debug)]
pub struct DecisionLog {
    path: PathBuf,
    max_bytes: u64,
    /// Serializes appends and rotation.
    lock: Mutex<()>,
}

impl DecisionLog {
    pub fn open(dir: &Path, max_bytes: u64) -> Self {
        Self { path: dir.join("decisions.log"), max_bytes, lock: Mutex::new(()) }
    }

    fn older(&self) -> PathBuf {
        self.path.with_extension("log.1")
    }

    /// Append what an Envoy sent; the number kept. Off (`max_bytes` 0): none.
    pub fn append(&self, decisions: &[v1::Decision]) -> std::io::Result<usize> {
        if self.max_bytes == 0 || decisions.is_empty() {
            return Ok(0);
        }
        let mut buf = Vec::new();
        for d in decisions {
            d.encode_length_delimited(&mut buf).map_err(std::io::Error::other)?;
        }
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let size = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if size > 0 && size + buf.len() as u64 > self.max_bytes / 2 {
            std::fs::rename(&self.path, self.older())?;
        }
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&self.path)?;
        f.write_all(&buf)?;
        Ok(decisions.len())
    }

    /// The whole log, oldest first, as stored.
    pub fn bytes(&self) -> std::io::Result<Vec<u8>> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = std::fs::read(self.older()).unwrap_or_default();
        match std::fs::read(&self.path) {
            Ok(b) => out.extend(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(out)
    }

    /// The newest `n` decisions that decode (for admission's samples).
    pub fn recent(&self, n: usize) -> Vec<Recorded> {
        let bytes = match self.bytes() {
            Ok(b) => b,
            Err(e) => {
                warn!(error = %e, "reading the decision log");
                return Vec::new();
            }
        };
        let (all, _) = parse(&bytes);
        let skip = all.len().saturating_sub(n);
        all.into_iter().skip(skip).filter_map(|d| recorded(&d).ok()).collect()
    }
}

/// The decisions in a log's bytes, and whether it ended in a torn record (a partial write).
pub fn parse(mut bytes: &[u8]) -> (Vec<v1::Decision>, bool) {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        match v1::Decision::decode_length_delimited(&mut bytes) {
            Ok(d) => out.push(d),
            Err(_) => return (out, true),
        }
    }
    (out, false)
}

/// A logged decision, decoded for replay.
pub fn recorded(d: &v1::Decision) -> Result<Recorded, String> {
    let ctx = ScoringContext::decode(&d.context).map_err(|e| format!("context: {e}"))?;
    let sheet = if d.sheet.is_empty() {
        ScoreSheet::default()
    } else {
        ScoreSheet::decode(&d.sheet).map_err(|e| format!("score sheet: {e}"))?
    };
    let picked = d.picked as usize;
    if picked >= ctx.candidates.len() {
        return Err(format!("picked candidate {picked} of {}", ctx.candidates.len()));
    }
    Ok(Recorded {
        at_unix_ms: d.at_unix_ms,
        snapshot_version: d.snapshot_version,
        ctx,
        tiers: d.tiers.clone(),
        sheet,
        picked,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use attache_policies::scoring::Candidate;

    fn decision(n: u64) -> v1::Decision {
        let ctx = ScoringContext {
            bucket: 1,
            seed: n,
            max_endpoints: 1,
            model: "m".into(),
            prompt_tokens: 10,
            max_tokens: 1,
            stream: false,
            candidates: vec![Candidate { address: "10.0.0.1:8000".into(), ..Candidate::default() }],
        };
        v1::Decision { at_unix_ms: n, snapshot_version: 3, context: ctx.encode(), picked: 0, ..Default::default() }
    }

    #[test]
    fn the_log_keeps_the_newest_records_within_its_bound_and_a_torn_tail_is_told() {
        let dir = std::env::temp_dir().join(format!("attache-decisions-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let one = decision(0).encode_length_delimited_to_vec().len() as u64;
        let log = DecisionLog::open(&dir, one * 20);
        for n in 0..50 {
            assert_eq!(log.append(&[decision(n)]).unwrap(), 1);
        }
        let bytes = log.bytes().unwrap();
        assert!(bytes.len() as u64 <= one * 20, "{} bytes", bytes.len());
        let (all, torn) = parse(&bytes);
        assert!(!torn);
        let at: Vec<u64> = all.iter().map(|d| d.at_unix_ms).collect();
        assert_eq!(*at.last().unwrap(), 49, "the newest is kept");
        assert!(at.windows(2).all(|w| w[0] < w[1]), "oldest first: {at:?}");
        let recent = log.recent(3);
        assert_eq!(recent.iter().map(|r| r.at_unix_ms).collect::<Vec<_>>(), vec![47, 48, 49]);
        assert_eq!(recent[0].ctx.candidates.len(), 1);
        // A partial record at the end is reported, and what came before is kept.
        let (some, torn) = parse(&bytes[..bytes.len() - 3]);
        assert!(torn && some.len() == all.len() - 1);
        // A picked index outside the candidates does not decode.
        assert!(recorded(&v1::Decision { picked: 5, ..decision(1) }).unwrap_err().contains("picked candidate 5"));
        // Off: nothing is kept.
        let off = DecisionLog::open(&dir.join("x"), 0);
        assert_eq!(off.append(&[decision(1)]).unwrap(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
