//! The sidecar client: plan a request over one keep-alive HTTP/1.1 connection, failing open to recompute.
//!
//! A plan that cannot be had (the sidecar is unreachable, answers late or with a server error) is answered here
//! with a `recompute` plan whose reason says why, like the kernel's own fail-open, so a scheduler can always act.
//! A refusal of the caller's request (4xx: a bad body, a token of another tenant) is an error: it must be fixed.

use crate::json::{self, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Plan {
    pub action: String,
    pub tokens_total: u64,
    pub tokens_reused: u64,
    pub reasons: Vec<String>,
    /// True when this plan was made by the client because the sidecar could not answer.
    pub fail_open: bool,
    /// The whole plan as the sidecar sent it (Null for a fail-open plan).
    pub raw: Value,
}

#[derive(Debug)]
pub enum Error {
    /// The sidecar refused the call: HTTP status and its error body.
    Refused(u16, String),
    /// The request given is not usable (not a JSON object with request_id, tenant and token_ids).
    BadRequest(String),
}

/// How a plan's request travels: JSON (request.v1), or the binary encoding (`application/x-nexuskv-tokens`: the
/// request's JSON without `token_ids`, then the ids as little-endian uint32s; see docs/sidecar.md).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Encoding {
    Json,
    Binary,
}

pub const BINARY_TYPE: &str = "application/x-nexuskv-tokens";

/// A request's body in `encoding`: JSON text, or `NKV1`, the JSON part's length, the JSON part, the token ids.
pub fn encode(request: &Value, encoding: Encoding) -> Result<Vec<u8>, String> {
    if encoding == Encoding::Json {
        return Ok(request.to_json().into_bytes());
    }
    let Value::Object(fields) = request else {
        return Err("a request is a JSON object".into());
    };
    let ids = fields.get("token_ids").and_then(|t| t.as_array()).ok_or("a request needs token_ids")?;
    let mut head = fields.clone();
    head.remove("token_ids");
    let head = Value::Object(head).to_json();
    let mut out = Vec::with_capacity(8 + head.len() + 4 * ids.len());
    out.extend_from_slice(b"NKV1");
    out.extend_from_slice(&(head.len() as u32).to_le_bytes());
    out.extend_from_slice(head.as_bytes());
    for (i, id) in ids.iter().enumerate() {
        let id = id.as_u64().filter(|v| *v <= u32::MAX as u64).ok_or_else(|| format!("token_ids[{}]: not a uint32", i))?;
        out.extend_from_slice(&(id as u32).to_le_bytes());
    }
    Ok(out)
}

pub struct Client {
    host: String,
    port: u16,
    token: String,
    timeout: Duration,
    conn: Option<BufReader<TcpStream>>,
}

enum Unavailable {
    Io(String),
}

/// Why an exchange failed, and whether the request can have reached the server.
struct Failed {
    why: String,
    /// The connection was found closed before any answer began (a kept-alive one the server closed while idle).
    stale: bool,
}

