//! `nexuskv-client`: plan requests against a NexusKV sidecar from Rust (std only).
//!
//!   nexuskv-client plan  URL TOKEN REQUEST.json [json|binary]             prints the plan (JSON) and a summary
//!   nexuskv-client bench URL TOKEN REQUEST.json THREADS N [json|binary]   N plans per thread; latency percentiles
//!
//! `bench` encodes the request once (as a load generator does): the times are the sidecar's round trips, not this
//! client's JSON writer. `binary` sends the token ids as uint32s beside the JSON (`application/x-nexuskv-tokens`).

mod client;
mod json;

use client::{encode, Client, Encoding, Error};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let code = match args.get(1).map(String::as_str) {
        Some("plan") if (5..=6).contains(&args.len()) => match encoding(args.get(5)) {
            Some(e) => plan(&args[2], &args[3], &args[4], e),
            None => usage(),
        },
        Some("bench") if (7..=8).contains(&args.len()) => match encoding(args.get(7)) {
            Some(e) => bench(&args[2], &args[3], &args[4], &args[5], &args[6], e),
            None => usage(),
        },
        _ => usage(),
    };
    std::process::exit(code);
}

fn usage() -> i32 {
    eprintln!(
        "usage: nexuskv-client plan URL TOKEN REQUEST.json [json|binary] | bench URL TOKEN REQUEST.json THREADS N [json|binary]"
    );
    2
}

fn encoding(arg: Option<&String>) -> Option<Encoding> {
    match arg.map(String::as_str) {
        None | Some("json") => Some(Encoding::Json),
        Some("binary") => Some(Encoding::Binary),
        _ => None,
    }
}

fn load(path: &str) -> Result<json::Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {}", path, e))?;
    json::parse(&text).map_err(|e| format!("{}: {}", path, e))
}

fn plan(url: &str, token: &str, path: &str, encoding: Encoding) -> i32 {
    let request = match load(path) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {}", e);
            return 2;
        }
    };
    let mut c = match Client::new(url, token, Duration::from_secs(5)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {}", e);
            return 2;
        }
    };
    match c.plan_as(&request, encoding) {
        Ok(p) => {
            println!("{}", p.raw.to_json());
            println!(
                "action={} tokens_total={} tokens_reused={} fail_open={} reasons={:?}",
                p.action, p.tokens_total, p.tokens_reused, p.fail_open, p.reasons
            );
            0
        }
        Err(Error::Refused(status, body)) => {
            eprintln!("refused: {} {}", status, body);
            1
        }
        Err(Error::BadRequest(why)) => {
            eprintln!("error: {}", why);
            2
        }
    }
}

fn bench(url: &str, token: &str, path: &str, threads: &str, n: &str, encoding: Encoding) -> i32 {
    let request = match load(path) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {}", e);
            return 2;
        }
    };
    let (threads, n): (usize, usize) = match (threads.parse(), n.parse()) {
        (Ok(t), Ok(n)) => (t, n),
        _ => {
            eprintln!("error: THREADS and N are numbers");
            return 2;
        }
    };
    let body = match encode(&request, encoding) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {}", e);
            return 2;
        }
    };
    let started = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (url, token) = (url.to_string(), token.to_string());
            let body = body.clone();
            let total = request.get("token_ids").and_then(|t| t.as_array()).map_or(0, |a| a.len() as u64);
            std::thread::spawn(move || {
                let mut c = Client::new(&url, &token, Duration::from_secs(5)).expect("url");
                let mut lat = Vec::with_capacity(n);
                let (mut fail_open, mut server_fail_open) = (0usize, 0usize);
                for _ in 0..n {
                    let t = Instant::now();
                    match c.plan_body(&body, encoding, total) {
                        // a plan the kernel made by failing open (its deadline passed, say) is counted, not timed
                        Ok(p) if !p.fail_open && p.reasons.iter().any(|r| r.starts_with("fail-open")) => {
                            server_fail_open += 1
                        }
                        Ok(p) if !p.fail_open => lat.push(t.elapsed().as_secs_f64() * 1e3),
                        _ => fail_open += 1,
                    }
                }
                (lat, fail_open, server_fail_open)
            })
        })
        .collect();
    let mut lat = Vec::new();
    let (mut fail_open, mut server_fail_open) = (0, 0);
    for h in handles {
        let (l, f, s) = h.join().expect("thread");
        lat.extend(l);
        fail_open += f;
        server_fail_open += s;
    }
    let wall = started.elapsed().as_secs_f64();
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |q: f64| if lat.is_empty() { f64::NAN } else { lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)] };
    println!(
        "plans={} fail_open={} server_fail_open={} wall_s={:.3} plans_per_s={:.1} p50_ms={:.4} p99_ms={:.4}",
        lat.len(), fail_open, server_fail_open, wall, lat.len() as f64 / wall, pct(0.5), pct(0.99)
    );
    0
}
