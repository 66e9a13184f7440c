//! A minimal Redis client: RESP2 over one TCP connection, the commands the worker sends
//! (`EVAL`, `ZCARD`, `HGET`, ...) and nothing else. One connection is enough: every state
//! change is one server-side script, so the worker sends a few commands per job.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A reply, as RESP2 types it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Nil,
    Int(i64),
    /// A simple string (`+OK`) or a bulk string.
    Bytes(Vec<u8>),
    Array(Vec<Value>),
    /// An error reply inside an array (a top-level one is [`RedisError::Server`]).
    Error(String),
}

impl Value {
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bytes(b) => std::str::from_utf8(b).ok()?.parse().ok(),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Bytes(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }
    pub fn into_array(self) -> Vec<Value> {
        match self {
            Value::Array(a) => a,
            Value::Nil => Vec::new(),
            other => vec![other],
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    #[error("redis i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("redis replied with an error: {0}")]
    Server(String),
    #[error("redis protocol: {0}")]
    Protocol(String),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
}

/// One connection. A failed command leaves it in an unknown state: drop it and reconnect.
pub struct Conn {
    io: BufReader<TcpStream>,
    timeout: Duration,
}

/// The longest bulk string accepted (results of finished jobs are the largest).
const MAX_BULK: usize = 512 << 20;
/// The longest reply line (a simple string, an error, a length).
const MAX_LINE: u64 = 64 << 10;

impl Conn {
    pub async fn connect(addr: SocketAddr, timeout: Duration) -> Result<Self, RedisError> {
        let tcp = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| RedisError::Timeout(timeout))??;
        tcp.set_nodelay(true)?;
        Ok(Self { io: BufReader::new(tcp), timeout })
    }

    /// Send one command and read its reply. A server error (`-ERR ...`) is an `Err`.
    pub async fn cmd<A: AsRef<[u8]>>(&mut self, args: &[A]) -> Result<Value, RedisError> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
        for a in args {
            let a = a.as_ref();
            out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            out.extend_from_slice(a);
            out.extend_from_slice(b"\r\n");
        }
        let t = self.timeout;
        let reply = tokio::time::timeout(t, async {
            self.io.get_mut().write_all(&out).await?;
            self.read_value().await
        })
        .await
        .map_err(|_| RedisError::Timeout(t))??;
        match reply {
            Value::Error(e) => Err(RedisError::Server(e)),
            v => Ok(v),
        }
    }