impl Client {
    /// A client of `url` (`http://host:port`) acting with `token`; `timeout` bounds every call.
    pub fn new(url: &str, token: &str, timeout: Duration) -> Result<Client, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| format!("{}: expected http://host:port", url))?;
        let rest = rest.trim_end_matches('/');
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| format!("{}: no port", url))?;
        let port: u16 = port.parse().map_err(|_| format!("{}: bad port", url))?;
        let host = host.trim_start_matches('[').trim_end_matches(']'); // http://[::1]:8470
        Ok(Client { host: host.to_string(), port, token: token.to_string(), timeout, conn: None })
    }

    /// Plan `request` (a request.v1 JSON object), sent as JSON. (For programs embedding this file; the CLI picks
    /// the encoding with `plan_as`.)
    #[allow(dead_code)]
    pub fn plan(&mut self, request: &Value) -> Result<Plan, Error> {
        self.plan_as(request, Encoding::Json)
    }

    /// Plan `request` (a request.v1 JSON object), sent in `encoding`.
    pub fn plan_as(&mut self, request: &Value, encoding: Encoding) -> Result<Plan, Error> {
        let tokens = request.get("token_ids").and_then(|t| t.as_array()).map(|a| a.len() as u64);
        let (Some(_), Some(_), Some(total)) = (
            request.get("request_id").and_then(|v| v.as_str()),
            request.get("tenant").and_then(|v| v.as_str()),
            tokens,
        ) else {
            return Err(Error::BadRequest("a request needs request_id, tenant and token_ids".into()));
        };
        let body = encode(request, encoding).map_err(Error::BadRequest)?;
        self.plan_body(&body, encoding, total)
    }

    /// Plan a request already serialized as request.v1 JSON (`tokens_total` tokens: for a fail-open plan).
    #[allow(dead_code)]
    pub fn plan_json(&mut self, body: &str, total: u64) -> Result<Plan, Error> {
        self.plan_body(body.as_bytes(), Encoding::Json, total)
    }

    /// Plan a request already encoded (`encode`) in `encoding`.
    pub fn plan_body(&mut self, body: &[u8], encoding: Encoding, total: u64) -> Result<Plan, Error> {
        let content_type = if encoding == Encoding::Binary { BINARY_TYPE } else { "application/json" };
        match self.call("POST", "/v1/plan", content_type, body) {
            Ok((200, text)) => match json::parse(&text) {
                Ok(raw) => Ok(Plan {
                    action: raw.get("action").and_then(|v| v.as_str()).unwrap_or("").to_string(),
                    tokens_total: raw.get("tokens_total").and_then(|v| v.as_u64()).unwrap_or(0),
                    tokens_reused: raw.get("tokens_reused").and_then(|v| v.as_u64()).unwrap_or(0),
                    reasons: raw
                        .get("reasons")
                        .and_then(|v| v.as_array())
                        .map(|a| a.iter().filter_map(|r| r.as_str().map(String::from)).collect())
                        .unwrap_or_default(),
                    fail_open: false,
                    raw,
                }),
                Err(e) => Ok(fail_open(total, &format!("answered a body that is not JSON: {}", e))),
            },
            Ok((status, text)) if status >= 500 => Ok(fail_open(total, &format!("error {}: {}", status, text))),
            Ok((status, text)) => Err(Error::Refused(status, text)),
            Err(Unavailable::Io(why)) => Ok(fail_open(total, &why)),
        }
    }

    fn connect(&self) -> Result<BufReader<TcpStream>, Unavailable> {
        let addrs: Vec<_> = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| Unavailable::Io(format!("unreachable: {}", e)))?
            .collect();
        // every address the name has, in order (`localhost` may give ::1 first while the sidecar is on 127.0.0.1)
        let mut last = "no address".to_string();
        let mut stream = None;
        for addr in &addrs {
            match TcpStream::connect_timeout(addr, self.timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = e.to_string(),
            }
        }
        let s = stream.ok_or_else(|| Unavailable::Io(format!("unreachable: {}", last)))?;
        s.set_nodelay(true).ok();
        s.set_read_timeout(Some(self.timeout)).ok();
        s.set_write_timeout(Some(self.timeout)).ok();
        Ok(BufReader::new(s))
    }

    /// One request on the kept-alive connection; tried again on a fresh connection only when the kept-alive one
    /// turned out closed before any answer began (never after a timeout: that would double the wait).
    fn call(&mut self, method: &str, path: &str, content_type: &str, body: &[u8]) -> Result<(u16, String), Unavailable> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let fresh = self.conn.is_none();
            if fresh {
                self.conn = Some(self.connect()?);
            }
            match self.exchange(method, path, content_type, body, deadline) {
                Ok(answer) => return Ok(answer),
                Err(failed) => {
                    self.conn = None;
                    if fresh || !failed.stale {
                        return Err(Unavailable::Io(failed.why));
                    }
                }
            }
        }
    }

    fn exchange(
        &mut self,
        method: &str,
        path: &str,
        content_type: &str,
        body: &[u8],
        deadline: Instant,
    ) -> Result<(u16, String), Failed> {
        let late = |e: String| Failed { why: e, stale: false };
        let conn = self.conn.as_mut().expect("connected");
        let head = format!(
            "{} {} HTTP/1.1\r\nHost: {}:{}\r\nAuthorization: Bearer {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n\r\n",
            method, path, host_header(&self.host), self.port, self.token, content_type, body.len()
        );
        let stream = conn.get_mut();
        let stale = |e: std::io::Error| Failed { stale: is_stale(&e), why: io_why(e) };
        stream.write_all(head.as_bytes()).map_err(stale)?;
        stream.write_all(body).map_err(stale)?;
        let mut line = String::new();
        remaining(conn, deadline).map_err(late)?;
        if conn.read_line(&mut line).map_err(stale)? == 0 {
            return Err(Failed { why: "unreachable: connection closed".into(), stale: true });
        }
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| late("answered a bad status line".into()))?;
        let mut length = None;
        let mut chunked = false;
        let mut close = false;
        loop {
            line.clear();
            remaining(conn, deadline).map_err(late)?;
            conn.read_line(&mut line).map_err(|e| late(io_why(e)))?;
            let h = line.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((name, value)) = h.split_once(':') {
                let name = name.trim().to_ascii_lowercase();
                if name == "content-length" {
                    length = Some(value.trim().parse().map_err(|_| late("answered a bad content-length".into()))?);
                } else if name == "transfer-encoding" && value.trim().eq_ignore_ascii_case("chunked") {
                    chunked = true;
                } else if name == "connection" && value.trim().eq_ignore_ascii_case("close") {
                    close = true;
                }
            }
        }
        let mut buf = Vec::new();
        if chunked {
            loop {
                line.clear();
                remaining(conn, deadline).map_err(late)?;
                conn.read_line(&mut line).map_err(|e| late(io_why(e)))?;
                let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                    .map_err(|_| late("answered a bad chunk size".into()))?;
                if size == 0 {
                    loop {
                        // trailers (if any), up to the empty line that ends the message
                        line.clear();
                        remaining(conn, deadline).map_err(late)?;
                        if conn.read_line(&mut line).map_err(|e| late(io_why(e)))? == 0 || line.trim().is_empty() {
                            break;
                        }
                    }
                    break;
                }
                let start = buf.len();
                buf.resize(start + size + 2, 0); // the chunk and its CRLF
                remaining(conn, deadline).map_err(late)?;
                conn.read_exact(&mut buf[start..]).map_err(|e| late(io_why(e)))?;
                buf.truncate(start + size);
            }
        } else if let Some(n) = length {
            buf.resize(n, 0);
            remaining(conn, deadline).map_err(late)?;
            conn.read_exact(&mut buf).map_err(|e| late(io_why(e)))?;
        } else {
            close = true; // the body runs to the end of the connection
            remaining(conn, deadline).map_err(late)?;
            conn.read_to_end(&mut buf).map_err(|e| late(io_why(e)))?;
        }
        if close {
            self.conn = None;
        }
        Ok((status, String::from_utf8_lossy(&buf).into_owned()))
    }
}

