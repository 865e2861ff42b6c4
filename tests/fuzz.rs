//! A bounded, deterministic property-based fuzz of the router's HTTP/1 handling over loopback
//! sockets, on the raw harness of the conformance corpus.
//!
//! Three generators mutate (a) request heads (methods, versions, field names and values,
//! duplicate or missing `Host`, `Content-Length` and `Transfer-Encoding`, separators and line
//! ends), (b) chunked request framing (size forms, extensions, line ends, data lengths) and
//! (c) backend responses (status lines, framing fields, bodies on `HEAD`/204/304, extra bytes in
//! the same or a later segment). Each case gets its own router and scripted backend. Whatever
//! the router does with the case, afterwards canaries on new connections (and, after a clean
//! response, on the same connection) must get exactly their own answers, and no canary may see
//! the marker that only the mutated backend response carries.
//!
//! The cases come from a fixed seed, so a run is reproducible; their number keeps the file's
//! run time around half a minute on two cores.

mod common;

#[path = "conformance/harness.rs"]
mod harness;

use std::time::Duration;

use common::find;
use harness::*;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

/// Carried only by mutated backend responses: no canary may ever see it.
const MARK: &str = "MARKED";

/// A runner with `cases` cases from the fixed `seed`, no failure files, bounded shrinking.
fn runner(cases: u32, seed: u8) -> TestRunner {
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 64,
        rng_algorithm: RngAlgorithm::ChaCha,
        ..Config::default()
    };
    TestRunner::new_with_rng(
        config,
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    )
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A router (one attempt per request, short timeouts) in front of a backend running `script`.
async fn setup(script: Script) -> (common::TestRouter, Backend) {
    let backend = Backend::start(script).await;
    let mut config = common::round_robin();
    config.retry.max_attempts = 1;
    config.latency.threshold = Duration::from_millis(50);
    config.upstream.first_byte_timeout = Some(Duration::from_secs(1));
    config.limits.header_read_timeout = Duration::from_secs(1);
    let router = common::start_router(config).await;
    common::set_backends(router.addr, std::slice::from_ref(&backend.addr)).await;
    (router, backend)
}

