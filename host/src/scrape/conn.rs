//! One engine's metrics connection: a keep-alive HTTP/1.1 `GET`, owned by that engine's
//! scraper task.
//!
//! Following a thousand busy engines at 50 ms is 20,000 scrapes a second, and a general client
//! spent most of each one on itself (a pool checkout, a dispatch to the connection's task,
//! the URL, headers, and a dozen allocations), about 45 µs of CPU. Here the request bytes are
//! built once, the response buffer is reused, and the task that wants the page does the one
//! `write` and the reads itself. Responses are framed by `Content-Length`, `chunked`, or the
//! connection's end; a reused connection the engine closed while idle is redialed once.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A page larger than this is refused (a router reads a few KiB of a metrics page).
const MAX_PAGE: usize = 8 << 20;
/// Response headers beyond this many are refused.
const MAX_HEADERS: usize = 64;

/// Why a `GET` failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("connect: {0}")]
    Connect(io::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("HTTP {0}")]
    Status(u16),
    #[error("bad response: {0}")]
    Protocol(&'static str),
}

/// A keep-alive `GET` of one path on one engine.
#[derive(Debug)]
pub struct MetricsConn {
    address: String,
    stream: Option<TcpStream>,
    /// Connections dialed so far: the open one's id.
    dials: u64,
    buf: Vec<u8>,
    body: Vec<u8>,
}

/// The bytes of `GET path` to `address`, built once per path.
pub fn request(address: &str, path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nAccept: text/plain\r\nUser-Agent: attache-host\r\n\r\n")
        .into_bytes()
}

impl MetricsConn {
    pub fn new(address: &str) -> Self {
        Self { address: address.to_owned(), stream: None, dials: 0, buf: Vec::with_capacity(4096), body: Vec::new() }
    }

    /// The open connection's id (each dial takes the next), or None when none is open.
    pub fn connection(&self) -> Option<u64> {
        self.stream.as_ref().map(|_| self.dials)
    }

    /// Send `request` (from [`request`]) and return the 2xx response's body.
    pub async fn get(&mut self, request: &[u8], timeout: Duration) -> Result<&[u8], FetchError> {
        match tokio::time::timeout(timeout, self.exchange(request)).await {
            Ok(Ok(range)) => Ok(self.page(range)),
            Ok(Err(e)) => {
                self.stream = None;
                Err(e)
            }
            Err(_) => {
                self.stream = None;
                Err(FetchError::Timeout(timeout))
            }
        }
    }

    fn page(&self, range: Body) -> &[u8] {
        match range {
            Body::InBuf(start, end) => self.buf.get(start..end).unwrap_or_default(),
            Body::Decoded => &self.body,
        }
    }

    async fn exchange(&mut self, request: &[u8]) -> Result<Body, FetchError> {
        let reused = self.stream.is_some();
        match self.once(request).await {
            // The engine closed the idle connection between two scrapes: one redial.
            Err(FetchError::Io(e)) if reused && self.buf.is_empty() && closed(&e) => {
                self.stream = None;
                self.once(request).await
            }
            r => r,
        }
    }

    async fn once(&mut self, request: &[u8]) -> Result<Body, FetchError> {
        let stream = match &mut self.stream {
            Some(s) => s,
            None => {
                let s = TcpStream::connect(&self.address).await.map_err(FetchError::Connect)?;
                s.set_nodelay(true)?;
                self.dials += 1;
                self.stream.insert(s)
            }
        };
        self.buf.clear();
        stream.write_all(request).await?;
        let (head_len, framing, keep_alive) = loop {
            if read_more(stream, &mut self.buf).await? == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
            }
            if let Some(head) = parse_head(&self.buf)? {
                break head;
            }
        };
        let body = match framing {
            Framing::Length(n) => {
                let end = head_len.checked_add(n).filter(|e| *e - head_len <= MAX_PAGE);
                let end = end.ok_or(FetchError::Protocol("page too large"))?;
                while self.buf.len() < end {
                    if read_more(stream, &mut self.buf).await? == 0 {
                        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
                    }
                }
                Body::InBuf(head_len, end)
            }
            Framing::Chunked => loop {
                if let Some(used) = dechunk(self.buf.get(head_len..).unwrap_or_default(), &mut self.body)? {
                    if head_len + used != self.buf.len() {
                        return Err(FetchError::Protocol("bytes after the last chunk"));
                    }
                    break Body::Decoded;
                }
                if read_more(stream, &mut self.buf).await? == 0 {
                    return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
                }
            },
            Framing::UntilClose => {
                while read_more(stream, &mut self.buf).await? > 0 {}
                self.stream = None;
                return Ok(Body::InBuf(head_len, self.buf.len()));
            }
        };
        if !keep_alive {
            self.stream = None;
        }
        Ok(body)
    }
}

