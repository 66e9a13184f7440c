//! Decoding vLLM KV-cache events (`reference/engines.md` §2); SGLang publishes the same format.
//!
//! A ZMQ message is three frames: topic (UTF-8), sequence (8 bytes, big-endian), payload
//! (msgpack `[ts, events, data_parallel_rank]`, or a map with those keys). Events are tagged
//! arrays (vLLM ≤ 0.23: `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
//! medium, lora_name, …]`) or tagged maps (≥ 0.26: `{"type": "BlockStored", …}`). Block hashes
//! may be uint64, int64 or raw bytes (last 8 bytes, big-endian). Unknown event types and
//! unknown fields are skipped and counted; malformed input is an error, never a panic.

use thiserror::Error;

use crate::msgpack::{MsgpackError, Reader, Value};
pub use crate::tier::Medium;

/// Limits that keep a hostile publisher from making the host allocate without bound.
pub const MAX_PAYLOAD_BYTES: usize = 64 << 20;

#[derive(Debug, Error, PartialEq)]
pub enum KvEventError {
    #[error("expected 3 frames (topic, seq, payload), got {0}")]
    Frames(usize),
    #[error("sequence frame is {0} bytes, not 8")]
    Seq(usize),
    #[error("payload of {0} bytes is over the limit")]
    TooLarge(usize),
    #[error("msgpack: {0}")]
    Msgpack(#[from] MsgpackError),
    #[error("malformed batch: {0}")]
    Batch(&'static str),
}

#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_name: Option<String>,
        medium: Medium,
    },
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Medium,
    },
    AllBlocksCleared,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
    /// Events of unknown type that were skipped.
    pub skipped: usize,
}

/// One ZMQ message, split.
#[derive(Debug, Clone, PartialEq)]
pub struct Message<'a> {
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

/// Split the three frames of a published message.
pub fn split_frames<'a>(frames: &[&'a [u8]]) -> Result<Message<'a>, KvEventError> {
    let [topic, seq, payload] = frames else { return Err(KvEventError::Frames(frames.len())) };
    let seq: [u8; 8] = (*seq).try_into().map_err(|_| KvEventError::Seq(seq.len()))?;
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(KvEventError::TooLarge(payload.len()));
    }
    Ok(Message { topic, seq: u64::from_be_bytes(seq), payload })
}

fn hash(v: Value<'_>) -> Option<u64> {
    match v {
        Value::Uint(u) => Some(u),
        Value::Int(i) => Some(i as u64),
        Value::Bin(b) => {
            let tail = &b[b.len().saturating_sub(8)..];
            Some(tail.iter().fold(0u64, |acc, x| acc << 8 | u64::from(*x)))
        }
        _ => None,
    }
}

fn hashes(r: &mut Reader<'_>) -> Result<Vec<u64>, KvEventError> {
    let n = r.array()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(hash(r.value()?).ok_or(KvEventError::Batch("block hash is not an integer or bytes"))?);
    }
    Ok(out)
}

fn opt_hash(r: &mut Reader<'_>) -> Result<Option<u64>, KvEventError> {
    match r.value()? {
        Value::Nil => Ok(None),
        // Some publishers (old llm-d simulator) send 0 for "no parent".
        Value::Uint(0) => Ok(None),
        v => hash(v).map(Some).ok_or(KvEventError::Batch("parent_block_hash")),
    }
}

fn tokens(r: &mut Reader<'_>) -> Result<Vec<u32>, KvEventError> {
    let n = r.array()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        match r.value()? {
            Value::Uint(u) if u <= u64::from(u32::MAX) => out.push(u as u32),
            _ => return Err(KvEventError::Batch("token id is not a u32")),
        }
    }
    Ok(out)
}

fn opt_str(r: &mut Reader<'_>) -> Result<Option<String>, KvEventError> {
    match r.value()? {
        Value::Str(s) => Ok(Some(s.to_owned())),
        Value::Nil => Ok(None),
        Value::Array(n) => {
            (0..n).try_for_each(|_| r.skip())?;
            Ok(None)
        }
        Value::Map(n) => {
            (0..n * 2).try_for_each(|_| r.skip())?;
            Ok(None)
        }
        _ => Ok(None),
    }
}

fn uint(r: &mut Reader<'_>) -> Result<u64, KvEventError> {
    match r.value()? {
        Value::Uint(u) => Ok(u),
        Value::Int(i) if i >= 0 => Ok(i as u64),
        _ => Err(KvEventError::Batch("expected an unsigned integer")),
    }
}

#[derive(Default)]
struct Fields {
    kind: Option<String>,
    block_hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_name: Option<String>,
    medium: Option<String>,
}