/// Writes `bytes` in pieces cut at `cuts`, 30 ms apart; stops early (without an error) when the
/// router closed the connection.
async fn send_pieces(client: &mut Client, bytes: &[u8], cuts: &[usize]) {
    let mut cuts: Vec<usize> = cuts.iter().map(|&cut| cut.min(bytes.len())).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut start = 0;
    for cut in cuts.into_iter().chain([bytes.len()]) {
        if cut > start {
            if start > 0 {
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            if client.send(&bytes[start..cut]).await.is_err() {
                return;
            }
            start = cut;
        }
    }
}

/// The canaries after a case, and the check that none of them saw [`MARK`].
async fn after_case(
    router: &common::TestRouter,
    backend: &Backend,
    tag: &str,
) -> Result<(), String> {
    let mut seen = Vec::new();
    run_canaries(tag, router.addr, &mut seen).await?;
    for bytes in &seen {
        if find(bytes, MARK.as_bytes()).is_some() {
            return Err(format!("a canary received {MARK}: {:?}", lossy(bytes)));
        }
    }
    check_garbage(backend)
}

fn fail(error: String) -> TestCaseError {
    TestCaseError::fail(error)
}

// (a) Request heads.

#[derive(Debug, Clone)]
struct Field {
    name: &'static str,
    separator: &'static str,
    value: &'static str,
    line_end: &'static str,
}

fn field() -> impl Strategy<Value = Field> {
    (
        select(vec![
            "Host",
            "host",
            "Content-Length",
            "content-length",
            "Transfer-Encoding",
            "transfer-encoding",
            "Transfer_Encoding",
            "Transfer-Encoding ",
            " Transfer-Encoding",
            "Connection",
            "Expect",
            "TE",
            "X-A",
            "X_B",
            "",
        ]),
        select(vec![":", ": ", ":\t", " : ", ":  "]),
        select(vec![
            "a",
            "5",
            "005",
            "5, 5",
            "5,6",
            "-1",
            "+5",
            "",
            "99999999999999999999",
            "chunked",
            "Chunked",
            " chunked",
            "chunked, gzip",
            "gzip, chunked",
            "gzip",
            "xchunked",
            "close",
            "keep-alive",
            "100-continue",
            "a\tb",
            "a\x00b",
            "caf\u{e9}",
        ]),
        prop_oneof![
            8 => Just("\r\n"),
            1 => Just("\n"),
            1 => Just("\r"),
            1 => Just("\r\n "),
        ],
    )
        .prop_map(|(name, separator, value, line_end)| Field {
            name,
            separator,
            value,
            line_end,
        })
}

#[derive(Debug, Clone)]
struct HeadCase {
    method: &'static str,
    version: &'static str,
    host: Option<usize>,
    fields: Vec<Field>,
    body: &'static str,
    cuts: Vec<usize>,
}

impl HeadCase {
    fn bytes(&self) -> Vec<u8> {
        let mut out = format!("{} /f {}\r\n", self.method, self.version);
        for (index, field) in self.fields.iter().enumerate() {
            if self.host == Some(index) {
                out.push_str("Host: a\r\n");
            }
            out.push_str(field.name);
            out.push_str(field.separator);
            out.push_str(field.value);
            out.push_str(field.line_end);
        }
        if self.host.is_some_and(|index| index >= self.fields.len()) {
            out.push_str("Host: a\r\n");
        }
        out.push_str("\r\n");
        out.push_str(self.body);
        out.into_bytes()
    }
}

fn head_case() -> impl Strategy<Value = HeadCase> {
    (
        prop_oneof![
            6 => Just("GET"),
            6 => Just("POST"),
            1 => Just("HEAD"),
            1 => Just("get"),
            1 => Just("G T"),
            1 => Just("CONNECT"),
        ],
        prop_oneof![
            8 => Just("HTTP/1.1"),
            2 => Just("HTTP/1.0"),
            1 => Just("HTTP/1.2"),
            1 => Just("HTTP/1.1 "),
        ],
        prop_oneof![4 => (0usize..6).prop_map(Some), 1 => Just(None)],
        prop::collection::vec(field(), 0..5),
        select(vec![
            "",
            "hello",
            "5\r\nhello\r\n0\r\n\r\n",
            "0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
            "hello\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
        ]),
        prop::collection::vec(0usize..120, 0..3),
    )
        .prop_map(|(method, version, host, fields, body, cuts)| HeadCase {
            method,
            version,
            host,
            fields,
            body,
            cuts,
        })
}

/// Sends `request` in pieces, reads whatever answer comes (or none), then runs the canaries.
async fn request_case(request: Vec<u8>, cuts: Vec<usize>, tag: &str) -> Result<(), String> {
    let (router, backend) = setup(Script::default()).await;
    let mut client = Client::connect(router.addr).await?;
    send_pieces(&mut client, &request, &cuts).await;
    client.limit = Duration::from_millis(400);
    let _ = client.read_response(request.starts_with(b"HEAD ")).await;
    drop(client);
    after_case(&router, &backend, tag).await
}

#[test]
fn mutated_request_heads_leave_later_clients_unharmed() {
    let runtime = runtime();
    let cases = std::sync::atomic::AtomicU32::new(0);
    runner(400, 1)
        .run(&head_case(), |case| {
            let n = cases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            runtime
                .block_on(request_case(
                    case.bytes(),
                    case.cuts.clone(),
                    &format!("head-{n}"),
                ))
                .map_err(fail)
        })
        .unwrap();
    eprintln!("{} cases", cases.into_inner());
}

// (b) Chunked framing.

#[derive(Debug, Clone)]
struct Chunk {
    /// Bytes of data actually sent.
    length: usize,
    /// Added to `length` in the size line (the size line lies when not zero).
    skew: i8,
    zeros: usize,
    uppercase: bool,
    before: &'static str,
    after: &'static str,
    extension: &'static str,
    line_end: &'static str,
    data_end: &'static str,
}

fn chunk() -> impl Strategy<Value = Chunk> {
    (
        1usize..40,
        prop_oneof![8 => Just(0i8), 1 => Just(-1i8), 1 => Just(1i8)],
        prop_oneof![6 => Just(0usize), 1 => 1usize..18],
        any::<bool>(),
        prop_oneof![8 => Just(""), 1 => Just(" "), 1 => Just("0x"), 1 => Just("+")],
        prop_oneof![8 => Just(""), 1 => Just(" "), 1 => Just("\t")],
        prop_oneof![
            6 => Just(""),
            1 => Just(";a=b"),
            1 => Just(";a\rb"),
            1 => Just(";q=\"x y\""),
            1 => Just(";"),
        ],
        prop_oneof![8 => Just("\r\n"), 1 => Just("\n"), 1 => Just("\r")],
        prop_oneof![8 => Just("\r\n"), 1 => Just("\n"), 1 => Just(""), 1 => Just("xx\r\n")],
    )
        .prop_map(
            |(length, skew, zeros, uppercase, before, after, extension, line_end, data_end)| {
                Chunk {
                    length,
                    skew,
                    zeros,
                    uppercase,
                    before,
                    after,
                    extension,
                    line_end,
                    data_end,
                }
            },
        )
}

#[derive(Debug, Clone)]
struct ChunkedCase {
    chunks: Vec<Chunk>,
    trailer: &'static str,
    last_end: &'static str,
    then: &'static str,
    cuts: Vec<usize>,
}

impl ChunkedCase {
    fn bytes(&self) -> Vec<u8> {
        let mut out = b"POST /f HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        for (index, chunk) in self.chunks.iter().enumerate() {
            let size = (chunk.length as i64 + i64::from(chunk.skew)).max(0) as u64;
            let digits = if chunk.uppercase {
                format!("{size:X}")
            } else {
                format!("{size:x}")
            };
            out.extend_from_slice(chunk.before.as_bytes());
            out.extend(std::iter::repeat_n(b'0', chunk.zeros));
            out.extend_from_slice(digits.as_bytes());
            out.extend_from_slice(chunk.after.as_bytes());
            out.extend_from_slice(chunk.extension.as_bytes());
            out.extend_from_slice(chunk.line_end.as_bytes());
            out.extend((0..chunk.length).map(|i| b'a' + ((i + index) % 26) as u8));
            out.extend_from_slice(chunk.data_end.as_bytes());
        }
        out.extend_from_slice(b"0\r\n");
        out.extend_from_slice(self.trailer.as_bytes());
        out.extend_from_slice(self.last_end.as_bytes());
        out.extend_from_slice(self.then.as_bytes());
        out
    }
}