/// Where the page is: a range of the read buffer, or the de-chunked copy.
#[derive(Debug, Clone, Copy)]
enum Body {
    InBuf(usize, usize),
    Decoded,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Framing {
    Length(usize),
    Chunked,
    UntilClose,
}

fn closed(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe)
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    if buf.len() > MAX_PAGE {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "page too large"));
    }
    buf.reserve(16 * 1024);
    stream.read_buf(buf).await
}

/// The status line and headers, once complete: their length, how the body is framed, and
/// whether the connection stays open. A non-2xx status is an error.
fn parse_head(buf: &[u8]) -> Result<Option<(usize, Framing, bool)>, FetchError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut res = httparse::Response::new(&mut headers);
    let len = match res.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() < 64 * 1024 => return Ok(None),
        Ok(httparse::Status::Partial) => return Err(FetchError::Protocol("headers too long")),
        Err(_) => return Err(FetchError::Protocol("malformed status line or headers")),
    };
    let code = res.code.unwrap_or(0);
    if !(200..300).contains(&code) {
        return Err(FetchError::Status(code));
    }
    let mut framing = Framing::UntilClose;
    let mut keep_alive = res.version == Some(1);
    for h in res.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") && framing != Framing::Chunked {
            let n = std::str::from_utf8(h.value).ok().and_then(|v| v.trim().parse().ok());
            framing = Framing::Length(n.ok_or(FetchError::Protocol("bad Content-Length"))?);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            // Only `chunked` can come last on a response a client can read.
            if h.value.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                framing = Framing::Chunked;
            } else {
                return Err(FetchError::Protocol("unsupported Transfer-Encoding"));
            }
        } else if h.name.eq_ignore_ascii_case("connection") {
            keep_alive = !h.value.trim_ascii().eq_ignore_ascii_case(b"close");
        }
    }
    Ok(Some((len, framing, keep_alive)))
}

/// Decode a chunked body from `src` into `out`: the bytes of `src` used once the last chunk
/// and the trailers are complete, or None while more are needed.
fn dechunk(src: &[u8], out: &mut Vec<u8>) -> Result<Option<usize>, FetchError> {
    out.clear();
    let mut at = 0;
    loop {
        let Some(line_end) = find_crlf(src.get(at..).unwrap_or_default()) else { return Ok(None) };
        let line = src.get(at..at + line_end).unwrap_or_default();
        let size_hex = line.split(|b| *b == b';').next().unwrap_or_default().trim_ascii();
        let size = std::str::from_utf8(size_hex)
            .ok()
            .and_then(|h| usize::from_str_radix(h, 16).ok())
            .ok_or(FetchError::Protocol("bad chunk size"))?;
        at += line_end + 2;
        if size == 0 {
            // Trailers, each a line, up to an empty line.
            loop {
                let Some(end) = find_crlf(src.get(at..).unwrap_or_default()) else { return Ok(None) };
                at += end + 2;
                if end == 0 {
                    return Ok(Some(at));
                }
            }
        }
        if out.len() + size > MAX_PAGE {
            return Err(FetchError::Protocol("page too large"));
        }
        let Some(chunk) = src.get(at..at + size) else { return Ok(None) };
        match src.get(at + size..at + size + 2) {
            None => return Ok(None),
            Some(b"\r\n") => {}
            Some(_) => return Err(FetchError::Protocol("chunk without its CRLF")),
        }
        out.extend_from_slice(chunk);
        at += size + 2;
    }
}

