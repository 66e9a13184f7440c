//! The job store in Redis. Producers `RPUSH` job bodies onto `<prefix>:intake`; everything
//! after that is one Lua script per transition, so a worker killed between two commands never
//! leaves a job half-moved:
//!
//! | key | type | holds |
//! | --- | --- | --- |
//! | `intake` | list | job bodies as submitted |
//! | `jobs` | hash | id → body, until the job ends |
//! | `pending` | sorted set | id by deadline (ms): claimed earliest deadline first |
//! | `inflight` | sorted set | id by lease end (ms): the visibility timeout |
//! | `delayed` | sorted set | id by retry time (ms): backing off |
//! | `deadline`, `attempts`, `sheds`, `lease` | hashes | id → deadline (ms), counted attempts, sheds, lease token |
//! | `results` | hash | id → result JSON, written once (`HSETNX`) |
//! | `dead` | sorted set | dead-lettered ids by time (their reasons are in `results`) |
//! | `stats` | hash | `lapsed`, `duplicates`, `malformed` counters |
//! | `cancel` | hash | id → time (ms) a running job was asked to stop |
//!
//! Delivery is at least once: a lease that lapses (the worker died) puts the job back in
//! `pending`. A result is written once per id, so a job run twice still has one result.
//! Every time in the scripts (leases, retries, expiry) is Redis's own clock (`TIME`), so
//! workers whose clocks disagree cannot take each other's live leases.

use std::net::SocketAddr;
use std::time::Duration;

use super::job::{JobResult, Status};
use super::resp::{Client, RedisError, Value};

const KEY_NAMES: [&str; 13] = [
    "intake", "jobs", "pending", "inflight", "delayed", "deadline", "attempts", "results", "dead", "lease", "stats",
    "sheds", "cancel",
];

/// Lua helpers shared by every script. KEYS follow `KEY_NAMES`.
const PRELUDE: &str = r#"
local K = {intake=KEYS[1], jobs=KEYS[2], pending=KEYS[3], inflight=KEYS[4], delayed=KEYS[5],
  deadline=KEYS[6], attempts=KEYS[7], results=KEYS[8], dead=KEYS[9], lease=KEYS[10], stats=KEYS[11],
  sheds=KEYS[12], cancel=KEYS[13]}
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function forget(id)
  redis.call('ZREM', K.pending, id); redis.call('ZREM', K.inflight, id); redis.call('ZREM', K.delayed, id)
  redis.call('HDEL', K.jobs, id); redis.call('HDEL', K.deadline, id); redis.call('HDEL', K.attempts, id)
  redis.call('HDEL', K.lease, id); redis.call('HDEL', K.sheds, id); redis.call('HDEL', K.cancel, id)
end
local function ended(id, status, err, now_ms)
  local attempts = tonumber(redis.call('HGET', K.attempts, id) or '0')
  return cjson.encode({id=id, status=status, status_code=0, body=cjson.null, error=err,
    attempts=attempts, finished=now_ms / 1000})
end
-- A job asked to stop while it ran ends cancelled, whatever its last dispatch did.
local function finish(id, result, now_ms, dead)
  if redis.call('HEXISTS', K.cancel, id) == 1 then
    result = ended(id, 'cancelled', 'cancelled while running', now_ms); dead = false
  end
  local wrote = redis.call('HSETNX', K.results, id, result)
  forget(id)
  if wrote == 1 then
    if dead then redis.call('ZADD', K.dead, now_ms, id) end
  else
    redis.call('HINCRBY', K.stats, 'duplicates', 1)
  end
  return wrote