fn chunked_case() -> impl Strategy<Value = ChunkedCase> {
    (
        prop::collection::vec(chunk(), 0..4),
        select(vec!["", "x-sum: 1\r\n", "x-sum 1\r\n", "x-sum: a\x00\r\n"]),
        prop_oneof![6 => Just("\r\n"), 1 => Just("\n"), 1 => Just("")],
        select(vec!["", "GET /after HTTP/1.1\r\nHost: a\r\n\r\n"]),
        prop::collection::vec(0usize..160, 0..3),
    )
        .prop_map(|(chunks, trailer, last_end, then, cuts)| ChunkedCase {
            chunks,
            trailer,
            last_end,
            then,
            cuts,
        })
}

#[test]
fn mutated_chunked_framing_leaves_later_clients_unharmed() {
    let runtime = runtime();
    let cases = std::sync::atomic::AtomicU32::new(0);
    runner(400, 2)
        .run(&chunked_case(), |case| {
            let n = cases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            runtime
                .block_on(request_case(
                    case.bytes(),
                    case.cuts.clone(),
                    &format!("chunked-{n}"),
                ))
                .map_err(fail)
        })
        .unwrap();
    eprintln!("{} cases", cases.into_inner());
}

// (c) Backend responses.

#[derive(Debug, Clone)]
struct ResponseCase {
    head_request: bool,
    status: &'static str,
    fields: Vec<&'static str>,
    line_end: &'static str,
    body: &'static str,
    extra: &'static str,
    extra_later: bool,
    close: bool,
}