fn field(r: &mut Reader<'_>, name: &str, f: &mut Fields) -> Result<(), KvEventError> {
    match name {
        "type" => f.kind = opt_str(r)?,
        "block_hashes" => f.block_hashes = Some(hashes(r)?),
        "parent_block_hash" => f.parent = opt_hash(r)?,
        "token_ids" => f.token_ids = Some(tokens(r)?),
        "block_size" => f.block_size = Some(u32::try_from(uint(r)?).map_err(|_| KvEventError::Batch("block_size"))?),
        "lora_name" => f.lora_name = opt_str(r)?,
        "medium" => f.medium = opt_str(r)?,
        _ => r.skip()?,
    }
    Ok(())
}

/// Positional field names after the tag, per event type (legacy array encoding).
fn positional(kind: &str) -> &'static [&'static str] {
    match kind {
        "BlockStored" => {
            &["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
        }
        "BlockRemoved" => &["block_hashes", "medium"],
        _ => &[],
    }
}

fn event(r: &mut Reader<'_>) -> Result<Option<KvEvent>, KvEventError> {
    let mut f = Fields::default();
    match r.value()? {
        Value::Map(n) => {
            for _ in 0..n {
                let key = match r.value()? {
                    Value::Str(s) => s,
                    _ => return Err(KvEventError::Batch("event map key is not a string")),
                };
                field(r, key, &mut f)?;
            }
        }
        Value::Array(n) if n >= 1 => {
            let kind = opt_str(r)?.unwrap_or_default();
            let names = positional(&kind);
            for i in 1..n {
                match names.get(i - 1) {
                    Some(name) => field(r, name, &mut f)?,
                    None => r.skip()?,
                }
            }
            f.kind = Some(kind);
        }
        _ => return Err(KvEventError::Batch("event is neither an array nor a map")),
    }
    let medium = Medium::parse(f.medium.as_deref());
    Ok(match f.kind.as_deref() {
        Some("BlockStored") => Some(KvEvent::BlockStored {
            block_hashes: f.block_hashes.ok_or(KvEventError::Batch("BlockStored without block_hashes"))?,
            parent_block_hash: f.parent,
            token_ids: f.token_ids.unwrap_or_default(),
            block_size: f.block_size.unwrap_or(0),
            lora_name: f.lora_name,
            medium,
        }),
        Some("BlockRemoved") => Some(KvEvent::BlockRemoved {
            block_hashes: f.block_hashes.ok_or(KvEventError::Batch("BlockRemoved without block_hashes"))?,
            medium,
        }),
        Some("AllBlocksCleared") => Some(KvEvent::AllBlocksCleared),
        _ => None,
    })
}

/// Decode a batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, KvEventError> {
    let mut r = Reader::new(payload);
    let mut b = EventBatch::default();
    let read_events = |r: &mut Reader<'_>, b: &mut EventBatch| -> Result<(), KvEventError> {
        let n = r.array()?;
        b.events.reserve(n);
        for _ in 0..n {
            match event(r)? {
                Some(e) => b.events.push(e),
                None => b.skipped += 1,
            }
        }
        Ok(())
    };
    let float = |v: Value<'_>| match v {
        Value::Float(f) => f,
        Value::Uint(u) => u as f64,
        Value::Int(i) => i as f64,
        _ => 0.0,
    };
    let rank = |v: Value<'_>| match v {
        Value::Uint(u) => Some(u as i64),
        Value::Int(i) => Some(i),
        _ => None,
    };
    match r.value()? {
        Value::Array(n) if n >= 2 => {
            b.ts = float(r.value()?);
            read_events(&mut r, &mut b)?;
            if n >= 3 {
                b.data_parallel_rank = rank(r.value()?);
            }
            for _ in 3..n {
                r.skip()?;
            }
        }
        Value::Map(n) => {
            for _ in 0..n {
                match r.value()? {
                    Value::Str("ts") => b.ts = float(r.value()?),
                    Value::Str("events") => read_events(&mut r, &mut b)?,
                    Value::Str("data_parallel_rank") => b.data_parallel_rank = rank(r.value()?),
                    _ => r.skip()?,
                }
            }
        }
        _ => return Err(KvEventError::Batch("batch is not [ts, events, rank]")),
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn legacy_array_batch_test_vector() {
        // reference/engines.md §3.5: a legacy array batch with all three event types.
        let p = hex("93cb3ff8000000000000939cab426c6f636b53746f72656491cfb0147556276afc9cc0940001020304c0a3475055c091c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f76656491cfb0147556276afc9ca34750550091b0416c6c426c6f636b73436c656172656400");
        let b = decode_batch(&p).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(b.data_parallel_rank, Some(0));
        assert_eq!(
            b.events,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![12687895063098490012],
                    parent_block_hash: None,
                    token_ids: vec![0, 1, 2, 3],
                    block_size: 4,
                    lora_name: None,
                    medium: Medium::Gpu
                },
                KvEvent::BlockRemoved { block_hashes: vec![12687895063098490012], medium: Medium::Gpu },
                KvEvent::AllBlocksCleared,
            ]
        );
    }

    /// Every message captured from the real vLLM 0.32 (map encoding), live and replayed, in both
    /// hash modes: decodes with no skipped events, the same events as the reference decoder.
    #[test]
    fn real_vllm_0_32_captures_decode() {
        for (frames_file, decoded_file) in [
            ("kv-events.jsonl", "kv-events.decoded.jsonl"),
            ("sha256_cbor/kv-events.jsonl", "sha256_cbor/kv-events.decoded.jsonl"),
            ("kv-events.replay.jsonl", "kv-events.decoded.jsonl"),
        ] {
            let frames = attache_fixtures::read_vllm(frames_file).unwrap();
            let decoded = attache_fixtures::read_vllm(decoded_file).unwrap();
            let mut n = 0;
            for (line, want) in frames.lines().zip(decoded.lines()) {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                let fr: Vec<Vec<u8>> =
                    v["frames_hex"].as_array().unwrap().iter().map(|f| hex(f.as_str().unwrap())).collect();
                // Replay frames carry a leading empty delimiter.
                let fr: Vec<&[u8]> = fr.iter().map(Vec::as_slice).skip_while(|f| f.is_empty()).collect();
                let m = split_frames(&fr).unwrap();
                let b = decode_batch(m.payload).unwrap();
                let want: serde_json::Value = serde_json::from_str(want).unwrap();
                assert_eq!(m.seq, want["seq"].as_u64().unwrap());
                assert_eq!(std::str::from_utf8(m.topic).unwrap(), "kv@tinyllama");
                let events = want["payload"][1].as_array().unwrap();
                assert_eq!(b.events.len(), events.len());
                assert_eq!(b.skipped, 0);
                for (got, w) in b.events.iter().zip(events) {
                    match got {
                        KvEvent::BlockStored { block_hashes, token_ids, block_size, .. } => {
                            assert_eq!(w["type"], "BlockStored");
                            let wh: Vec<u64> =
                                w["block_hashes"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
                            assert_eq!(block_hashes, &wh);
                            assert_eq!(token_ids.len(), w["token_ids"].as_array().unwrap().len());
                            assert_eq!(*block_size, 32);
                        }
                        KvEvent::BlockRemoved { block_hashes, .. } => {
                            assert_eq!(w["type"], "BlockRemoved");
                            assert_eq!(block_hashes[0], w["block_hashes"][0].as_u64().unwrap());
                        }
                        KvEvent::AllBlocksCleared => assert_eq!(w["type"], "AllBlocksCleared"),
                    }
                }
                n += 1;
            }
            assert!(n > 10, "{frames_file}: only {n} messages");
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert_eq!(split_frames(&[b"t", b"1234567"]), Err(KvEventError::Frames(2)));
        assert_eq!(split_frames(&[b"t", b"123", b"x"]), Err(KvEventError::Seq(3)));
        for p in [
            &b""[..],
            b"\x93",
            b"\x93\xcb\x00",
            b"\xdd\xff\xff\xff\xff",
            b"\xc1",
            b"\x93\x00\x91\x81\xa4type\xabBlockStored",
        ] {
            assert!(decode_batch(p).is_err(), "{p:?}");
        }
        // Unknown event types are skipped and counted.
        let b = decode_batch(b"\x93\x00\x92\x91\xa7Unknown\x91\xb0AllBlocksCleared\xc0").unwrap();
        assert_eq!((b.skipped, b.events.len()), (1, 1));
    }

    #[test]
    fn hashes_as_int64_and_bytes() {
        // int64 -1 and 32 raw bytes ending in 00..01.
        let mut p = b"\x93\x00\x91\x82\xa4type\xacBlockRemoved\xacblock_hashes\x92\xff\xc4\x20".to_vec();
        p.extend([0u8; 31]);
        p.push(1);
        p.push(0xc0);
        let b = decode_batch(&p).unwrap();
        assert_eq!(b.events, vec![KvEvent::BlockRemoved { block_hashes: vec![u64::MAX, 1], medium: Medium::Gpu }]);
    }
}
