//! Redis behind the in-memory store (`responses.redis`): every stored response is written
//! through, so a restarted host, or another host replica, reads back a chain it does not
//! hold. One hash per response, `attache:resp:<tenant>:<id>`, with the store's TTL:
//! `input`, `output` (items, the inner text of JSON arrays), `meta` (the response object
//! without `output`), `prev` and `n` (input items). A chain is read back in one round trip: a
//! script follows `prev` from the newest turn.

use std::net::SocketAddr;
use std::time::Duration;

use crate::async_worker::resp::{Client, RedisError, Value};

use super::store::Parts;

const PREFIX: &str = "attache:resp:";
/// The longest chain read back (turns).
const MAX_CHAIN: usize = 10_000;

/// Walk a chain from ARGV[2] (prefix ARGV[1]) through `prev`: the turns newest first, each as
/// id, prev, input, output, meta, n. A missing turn ends it with the single value `gone`.
const CHAIN: &str = r"
local out = {}
local id = ARGV[2]
local n = 0
while id ~= '' and n < tonumber(ARGV[3]) do
  local v = redis.call('HMGET', ARGV[1] .. id, 'prev', 'input', 'output', 'meta', 'n')
  if not v[1] then
    if n == 0 then return nil end
    table.insert(out, 'gone')
    return out
  end
  table.insert(out, id)
  for i = 1, 5 do table.insert(out, v[i]) end
  id = v[1]
  n = n + 1
end
return out
";

/// Replace a kept turn's output and object (a background response that ran), if it is there.
const UPDATE: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'output', ARGV[1], 'meta', ARGV[2])
return 1
";

const PUT: &str = r"
redis.call('HSET', KEYS[1], 'prev', ARGV[1], 'input', ARGV[2], 'output', ARGV[3], 'meta', ARGV[4], 'n', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 1
";

/// One turn read back, oldest first in [`RedisStore::chain`]'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub id: String,
    pub prev: Option<String>,
    pub parts: Parts,
}

/// What reading a chain found.
#[derive(Debug, PartialEq, Eq)]
pub enum Chain {
    /// Oldest first.
    Found(Vec<Turn>),
    NotFound,
    /// The newest turn is there but an earlier one expired.
    Broken,
}

pub struct RedisStore {
    client: Client,
    ttl: Duration,
}

fn key(tenant: &str, id: &str) -> String {
    format!("{PREFIX}{tenant}:{id}")
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_owned()
}

impl RedisStore {
    pub fn new(addr: SocketAddr, ttl: Duration) -> Self {
        Self { client: Client::new(addr, Duration::from_secs(2)), ttl }
    }

    pub async fn put(&self, tenant: &str, id: &str, prev: Option<&str>, parts: &Parts) -> Result<(), RedisError> {
        let (k, n, ttl) = (key(tenant, id), parts.input_count.to_string(), self.ttl.as_millis().max(1).to_string());
        let args: [&str; 10] =
            ["EVAL", PUT, "1", &k, prev.unwrap_or_default(), &parts.input, &parts.output, &parts.meta, &n, &ttl];
        self.client.cmd(&args).await.map(|_| ())
    }

    pub async fn update(&self, tenant: &str, id: &str, parts: &Parts) -> Result<(), RedisError> {
        let k = key(tenant, id);
        self.client.cmd(&["EVAL", UPDATE, "1", &k, &parts.output, &parts.meta]).await.map(|_| ())
    }

    pub async fn delete(&self, tenant: &str, id: &str) -> Result<(), RedisError> {
        self.client.cmd(&["DEL", &key(tenant, id)]).await.map(|_| ())
    }

    /// The chain ending with `id`, oldest turn first.
    pub async fn chain(&self, tenant: &str, id: &str) -> Result<Chain, RedisError> {
        let prefix = format!("{PREFIX}{tenant}:");
        let max = MAX_CHAIN.to_string();
        let v = self.client.cmd(&["EVAL", CHAIN, "0", &prefix, id, &max]).await?.into_array();
        if v.is_empty() {
            return Ok(Chain::NotFound);
        }
        if v.last().and_then(Value::as_str) == Some("gone") {
            return Ok(Chain::Broken);
        }
        let mut turns: Vec<Turn> = v
            .chunks_exact(6)
            .map(|t| Turn {
                id: text(&t[0]),
                prev: Some(text(&t[1])).filter(|p| !p.is_empty()),
                parts: Parts {
                    input: text(&t[2]),
                    output: text(&t[3]),
                    meta: text(&t[4]),
                    input_count: t[5].as_int().and_then(|n| usize::try_from(n).ok()).unwrap_or(0),
                },
            })
            .collect();
        turns.reverse();
        Ok(Chain::Found(turns))
    }
}