impl ResponseCase {
    fn reply(&self) -> Reply {
        let mut head = format!("{}{}", self.status, self.line_end);
        for field in &self.fields {
            head.push_str(field);
            head.push_str(self.line_end);
        }
        head.push_str(self.line_end);
        head.push_str(self.body);
        let reply = if self.extra_later {
            Reply::owned(vec![
                (0, head.into_bytes()),
                (40, self.extra.as_bytes().to_vec()),
            ])
        } else {
            head.push_str(self.extra);
            Reply::raw(head)
        };
        if self.close { reply.close() } else { reply }
    }
}

fn response_case() -> impl Strategy<Value = ResponseCase> {
    (
        prop_oneof![3 => Just(false), 1 => Just(true)],
        select(vec![
            "HTTP/1.1 200 OK",
            "HTTP/1.1 200 OK",
            "HTTP/1.0 200 OK",
            "HTTP/1.1 204 No Content",
            "HTTP/1.1 304 Not Modified",
            "HTTP/1.1 101 Switching Protocols",
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK",
            "HTTP/1.1 103 Early Hints\r\n\r\nHTTP/1.1 200 OK",
            "HTTP/1.1 2000 OK",
            "HTTP/1.1 200",
            "HTTX/1.1 200 OK",
        ]),
        prop::collection::vec(
            select(vec![
                "content-length: 4",
                "content-length: 4",
                "content-length: 40",
                "content-length: 0",
                "content-length: 4, 4",
                "content-length: -4",
                "content-length : 4",
                "transfer-encoding: chunked",
                "transfer-encoding: gzip",
                "connection: close",
                "connection: keep-alive",
                "x-other: 1",
            ]),
            0..4,
        ),
        prop_oneof![8 => Just("\r\n"), 1 => Just("\n")],
        select(vec!["", "body", "4\r\nbody\r\n0\r\n\r\n"]),
        select(vec![
            "",
            "HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nMARKED",
            "MARKED",
            "6\r\nMARKED\r\n0\r\n\r\n",
        ]),
        any::<bool>(),
        prop_oneof![3 => Just(false), 1 => Just(true)],
    )
        .prop_map(
            |(head_request, status, fields, line_end, body, extra, extra_later, close)| {
                ResponseCase {
                    head_request,
                    status,
                    fields,
                    line_end,
                    body,
                    extra,
                    extra_later,
                    close,
                }
            },
        )
}

async fn response_case_run(case: ResponseCase, tag: String) -> Result<(), String> {
    let (router, backend) = setup(Script::default().path("/f", case.reply())).await;
    let mut client = Client::connect(router.addr).await?;
    let request: &[u8] = if case.head_request {
        b"HEAD /f HTTP/1.1\r\nHost: a\r\n\r\n"
    } else {
        b"GET /f HTTP/1.1\r\nHost: a\r\n\r\n"
    };
    client.send(request).await?;
    client.limit = Duration::from_millis(700);
    let answer = client.read_response(case.head_request).await;
    // Bytes a backend sends late reach the router's idle connection before the next request.
    tokio::time::sleep(Duration::from_millis(100)).await;
    client.limit = LIMIT;
    if let Ok(answer) = answer {
        let clean = answer.complete && answer.status >= 200 && !client.ended;
        let closing = answer
            .header("connection")
            .is_some_and(|value| value.eq_ignore_ascii_case("close"));
        if clean && !closing {
            let path = format!("{CANARY}{tag}-same");
            client.send(&canary_request(&path)).await?;
            let got = client.read_response(false).await?;
            if got.status != 200 || got.body != path.as_bytes() {
                return Err(format!(
                    "the canary on the same connection got {} {:?}",
                    got.status,
                    lossy(&got.body)
                ));
            }
        }
    }
    drop(client);
    after_case(&router, &backend, &tag).await
}

#[test]
fn mutated_backend_responses_reach_no_other_client() {
    let runtime = runtime();
    let cases = std::sync::atomic::AtomicU32::new(0);
    runner(120, 3)
        .run(&response_case(), |case| {
            let n = cases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            runtime
                .block_on(response_case_run(case, format!("response-{n}")))
                .map_err(fail)
        })
        .unwrap();
    eprintln!("{} cases", cases.into_inner());
}