end
local function maintain(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', K.delayed, '-inf', now, 'LIMIT', 0, 256)) do
    redis.call('ZREM', K.delayed, id)
    redis.call('ZADD', K.pending, redis.call('HGET', K.deadline, id) or 0, id)
  end
  local lapsed = 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', K.inflight, '-inf', now, 'LIMIT', 0, 256)) do
    redis.call('ZREM', K.inflight, id); redis.call('HDEL', K.lease, id)
    if redis.call('HEXISTS', K.cancel, id) == 1 then
      finish(id, '', now, false)
    elseif redis.call('HEXISTS', K.results, id) == 0 then
      redis.call('ZADD', K.pending, redis.call('HGET', K.deadline, id) or 0, id)
    end
    redis.call('HINCRBY', K.stats, 'lapsed', 1); lapsed = lapsed + 1
  end
  local expired = 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', K.pending, '-inf', now, 'LIMIT', 0, 256)) do
    expired = expired + finish(id, ended(id, 'expired', 'deadline passed before dispatch', now), now, false)
  end
  return {expired, lapsed}
end
"#;

/// ARGV: max. Moves up to `max` bodies from intake into the store. A body without a string id
/// and a finite numeric deadline is dead-lettered at once, under its id when that id is not
/// in use, else under a generated `malformed:N`. A body whose id is in use (waiting, running or
/// finished) is dropped as a duplicate. Returns {moved, dead, dup}.
const INTAKE: &str = r#"
local moved, dead, dup = 0, 0, 0
local now = now_ms()
local function known(id)
  return redis.call('HEXISTS', K.results, id) == 1 or redis.call('HEXISTS', K.jobs, id) == 1
end
for _ = 1, tonumber(ARGV[1]) do
  local body = redis.call('LPOP', K.intake)
  if not body then break end
  local ok, job = pcall(cjson.decode, body)
  local id = nil
  if ok and type(job) == 'table' and type(job.id) == 'string' and #job.id > 0 and #job.id <= 256 then id = job.id end
  local dl = nil
  if id and type(job.deadline) == 'number' then
    local d = job.deadline * 1000
    if d == d and d > 0 and d < 1e15 then dl = math.floor(d) end
  end
  if id and known(id) then
    redis.call('HINCRBY', K.stats, 'duplicates', 1); dup = dup + 1
  elseif dl then
    redis.call('HSET', K.jobs, id, body); redis.call('HSET', K.deadline, id, dl)
    redis.call('ZADD', K.pending, dl, id); moved = moved + 1
  else
    local reason = 'malformed job: not a JSON object with a string id and a finite, positive numeric deadline'
    if not ok then reason = 'malformed job: not JSON' end
    while not id or known(id) do id = 'malformed:' .. redis.call('HINCRBY', K.stats, 'malformed', 1) end
    dead = dead + finish(id, ended(id, 'dead_lettered', reason, now), now, true)
  end
end
return {moved, dead, dup}
"#;

/// No ARGV. Upkeep that must run whether or not the worker may dispatch: promotes due
/// retries, returns lapsed leases to pending, and expires pending jobs past their deadline.
/// Returns {expired, lapsed}.
const MAINTAIN: &str = r#"
return maintain(now_ms())
"#;

/// ARGV: lease_ms, token. Upkeep ([`MAINTAIN`]), then claims the earliest deadline with a
/// lease of `lease_ms`. Returns {expired, lapsed, id, body, attempts, sheds} (id and body nil
/// when nothing is pending).
const CLAIM: &str = r#"
local now = now_ms()
local expired, lapsed = unpack(maintain(now))
local until_ms, token = now + tonumber(ARGV[1]), ARGV[2]
for _ = 1, 16 do
  local top = redis.call('ZRANGE', K.pending, 0, 0)
  if #top == 0 then return {expired, lapsed} end
  local id = top[1]
  redis.call('ZREM', K.pending, id)
  local body = redis.call('HGET', K.jobs, id)
  if body and redis.call('HEXISTS', K.results, id) == 0 then
    redis.call('ZADD', K.inflight, until_ms, id); redis.call('HSET', K.lease, id, token)
    return {expired, lapsed, id, body, tonumber(redis.call('HGET', K.attempts, id) or '0'),
      tonumber(redis.call('HGET', K.sheds, id) or '0')}
  end
  forget(id)
end
return {expired, lapsed}
"#;

/// ARGV: id, result, dead (0/1). Returns 1 when this call wrote the result.
const FINISH: &str = r#"
return finish(ARGV[1], ARGV[2], now_ms(), ARGV[3] == '1')
"#;

/// ARGV: id, token, wait_ms, count (0/1), max_attempts, error. A counted retry is an attempt;
/// an uncounted one (the pool shed the request) a shed, which only lengthens the backoff.
/// Returns 'delayed', 'dead', 'expired' or 'stale' (the lease is no longer this worker's).
const RETRY: &str = r#"
local id, token, now = ARGV[1], ARGV[2], now_ms()
local at = now + tonumber(ARGV[3])
if redis.call('HGET', K.lease, id) ~= token then return 'stale' end
if redis.call('HEXISTS', K.cancel, id) == 1 then
  finish(id, '', now, false)
  return 'cancelled'
end
redis.call('ZREM', K.inflight, id); redis.call('HDEL', K.lease, id)
local attempts = tonumber(redis.call('HGET', K.attempts, id) or '0')
if ARGV[4] == '1' then
  attempts = redis.call('HINCRBY', K.attempts, id, 1)
else
  redis.call('HINCRBY', K.sheds, id, 1)
end
if attempts >= tonumber(ARGV[5]) then
  finish(id, ended(id, 'dead_lettered', 'gave up after ' .. attempts .. ' attempts: ' .. ARGV[6], now), now, true)
  return 'dead'
end
if at >= tonumber(redis.call('HGET', K.deadline, id) or '0') then
  finish(id, ended(id, 'expired', 'deadline passed while retrying: ' .. ARGV[6], now), now, false)
  return 'expired'
end
redis.call('ZADD', K.delayed, at, id)
return 'delayed'
"#;

/// ARGV: id, token, lease_ms. Extends a lease this worker still holds.
const RENEW: &str = r#"
if redis.call('HGET', K.lease, ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', K.inflight, 'XX', now_ms() + tonumber(ARGV[3]), ARGV[1])
return 1
"#;

/// ARGV: id, reason. Stops a job: one not running (waiting, backing off, still in intake, or
/// never submitted) ends `cancelled` now, and intake drops its body as a duplicate if it comes;
/// a running one is marked, and ends `cancelled` when its worker sees the mark or settles it.
/// Returns 'cancelled', 'cancelling' or 'finished' (a result was there already).
const CANCEL: &str = r#"
local id, now = ARGV[1], now_ms()
if redis.call('HEXISTS', K.results, id) == 1 then return 'finished' end
if redis.call('ZSCORE', K.inflight, id) then
  redis.call('HSET', K.cancel, id, now)
  return 'cancelling'
end
finish(id, ended(id, 'cancelled', ARGV[2], now), now, false)
return 'cancelled'
"#;

/// ARGV: id, token. Hands a held job back to pending (a graceful stop that could not finish it).
const RELEASE: &str = r#"
local id = ARGV[1]
if redis.call('HGET', K.lease, id) ~= ARGV[2] then return 0 end
redis.call('ZREM', K.inflight, id); redis.call('HDEL', K.lease, id)
redis.call('ZADD', K.pending, redis.call('HGET', K.deadline, id) or 0, id)
return 1
"#;

/// A claimed job: its body as submitted, and the lease that holds it.
#[derive(Debug)]
pub struct Claimed {
    pub id: String,
    pub body: Vec<u8>,
    pub attempts: u32,
    /// Times the pool shed it (retries that were not attempts).
    pub sheds: u32,
}

#[derive(Debug, Default)]
pub struct ClaimReport {
    pub expired: u64,
    pub lapsed: u64,
    pub job: Option<Claimed>,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct IntakeReport {
    pub moved: u64,
    pub dead: u64,
    pub duplicates: u64,
}

/// What [`Queue::retry`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryVerdict {
    Delayed,
    DeadLettered,
    Expired,
    /// The job was asked to stop: it ended cancelled.
    Cancelled,
    /// The lease had lapsed and the job is someone else's now.
    Stale,
}

/// What [`Queue::cancel`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelVerdict {
    /// It was not running: it ended cancelled now.
    Cancelled,
    /// It is running: its worker stops it, and it ends cancelled.
    Cancelling,
    /// It had ended already.
    Finished,
}

/// How many jobs are where, for metrics and the autoscaler.
#[derive(Debug, Default, Clone, Copy)]
pub struct Depths {
    pub intake: u64,
    pub pending: u64,
    pub inflight: u64,
    pub delayed: u64,
    pub results: u64,
    pub dead: u64,
}

pub struct Queue {
    redis: Client,
    keys: Vec<String>,
}

fn int(v: Option<&Value>) -> u64 {
    v.and_then(Value::as_int).and_then(|i| u64::try_from(i).ok()).unwrap_or(0)
}

impl Queue {
    pub fn new(addr: SocketAddr, prefix: &str, timeout: Duration) -> Self {
        let keys = KEY_NAMES.iter().map(|k| format!("{prefix}:{k}")).collect();
        Self { redis: Client::new(addr, timeout), keys }
    }

    /// The key for one of `KEY_NAMES` (tests and producers).
    pub fn key(&self, name: &str) -> String {
        let i = KEY_NAMES.iter().position(|k| *k == name).unwrap_or(0);
        self.keys[i].clone()
    }

    pub fn redis(&self) -> &Client {
        &self.redis
    }

    async fn eval(&self, script: &str, argv: &[String]) -> Result<Value, RedisError> {
        let mut args: Vec<&[u8]> = Vec::with_capacity(3 + self.keys.len() + argv.len());
        let src = format!("{PRELUDE}{script}");
        let nkeys = self.keys.len().to_string();
        args.extend([b"EVAL".as_slice(), src.as_bytes(), nkeys.as_bytes()]);
        args.extend(self.keys.iter().map(|k| k.as_bytes()));
        args.extend(argv.iter().map(|a| a.as_bytes()));
        self.redis.cmd(&args).await
    }

    /// Producers' side: submit job bodies (`RPUSH` onto intake).
    pub async fn submit(&self, bodies: &[Vec<u8>]) -> Result<(), RedisError> {
        for chunk in bodies.chunks(500) {
            let intake = self.key("intake");
            let mut args: Vec<&[u8]> = vec![b"RPUSH", intake.as_bytes()];
            args.extend(chunk.iter().map(Vec::as_slice));
            self.redis.cmd(&args).await?;
        }
        Ok(())
    }

    pub async fn intake(&self, max: u32) -> Result<IntakeReport, RedisError> {
        let v = self.eval(INTAKE, &[max.to_string()]).await?.into_array();
        Ok(IntakeReport { moved: int(v.first()), dead: int(v.get(1)), duplicates: int(v.get(2)) })
    }

    /// Expire, reclaim and promote, without claiming: [`MAINTAIN`]. Returns (expired, lapsed).
    pub async fn maintain(&self) -> Result<(u64, u64), RedisError> {
        let v = self.eval(MAINTAIN, &[]).await?.into_array();
        Ok((int(v.first()), int(v.get(1))))
    }

    pub async fn claim(&self, lease: Duration, token: &str) -> Result<ClaimReport, RedisError> {
        let v = self.eval(CLAIM, &[lease.as_millis().to_string(), token.to_string()]).await?.into_array();
        let mut report = ClaimReport { expired: int(v.first()), lapsed: int(v.get(1)), job: None };
        if let (Some(Value::Bytes(id)), Some(Value::Bytes(body))) = (v.get(2), v.get(3)) {
            report.job = Some(Claimed {
                id: String::from_utf8_lossy(id).into_owned(),
                body: body.clone(),
                attempts: u32::try_from(int(v.get(4))).unwrap_or(u32::MAX),
                sheds: u32::try_from(int(v.get(5))).unwrap_or(u32::MAX),
            });
        }
        Ok(report)
    }

    /// Write a job's result (once per id) and forget the job. `Ok(false)`: a result was there.
    pub async fn finish(&self, result: &JobResult) -> Result<bool, RedisError> {
        let json = serde_json::to_string(result).map_err(|e| RedisError::Protocol(e.to_string()))?;
        let dead = if result.status == Status::DeadLettered { "1" } else { "0" };
        let v = self.eval(FINISH, &[result.id.clone(), json, dead.into()]).await?;
        Ok(v.as_int() == Some(1))
    }

    /// Back a held job off for `wait`; `count_attempt` false for a shed.
    pub async fn retry(
        &self,
        id: &str,
        token: &str,
        wait: Duration,
        count_attempt: bool,
        max_attempts: u32,
        error: &str,
    ) -> Result<RetryVerdict, RedisError> {
        let argv = [
            id.to_string(),
            token.to_string(),
            wait.as_millis().to_string(),
            if count_attempt { "1" } else { "0" }.to_string(),
            max_attempts.to_string(),
            error.to_string(),
        ];
        let v = self.eval(RETRY, &argv).await?;
        Ok(match v.as_str() {
            Some("delayed") => RetryVerdict::Delayed,
            Some("dead") => RetryVerdict::DeadLettered,
            Some("expired") => RetryVerdict::Expired,
            Some("cancelled") => RetryVerdict::Cancelled,
            _ => RetryVerdict::Stale,
        })
    }

    pub async fn renew(&self, id: &str, token: &str, lease: Duration) -> Result<bool, RedisError> {
        let v = self.eval(RENEW, &[id.to_string(), token.to_string(), lease.as_millis().to_string()]).await?;
        Ok(v.as_int() == Some(1))
    }

    pub async fn release(&self, id: &str, token: &str) -> Result<bool, RedisError> {
        let v = self.eval(RELEASE, &[id.to_string(), token.to_string()]).await?;
        Ok(v.as_int() == Some(1))
    }

    /// Stop a job ([`CANCEL`]).
    pub async fn cancel(&self, id: &str, reason: &str) -> Result<CancelVerdict, RedisError> {
        let v = self.eval(CANCEL, &[id.to_string(), reason.to_string()]).await?;
        Ok(match v.as_str() {
            Some("cancelled") => CancelVerdict::Cancelled,
            Some("cancelling") => CancelVerdict::Cancelling,
            _ => CancelVerdict::Finished,
        })
    }

    /// Whether a running job was asked to stop.
    pub async fn cancel_requested(&self, id: &str) -> Result<bool, RedisError> {
        let v = self.redis.cmd(&[b"HEXISTS".as_slice(), self.key("cancel").as_bytes(), id.as_bytes()]).await?;
        Ok(v.as_int() == Some(1))
    }

    /// `cmd key ids...` on one of `KEY_NAMES`: one value per id, in one round trip.
    async fn per_id(&self, cmd: &str, key: &str, ids: &[&str]) -> Result<Vec<Value>, RedisError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let key = self.key(key);
        let mut args: Vec<&[u8]> = vec![cmd.as_bytes(), key.as_bytes()];
        args.extend(ids.iter().map(|i| i.as_bytes()));
        Ok(self.redis.cmd(&args).await?.into_array())
    }

    /// The results of `ids` (`None` where a job has none yet).
    pub async fn results_of(&self, ids: &[&str]) -> Result<Vec<Option<JobResult>>, RedisError> {
        let v = self.per_id("HMGET", "results", ids).await?;
        Ok(v.iter().map(|r| r.as_str().and_then(|s| serde_json::from_str(s).ok())).collect())
    }

    /// Which of `ids` a worker holds now.
    pub async fn running(&self, ids: &[&str]) -> Result<Vec<bool>, RedisError> {
        let v = self.per_id("ZMSCORE", "inflight", ids).await?;
        Ok(v.iter().map(|s| !matches!(s, Value::Nil)).collect())
    }

    pub async fn depths(&self) -> Result<Depths, RedisError> {
        let len = |cmd: &'static str, key: String| async move {
            self.redis.cmd(&[cmd.as_bytes(), key.as_bytes()]).await.map(|v| int(Some(&v)))
        };
        Ok(Depths {
            intake: len("LLEN", self.key("intake")).await?,
            pending: len("ZCARD", self.key("pending")).await?,
            inflight: len("ZCARD", self.key("inflight")).await?,
            delayed: len("ZCARD", self.key("delayed")).await?,
            results: len("HLEN", self.key("results")).await?,
            dead: len("ZCARD", self.key("dead")).await?,
        })
    }

    /// Every result, by id (tests and operators' tools).
    pub async fn results(&self) -> Result<Vec<JobResult>, RedisError> {
        let v = self.redis.cmd(&[b"HVALS".as_slice(), self.key("results").as_bytes()]).await?;
        Ok(v.into_array().iter().filter_map(|r| serde_json::from_slice(r.as_str()?.as_bytes()).ok()).collect())
    }
}