/// Bound the next read by what is left of the call's time. (Each read call gets the time left when it starts: a
/// server that trickles bytes slowly can still stretch a call past its timeout; it never hangs it for good.)
fn remaining(conn: &BufReader<TcpStream>, deadline: Instant) -> Result<(), String> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err("timed out".into());
    }
    conn.get_ref().set_read_timeout(Some(left)).map_err(io_why)
}

/// The Host header's host: an IPv6 address in brackets.
fn host_header(host: &str) -> String {
    if host.contains(':') {
        format!("[{}]", host)
    } else {
        host.to_string()
    }
}

fn is_stale(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
    )
}

fn io_why(e: std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => "timed out".to_string(),
        _ => format!("unreachable: {}", e),
    }
}

fn fail_open(tokens_total: u64, why: &str) -> Plan {
    Plan {
        action: "recompute".into(),
        tokens_total,
        tokens_reused: 0,
        reasons: vec![format!("fail-open: sidecar {}", why)],
        fail_open: true,
        raw: Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_body_is_magic_length_json_then_ids() {
        let req = json::parse(r#"{"request_id":"r","tenant":"t","token_ids":[1,2,4294967295]}"#).unwrap();
        let body = encode(&req, Encoding::Binary).unwrap();
        let head = br#"{"request_id":"r","tenant":"t"}"#;
        assert_eq!(&body[..4], b"NKV1");
        assert_eq!(u32::from_le_bytes(body[4..8].try_into().unwrap()) as usize, head.len());
        assert_eq!(&body[8..8 + head.len()], head);
        assert_eq!(&body[8 + head.len()..], &[1, 0, 0, 0, 2, 0, 0, 0, 255, 255, 255, 255]);
    }

    #[test]
    fn binary_refuses_ids_that_are_not_uint32() {
        let req = json::parse(r#"{"request_id":"r","tenant":"t","token_ids":[1,4294967296]}"#).unwrap();
        assert_eq!(encode(&req, Encoding::Binary).unwrap_err(), "token_ids[1]: not a uint32");
    }
}