fn find_crlf(s: &[u8]) -> Option<usize> {
    s.windows(2).position(|w| w == b"\r\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// A server that answers each request on a connection with the next of `answers`, then
    /// closes the connection after `close_after` answers.
    async fn server(answers: Vec<&'static [u8]>, close_after: usize) -> String {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let mut next = 0;
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                for _ in 0..close_after {
                    let mut req = Vec::new();
                    while !req.ends_with(b"\r\n\r\n") {
                        let mut b = [0u8; 1024];
                        let n = s.read(&mut b).await.unwrap_or(0);
                        if n == 0 {
                            break;
                        }
                        req.extend_from_slice(&b[..n]);
                    }
                    if req.is_empty() {
                        break; // the client hung up
                    }
                    assert!(req.starts_with(b"GET /metrics/?name%5B%5D=x HTTP/1.1\r\nHost: "), "{req:?}");
                    // Written in two pieces: the client must wait for the rest.
                    let a = answers[next % answers.len()];
                    next += 1;
                    let (x, y) = a.split_at(a.len() / 2);
                    s.write_all(x).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    s.write_all(y).await.unwrap();
                }
            }
        });
        addr
    }

    const LENGTH: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\ncontent-type: text/plain\r\n\r\nfoo 1\nbar 2\n";
    const CHUNKED: &[u8] =
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6;ext=1\r\nfoo 1\n\r\n6\r\nbar 2\n\r\n0\r\nx-trailer: y\r\n\r\n";
    const CLOSE: &[u8] = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nfoo 1\nbar 2\n";

    #[tokio::test]
    async fn reads_length_chunked_and_close_framed_pages_and_reuses_the_connection() {
        let t = Duration::from_secs(2);
        for (answer, close_after) in [(LENGTH, 3), (CHUNKED, 3), (CLOSE, 1)] {
            let addr = server(vec![answer], close_after).await;
            let req = request(&addr, "/metrics/?name%5B%5D=x");
            let mut c = MetricsConn::new(&addr);
            for i in 0..5 {
                let page = c.get(&req, t).await.unwrap_or_else(|e| panic!("{i}: {e}"));
                assert_eq!(page, b"foo 1\nbar 2\n", "{}", String::from_utf8_lossy(answer));
            }
        }
    }

    #[tokio::test]
    async fn errors_say_what_went_wrong_and_the_next_get_redials() {
        let t = Duration::from_secs(2);
        let addr = server(vec![b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n", LENGTH], 2).await;
        let req = request(&addr, "/metrics/?name%5B%5D=x");
        let mut c = MetricsConn::new(&addr);
        assert!(matches!(c.get(&req, t).await, Err(FetchError::Status(404))));
        assert_eq!(c.get(&req, t).await.unwrap(), b"foo 1\nbar 2\n");
        let bad = server(vec![b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], 1).await;
        let e = MetricsConn::new(&bad).get(&request(&bad, "/metrics/?name%5B%5D=x"), t).await.unwrap_err();
        assert!(matches!(e, FetchError::Protocol("bad chunk size")), "{e}");
        let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap().to_string();
        let e = MetricsConn::new(&addr).get(&request(&addr, "/m"), Duration::from_millis(50)).await.unwrap_err();
        assert!(matches!(e, FetchError::Timeout(_)), "{e}");
        drop(silent);
        let e = MetricsConn::new(&addr).get(&request(&addr, "/m"), t).await.unwrap_err();
        assert!(matches!(&e, FetchError::Connect(c) if c.kind() == io::ErrorKind::ConnectionRefused), "{e}");
    }

    #[test]
    fn a_chunked_body_waits_for_its_last_chunk() {
        let mut out = Vec::new();
        let whole = &CHUNKED[CHUNKED.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4..];
        for cut in 0..whole.len() {
            assert_eq!(dechunk(&whole[..cut], &mut out).unwrap(), None, "cut at {cut}");
        }
        assert_eq!(dechunk(whole, &mut out).unwrap(), Some(whole.len()));
        assert_eq!(out, b"foo 1\nbar 2\n");
    }
}