    async fn read_line(&mut self) -> Result<Vec<u8>, RedisError> {
        let mut line = Vec::new();
        let n = (&mut self.io).take(MAX_LINE).read_until(b'\n', &mut line).await?;
        if n == 0 {
            return Err(RedisError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        if !line.ends_with(b"\r\n") {
            return Err(RedisError::Protocol("line without CRLF".into()));
        }
        line.truncate(line.len() - 2);
        Ok(line)
    }

    fn read_value(
        &mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Value, RedisError>> + Send + '_>> {
        Box::pin(async move {
            let line = self.read_line().await?;
            let (kind, rest) = line.split_first().ok_or_else(|| RedisError::Protocol("empty reply".into()))?;
            let text = String::from_utf8_lossy(rest).into_owned();
            let int = |s: &str| s.parse::<i64>().map_err(|_| RedisError::Protocol(format!("bad integer {s:?}")));
            match kind {
                b'+' => Ok(Value::Bytes(rest.to_vec())),
                b'-' => Ok(Value::Error(text)),
                b':' => Ok(Value::Int(int(&text)?)),
                b'$' => {
                    let n = int(&text)?;
                    if n < 0 {
                        return Ok(Value::Nil);
                    }
                    let n = usize::try_from(n).map_err(|_| RedisError::Protocol("bulk length".into()))?;
                    if n > MAX_BULK {
                        return Err(RedisError::Protocol(format!("bulk string of {n} bytes")));
                    }
                    let mut buf = vec![0; n + 2];
                    self.io.read_exact(&mut buf).await?;
                    if !buf.ends_with(b"\r\n") {
                        return Err(RedisError::Protocol("bulk string without CRLF".into()));
                    }
                    buf.truncate(n);
                    Ok(Value::Bytes(buf))
                }
                b'*' => {
                    let n = int(&text)?;
                    if n < 0 {
                        return Ok(Value::Nil);
                    }
                    let n = usize::try_from(n).map_err(|_| RedisError::Protocol("array length".into()))?;
                    let mut items = Vec::with_capacity(n.min(1024));
                    for _ in 0..n {
                        items.push(self.read_value().await?);
                    }
                    Ok(Value::Array(items))
                }
                other => Err(RedisError::Protocol(format!("unknown reply type {:?}", char::from(*other)))),
            }
        })
    }
}

/// A connection that reconnects: a command on a broken connection drops it, and the next one
/// dials again. Callers retry at their own pace. Cancel-safe: a command holds the connection
/// out of the slot while it runs, so one dropped mid-way (its reply unread) takes the
/// connection with it, and the next command dials a fresh one instead of reading that reply.
pub struct Client {
    addr: SocketAddr,
    timeout: Duration,
    conn: tokio::sync::Mutex<Option<Conn>>,
}

impl Client {
    pub fn new(addr: SocketAddr, timeout: Duration) -> Self {
        Self { addr, timeout, conn: tokio::sync::Mutex::new(None) }
    }

    pub async fn cmd<A: AsRef<[u8]>>(&self, args: &[A]) -> Result<Value, RedisError> {
        let mut guard = self.conn.lock().await;
        let mut conn = match guard.take() {
            Some(c) => c,
            None => Conn::connect(self.addr, self.timeout).await?,
        };
        match conn.cmd(args).await {
            Ok(v) => {
                *guard = Some(conn);
                Ok(v)
            }
            // An error reply was read whole: the connection is in step.
            Err(RedisError::Server(e)) => {
                *guard = Some(conn);
                Err(RedisError::Server(e))
            }
            // Anything else may leave a reply half read: drop the connection.
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A one-shot server that answers each command with the next canned reply.
    async fn serve(replies: Vec<&'static [u8]>) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            for r in replies {
                let _ = s.read(&mut buf).await.unwrap();
                s.write_all(r).await.unwrap();
            }
        });
        addr
    }

    #[tokio::test]
    async fn parses_every_reply_type() {
        let addr = serve(vec![
            b"+OK\r\n",
            b":42\r\n",
            b"$5\r\nhello\r\n",
            b"$-1\r\n",
            b"*3\r\n:1\r\n$2\r\nab\r\n*1\r\n+x\r\n",
            b"-ERR boom\r\n",
        ])
        .await;
        let mut c = Conn::connect(addr, Duration::from_secs(2)).await.unwrap();
        assert_eq!(c.cmd(&["PING"]).await.unwrap(), Value::Bytes(b"OK".to_vec()));
        assert_eq!(c.cmd(&["X"]).await.unwrap().as_int(), Some(42));
        assert_eq!(c.cmd(&["X"]).await.unwrap().as_str(), Some("hello"));
        assert_eq!(c.cmd(&["X"]).await.unwrap(), Value::Nil);
        let arr = c.cmd(&["X"]).await.unwrap().into_array();
        assert_eq!(arr.len(), 3);
        assert_eq!(arr[1].as_str(), Some("ab"));
        assert_eq!(arr[2].clone().into_array()[0].as_str(), Some("x"));
        match c.cmd(&["X"]).await {
            Err(RedisError::Server(e)) => assert_eq!(e, "ERR boom"),
            other => panic!("expected a server error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_error_inside_an_array_is_read_whole() {
        let addr = serve(vec![b"*2\r\n-ERR one\r\n:5\r\n", b":6\r\n"]).await;
        let mut c = Conn::connect(addr, Duration::from_secs(2)).await.unwrap();
        let v = c.cmd(&["X"]).await.unwrap().into_array();
        assert_eq!(v, vec![Value::Error("ERR one".into()), Value::Int(5)]);
        assert_eq!(c.cmd(&["X"]).await.unwrap(), Value::Int(6), "the connection stays in step");
    }

    #[tokio::test]
    async fn a_command_dropped_mid_way_does_not_leave_its_reply_to_the_next() {
        // A server that answers the first command late, on the first connection only.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let mut n = 0;
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                n += 1;
                let slow = n == 1;
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    while s.read(&mut buf).await.unwrap_or(0) > 0 {
                        if slow {
                            tokio::time::sleep(Duration::from_millis(300)).await;
                            let _ = s.write_all(b":1\r\n").await;
                        } else {
                            let _ = s.write_all(b":2\r\n").await;
                        }
                    }
                });
            }
        });
        let c = Client::new(addr, Duration::from_secs(2));
        let dropped = tokio::time::timeout(Duration::from_millis(50), c.cmd(&["SLOW"])).await;
        assert!(dropped.is_err(), "the first command is cancelled before its reply");
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(c.cmd(&["NEXT"]).await.unwrap(), Value::Int(2), "a fresh connection, not the stale reply");
    }

    #[tokio::test]
    async fn refuses_a_malformed_reply() {
        let addr = serve(vec![b"?what\r\n", b":12x\r\n", b"$2\r\nabcd"]).await;
        let mut c = Conn::connect(addr, Duration::from_secs(2)).await.unwrap();
        assert!(matches!(c.cmd(&["X"]).await, Err(RedisError::Protocol(_))));
        assert!(matches!(c.cmd(&["X"]).await, Err(RedisError::Protocol(_))));
        assert!(matches!(c.cmd(&["X"]).await, Err(RedisError::Protocol(_))), "a bulk string must end in CRLF");
    }
}
