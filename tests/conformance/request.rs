//! Request-side vectors (client → router → backend): smuggling forms, request framing
//! (`Content-Length`, `Transfer-Encoding`, chunked syntax, pipelining) and header rules
//! (`Host`, underscores, hop-by-hop fields, malformed heads, versions, methods).

use crate::harness::*;

/// `text` as bytes.
fn b(text: &str) -> Vec<u8> {
    text.as_bytes().to_vec()
}

/// Refused with `status`, the connection closed, nothing proxied.
fn refused(id: &str, request: impl AsRef<[u8]>, status: u16) -> Vector {
    vector(id, vec![send(request), expect(resp(status)), Step::Closed]).nothing()
}

/// Proxied as `line` with `body`; the client gets the backend's answer (its path) and the
/// connection serves a canary after it.
fn accepted(id: &str, request: impl AsRef<[u8]>, line: &str, body: &[u8]) -> Vector {
    let path = line.split(' ').nth(1).unwrap_or("/");
    vector(
        id,
        vec![send(request), expect(resp(200).body(path)), Step::Canary],
    )
    .requests(vec![req(line).body(body)])
}

/// Either refused with 400 or 501 (nothing proxied), or proxied as `line` with exactly `body`
/// and no second request.
fn refused_or(id: &str, request: impl AsRef<[u8]>, line: &str, body: &[u8]) -> Vector {
    let path = line.split(' ').nth(1).unwrap_or("/");
    vector(
        id,
        vec![
            send(request),
            Step::RefusedOr(vec![400, 501], resp(200).body(path)),
        ],
    )
    .requests(vec![req(line).body(body)])
    .forbid("/smuggled")
}

/// A chunked POST to `path` whose body is `chunked` (the bytes after the head).
fn chunked_post(path: &str, chunked: &str) -> Vec<u8> {
    b(&format!(
        "POST {path} HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n{chunked}"
    ))
}

/// A POST to `path` with `Content-Length: {length}` written as given, and `body`.
fn cl_post(path: &str, length: &str, body: &str) -> Vec<u8> {
    b(&format!(
        "POST {path} HTTP/1.1\r\nHost: a\r\nContent-Length: {length}\r\n\r\n{body}"
    ))
}

const SMUGGLED_GET: &str = "GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n";

pub fn smuggling() -> Vec<Vector> {
    let mut vectors = vec![
        // CL.TE: a front end reading Content-Length would forward the smuggled request.
        refused(
            "smug-cl-te",
            b(&format!(
                "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{SMUGGLED_GET}",
                5 + SMUGGLED_GET.len()
            )),
            400,
        ),
        // TE.CL: a back end reading Content-Length would see the chunk data as a request.
        refused(
            "smug-te-cl",
            b(&format!(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n{:x}\r\n{SMUGGLED_GET}\r\n0\r\n\r\n",
                SMUGGLED_GET.len()
            )),
            400,
        ),
        refused(
            "smug-te-cl-zero",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            400,
        ),
        refused(
            "smug-cl-te-http10",
            b(
                "POST /x HTTP/1.0\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            ),
            400,
        ),
        refused(
            "smug-te-tab-with-cl",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\tchunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
            ),
            400,
        ),
        // Two Transfer-Encoding fields: which one a peer reads is anybody's guess.
        refused(
            "smug-te-te-x",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            400,
        ),
        refused(
            "smug-te-te-x-with-cl",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n\r\nhello",
            ),
            400,
        ),
        refused(
            "smug-te-x-te-chunked",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            400,
        ),
        refused(
            "smug-cl-cl-differ",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 40\r\n\r\nhello",
            ),
            400,
        ),
        refused(
            "smug-cl-list-differ",
            b("POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 40\r\n\r\nhello"),
            400,
        ),
        // nginx reads leading zeros as the number.
        accepted(
            "smug-cl-leading-zeros",
            cl_post("/x", "005", "hello"),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        // A field name with an underscore is dropped: only Content-Length frames the body.
        accepted(
            "smug-te-underscore-with-cl",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer_Encoding: chunked\r\nContent-Length: 5\r\n\r\nhello",
            ),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        // TE.TE obfuscations: refused, or read as exactly one framing.
        refused_or(
            "smug-te-space-before-colon",
            b(&format!(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n{SMUGGLED_GET}"
            )),
            "POST /x HTTP/1.1",
            b"0\r\n\r\n",
        ),
        refused_or(
            "smug-te-xchunked-with-cl",
            b(&format!(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n{SMUGGLED_GET}"
            )),
            "POST /x HTTP/1.1",
            b"0\r\n\r\n",
        ),
        refused_or(
            "smug-te-tab",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\tchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        refused_or(
            "smug-te-trailing-space",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked \r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        refused_or(
            "smug-te-uppercase",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: CHUNKED\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        refused_or(
            "smug-te-folded",
            b(&format!(
                "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n{SMUGGLED_GET}"
            )),
            "POST /x HTTP/1.1",
            b"0\r\n\r\n",
        ),
        refused_or(
            "smug-te-vertical-tab",
            b(&format!(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\x0bchunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n{SMUGGLED_GET}"
            )),
            "POST /x HTTP/1.1",
            b"0\r\n\r\n",
        ),
        refused_or(
            "smug-te-leading-comma",
            b(&format!(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: ,chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n{SMUGGLED_GET}"
            )),
            "POST /x HTTP/1.1",
            b"0\r\n\r\n",
        ),
        refused_or(
            "smug-te-quoted",
            b(&format!(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: \"chunked\"\r\nContent-Length: 5\r\n\r\n0\r\n\r\n{SMUGGLED_GET}"
            )),
            "POST /x HTTP/1.1",
            b"0\r\n\r\n",
        ),
        refused_or(
            "smug-te-nul",
            b(&format!(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\x00\r\nContent-Length: 5\r\n\r\n0\r\n\r\n{SMUGGLED_GET}"
            )),
            "POST /x HTTP/1.1",
            b"0\r\n\r\n",
        ),
        refused_or(
            "smug-te-name-bare-cr",
            b(&format!(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding\r: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n{SMUGGLED_GET}"
            )),
            "POST /x HTTP/1.1",
            b"0\r\n\r\n",
        ),
        // Bare LF line ends in the head (nginx reads them); one framing either way.
        refused_or(
            "smug-bare-lf-head",
            b("POST /x HTTP/1.1\nHost: a\nContent-Length: 5\n\nhello"),
            "POST /x HTTP/1.1",
            b"hello",
        ),
    ];
    // The smuggled part of a CL.TE request arrives in a later segment.
    vectors.push(
        vector(
            "smug-cl-te-split",
            vec![
                send(b("POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")),
                Step::Wait(40),
                send(SMUGGLED_GET),
                expect(resp(400)),
                Step::Closed,
            ],
        )
        .nothing(),
    );
    vectors
}

pub fn framing() -> Vec<Vector> {
    let mut vectors = vec![
        refused(
            "frame-te-http10",
            b("POST /x HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-te-gzip",
            b("POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\nhello"),
            501,
        ),
        refused(
            "frame-te-gzip-chunked",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            501,
        ),
        refused(
            "frame-te-chunked-identity",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            501,
        ),
        refused(
            "frame-te-xchunked",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            501,
        ),
        refused(
            "frame-te-identity",
            b("POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity\r\n\r\nhello"),
            501,
        ),
        refused(
            "frame-te-two-chunked",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            400,
        ),
        refused(
            "frame-cl-te",
            b(
                "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            400,
        ),
        refused(
            "frame-cl-dup-same",
            b("POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello"),
            400,
        ),
        refused("frame-cl-list", cl_post("/x", "5,5", "hello"), 400),
        refused("frame-cl-list-space", cl_post("/x", "5, 5", "hello"), 400),
        refused("frame-cl-negative", cl_post("/x", "-1", "hello"), 400),
        refused("frame-cl-plus", cl_post("/x", "+5", "hello"), 400),
        refused("frame-cl-suffix", cl_post("/x", "5a", "hello"), 400),
        refused("frame-cl-empty", cl_post("/x", "", "hello"), 400),
        // nginx reads any run of digits whose value fits; a 20-digit length is refused here, the
        // safer outcome (parsers that stop at 19 digits would read a different length).
        refused(
            "frame-cl-20-digits",
            cl_post("/x", "00000000000000000005", "hello"),
            400,
        ),
        refused("frame-cl-hex", cl_post("/x", "0x5", "hello"), 400),
        refused(
            "frame-cl-huge",
            cl_post("/x", "99999999999999999999", "hello"),
            400,
        ),
        refused(
            "frame-chunk-leading-space",
            chunked_post("/x", " 5\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-ext-bare-cr",
            chunked_post("/x", "5;a\rb\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-17-digits",
            chunked_post("/x", "10000000000000005\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-17-digits-max",
            chunked_post("/x", "fffffffffffffffff\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-data-longer",
            chunked_post("/x", "5\r\nhelloXX\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-missing-crlf",
            chunked_post("/x", "5\r\nhello0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-0x",
            chunked_post("/x", "0x5\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-negative",
            chunked_post("/x", "-5\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-empty-size",
            chunked_post("/x", "\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-plus",
            chunked_post("/x", "+5\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-not-hex",
            chunked_post("/x", "5g\r\nhello\r\n0\r\n\r\n"),
            400,
        ),
        refused(
            "frame-chunk-line-too-long",
            chunked_post(
                "/x",
                &format!("5;{}\r\nhello\r\n0\r\n\r\n", "a".repeat(8 * 1024)),
            ),
            400,
        ),
        accepted(
            "frame-chunk-16-digits",
            chunked_post("/x", "0000000000000005\r\nhello\r\n0\r\n\r\n"),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        accepted(
            "frame-chunk-bare-lf",
            chunked_post("/x", "5\nhello\n0\n\n"),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        accepted(
            "frame-chunk-ext",
            chunked_post("/x", "5;name=value;q=\"a b\"\r\nhello\r\n0\r\n\r\n"),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        accepted(
            "frame-chunk-trailers",
            chunked_post("/x", "5\r\nhello\r\n0\r\nx-sum: 1\r\n\r\n"),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        // Trailer fields that frame, route or belong to the hop do not reach the backend; the
        // trailer's own field does.
        vector(
            "frame-chunk-trailer-framing-fields",
            vec![
                send(chunked_post(
                    "/x",
                    "5\r\nhello\r\n0\r\nx-sum: 1\r\nConnection: close\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\nHost: elsewhere\r\n\r\n",
                )),
                expect(resp(200).body("/x")),
                Step::Canary,
            ],
        )
        .requests(vec![req("POST /x HTTP/1.1").body(b"hello").trailers(&["x-sum"])])
        // Streamed through (not read into memory for a retry), so it goes out chunked, with
        // the trailers the router passes on.
        .config(|config| config.retry.body_limit = 4),
        // A Content-Length in the trailers frames nothing.
        accepted(
            "frame-chunk-trailer-content-length",
            chunked_post("/x", "5\r\nhello\r\n0\r\nContent-Length: 40\r\n\r\n"),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        accepted(
            "frame-chunk-uppercase-hex",
            chunked_post("/x", "A\r\n0123456789\r\n0\r\n\r\n"),
            "POST /x HTTP/1.1",
            b"0123456789",
        ),
        accepted(
            "frame-chunk-many",
            chunked_post("/x", "1\r\nh\r\n1\r\ne\r\n3\r\nllo\r\n0\r\n\r\n"),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        accepted(
            "frame-cl-zero",
            cl_post("/x", "0", ""),
            "POST /x HTTP/1.1",
            b"",
        ),
        accepted(
            "frame-cl-plain",
            cl_post("/x", "5", "hello"),
            "POST /x HTTP/1.1",
            b"hello",
        ),
        accepted(
            "frame-leading-empty-line",
            b("\r\nGET /x HTTP/1.1\r\nHost: a\r\n\r\n"),
            "GET /x HTTP/1.1",
            b"",
        ),
    ];
    // Bodies in several writes, later segments.
    vectors.push(
        vector(
            "frame-chunked-split-writes",
            vec![
                send(chunked_post("/x", "5\r\nhel")),
                Step::Wait(30),
                send("lo\r\n6\r\n wor"),
                Step::Wait(30),
                send("ld\r\n0\r\n"),
                Step::Wait(30),
                send("\r\n"),
                expect(resp(200).body("/x")),
                Step::Canary,
            ],
        )
        .requests(vec![req("POST /x HTTP/1.1").body("hello world")]),
    );
    vectors.push(
        vector(
            "frame-cl-split-writes",
            vec![
                send(cl_post("/x", "11", "hel")),
                Step::Wait(30),
                send("lo wo"),
                Step::Wait(30),
                send("rld"),
                expect(resp(200).body("/x")),
                Step::Canary,
            ],
        )
        .requests(vec![req("POST /x HTTP/1.1").body("hello world")]),
    );
    vectors.push(
        vector(
            "frame-head-split-writes",
            vec![
                send("GET /x HT"),
                Step::Wait(30),
                send("TP/1.1\r\nHo"),
                Step::Wait(30),
                send("st: a\r\n\r"),
                Step::Wait(30),
                send("\n"),
                expect(resp(200).body("/x")),
                Step::Canary,
            ],
        )
        .requests(vec![req("GET /x HTTP/1.1")]),
    );
    // Pipelining: answers in order, each request seen on its own.
    vectors.push(
        vector(
            "frame-pipelined-gets",
            vec![
                send("GET /p1 HTTP/1.1\r\nHost: a\r\n\r\nGET /p2 HTTP/1.1\r\nHost: a\r\n\r\nGET /p3 HTTP/1.1\r\nHost: a\r\n\r\n"),
                expect(resp(200).body("/p1")),
                expect(resp(200).body("/p2")),
                expect(resp(200).body("/p3")),
                Step::Canary,
            ],
        )
        .requests(vec![
            req("GET /p1 HTTP/1.1"),
            req("GET /p2 HTTP/1.1"),
            req("GET /p3 HTTP/1.1"),
        ]),
    );
    vectors.push(
        vector(
            "frame-pipelined-mixed",
            vec![
                send("POST /p1 HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabcPOST /p2 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nde\r\n0\r\n\r\nGET /p3 HTTP/1.1\r\nHost: a\r\n\r\n"),
                expect(resp(200).body("/p1")),
                expect(resp(200).body("/p2")),
                expect(resp(200).body("/p3")),
                Step::Canary,
            ],
        )
        .requests(vec![
            req("POST /p1 HTTP/1.1").body("abc"),
            req("POST /p2 HTTP/1.1").body("de"),
            req("GET /p3 HTTP/1.1").body(""),
        ]),
    );
    // A body longer than its Content-Length: the rest is the next request.
    vectors.push(
        vector(
            "frame-body-longer-than-cl",
            vec![
                send("POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhelloGET /b HTTP/1.1\r\nHost: a\r\n\r\n"),
                expect(resp(200).body("/a")),
                expect(resp(200).body("/b")),
                Step::Canary,
            ],
        )
        .requests(vec![req("POST /a HTTP/1.1").body("hello"), req("GET /b HTTP/1.1")]),
    );
    vectors.push(
        vector(
            "frame-pipelined-later-segment",
            vec![
                send("GET /p1 HTTP/1.1\r\nHost: a\r\n\r\nGET /p2 HT"),
                Step::Wait(40),
                send("TP/1.1\r\nHost: a\r\n\r\n"),
                expect(resp(200).body("/p1")),
                expect(resp(200).body("/p2")),
            ],
        )
        .requests(vec![req("GET /p1 HTTP/1.1"), req("GET /p2 HTTP/1.1")]),
    );
    // Expect: 100-continue: the interim answer, then the final one.
    vectors.push(
        vector(
            "frame-expect-continue",
            vec![
                send("POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"),
                expect(resp(100)),
                send("hello"),
                expect(resp(200).body("/x")),
                Step::Canary,
            ],
        )
        .requests(vec![req("POST /x HTTP/1.1").body("hello")]),
    );
    // HTTP/1.0 has no interim answers (RFC 9110 §10.1.1): the expectation is ignored, and the
    // first answer the client reads is the final one.
    vectors.push(
        vector(
            "frame-expect-continue-http10",
            vec![
                send("POST /x HTTP/1.0\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"),
                Step::Wait(40),
                send("hello"),
                expect(resp(200).body("/x")),
                Step::Closed,
            ],
        )
        .requests(vec![req("POST /x HTTP/1.1").body("hello")]),
    );
    // Bodies past the size read whole before proxying (2 MiB streams).
    let large: Vec<u8> = (0..2 * 1024 * 1024)
        .map(|i| b'a' + (i % 26) as u8)
        .collect();
    let mut request = b(&format!(
        "POST /big HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n",
        large.len()
    ));
    request.extend_from_slice(&large);
    vectors.push(
        vector(
            "frame-large-streamed",
            vec![send(request), expect(resp(200).body("/big")), Step::Canary],
        )
        .requests(vec![req("POST /big HTTP/1.1").body(&large)]),
    );
    let mut chunked = b("POST /big HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n");
    for piece in large[..200 * 1024].chunks(7000) {
        chunked.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        chunked.extend_from_slice(piece);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    vectors.push(
        vector(
            "frame-large-chunked",
            vec![send(chunked), expect(resp(200).body("/big")), Step::Canary],
        )
        .requests(vec![req("POST /big HTTP/1.1").body(&large[..200 * 1024])]),
    );
    vectors
}

pub fn headers() -> Vec<Vector> {
    let mut vectors = vec![
        refused("hdr-no-host", "GET /x HTTP/1.1\r\n\r\n", 400),
        refused(
            "hdr-two-hosts",
            "GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            400,
        ),
        refused(
            "hdr-two-hosts-same",
            "GET /x HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n",
            400,
        ),
        refused(
            "hdr-space-before-colon",
            "GET /x HTTP/1.1\r\nHost: a\r\nX-A : 1\r\n\r\n",
            400,
        ),
        refused(
            "hdr-obs-fold",
            "GET /x HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n 2\r\n\r\n",
            400,
        ),
        refused(
            "hdr-nul-in-value",
            "GET /x HTTP/1.1\r\nHost: a\r\nX-A: a\x00b\r\n\r\n",
            400,
        ),
        refused("hdr-bad-method", "G(T /x HTTP/1.1\r\nHost: a\r\n\r\n", 400),
        refused("hdr-http12", "GET /x HTTP/1.2\r\nHost: a\r\n\r\n", 400),
        refused("hdr-http20", "GET /x HTTP/2.0\r\nHost: a\r\n\r\n", 400),
        refused(
            "hdr-http-lowercase",
            "GET /x http/1.1\r\nHost: a\r\n\r\n",
            400,
        ),
        refused(
            "hdr-no-colon",
            "GET /x HTTP/1.1\r\nHost: a\r\nX-A\r\n\r\n",
            400,
        ),
        refused(
            "hdr-space-in-name",
            "GET /x HTTP/1.1\r\nHost: a\r\nX A: 1\r\n\r\n",
            400,
        ),
        refused(
            "hdr-empty-name",
            "GET /x HTTP/1.1\r\nHost: a\r\n: 1\r\n\r\n",
            400,
        ),
        refused(
            "hdr-double-space-request-line",
            "GET  /x HTTP/1.1\r\nHost: a\r\n\r\n",
            400,
        ),
        refused(
            "hdr-tab-request-line",
            "GET\t/x HTTP/1.1\r\nHost: a\r\n\r\n",
            400,
        ),
        refused("hdr-no-version", "GET /x\r\nHost: a\r\n\r\n", 400),
        refused(
            "hdr-head-too-large",
            format!(
                "GET /x HTTP/1.1\r\nHost: a\r\nX-Big: {}\r\n\r\n",
                "a".repeat(70 * 1024)
            ),
            431,
        ),
        accepted(
            "hdr-http10-no-host",
            "GET /h10 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
            "GET /h10 HTTP/1.1",
            b"",
        ),
        // Request-target forms (RFC 9112 §3.2): authority form is for CONNECT only, asterisk
        // form for OPTIONS only (nginx: 400); absolute form goes on in origin form.
        refused(
            "hdr-authority-form-get",
            "GET example.test:80 HTTP/1.1\r\nHost: a\r\n\r\n",
            400,
        ),
        refused(
            "hdr-authority-form-bare-name",
            "POST localhost HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
            400,
        ),
        // A Host nginx would refuse (`ngx_http_validate_host`): the value reaches the backend
        // as it is.
        refused(
            "hdr-host-slash",
            "GET /x HTTP/1.1\r\nHost: a/../b\r\n\r\n",
            400,
        ),
        refused(
            "hdr-host-dot-dot",
            "GET /x HTTP/1.1\r\nHost: a..b\r\n\r\n",
            400,
        ),
        refused(
            "hdr-host-space",
            "GET /x HTTP/1.1\r\nHost: a b\r\n\r\n",
            400,
        ),
        refused("hdr-host-empty", "GET /x HTTP/1.1\r\nHost: \r\n\r\n", 400),
        refused(
            "hdr-host-port-only",
            "GET /x HTTP/1.1\r\nHost: :80\r\n\r\n",
            400,
        ),
        accepted(
            "hdr-host-ipv6-port",
            "GET /x HTTP/1.1\r\nHost: [::1]:3000\r\n\r\n",
            "GET /x HTTP/1.1",
            b"",
        ),
        refused("hdr-asterisk-get", "GET * HTTP/1.1\r\nHost: a\r\n\r\n", 400),
        accepted(
            "hdr-asterisk-options",
            "OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
            "OPTIONS * HTTP/1.1",
            b"",
        ),
        accepted(
            "hdr-absolute-form",
            "GET http://example.test/x?q=1 HTTP/1.1\r\nHost: example.test\r\n\r\n",
            "GET /x?q=1 HTTP/1.1",
            b"",
        ),
        accepted(
            "hdr-utf8-value",
            "GET /x HTTP/1.1\r\nHost: a\r\nX-Name: caf\u{e9}\r\n\r\n",
            "GET /x HTTP/1.1",
            b"",
        ),
    ];
    // The answer need not end the connection: only a tunnel would follow, and none is opened.
    vectors.push(
        vector(
            "hdr-connect",
            vec![
                send("CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"),
                expect(resp(405)),
            ],
        )
        .nothing(),
    );
    vectors.push(
        vector(
            "hdr-too-many-fields",
            vec![
                send(format!(
                    "GET /x HTTP/1.1\r\nHost: a\r\n{}\r\n",
                    (0..150)
                        .map(|i| format!("X-F{i}: {i}\r\n"))
                        .collect::<String>()
                )),
                // nginx has no count limit (only a size one); a refusal is as safe.
                Step::RefusedOr(vec![400, 431], resp(200).body("/x")),
            ],
        )
        .requests(vec![req("GET /x HTTP/1.1")]),
    );
    // Underscores in field names.
    vectors.push(
        vector(
            "hdr-underscore-dropped",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\nX_Api: 1\r\nX-Api: 2\r\n\r\n"),
                expect(resp(200).body("/x")),
                Step::Canary,
            ],
        )
        .requests(vec![
            req("GET /x HTTP/1.1").has("x-api", "2").lacks(&["x_api"]),
        ]),
    );
    vectors.push(
        vector(
            "hdr-underscore-te-dropped",
            vec![
                send("POST /x HTTP/1.1\r\nHost: a\r\nTransfer_Encoding: chunked\r\nContent-Length: 5\r\n\r\nhello"),
                expect(resp(200).body("/x")),
                Step::Canary,
            ],
        )
        .requests(vec![req("POST /x HTTP/1.1").body("hello").lacks(&["transfer_encoding"])]),
    );
    vectors.push(
        vector(
            "hdr-underscore-allowed",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\nX_Api: 1\r\n\r\n"),
                expect(resp(200).body("/x")),
                Step::Canary,
            ],
        )
        .config(|config| config.limits.allow_underscore_headers = true)
        .requests(vec![req("GET /x HTTP/1.1").has("x_api", "1")]),
    );
    // HTTP/1.0 keep-alive: said in the answer, and the connection serves another request.
    vectors.push(
        vector(
            "hdr-http10-keep-alive",
            vec![
                send("GET /x HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n"),
                expect(resp(200).body("/x").header("connection", "keep-alive")),
                send("GET /y HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n"),
                expect(resp(200).body("/y").header("connection", "keep-alive")),
            ],
        )
        .requests(vec![req("GET /x HTTP/1.1"), req("GET /y HTTP/1.1")]),
    );
    vectors.push(
        vector(
            "hdr-http10-closes",
            vec![
                send("GET /x HTTP/1.0\r\nHost: a\r\n\r\n"),
                expect(resp(200).body("/x")),
                Step::Closed,
            ],
        )
        .requests(vec![req("GET /x HTTP/1.1")]),
    );
    vectors.push(
        vector(
            "hdr-connection-close",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"),
                expect(resp(200).body("/x").header("connection", "close")),
                Step::Closed,
            ],
        )
        .requests(vec![req("GET /x HTTP/1.1")]),
    );
    // Hop-by-hop fields stay on the client's hop.
    vectors.push(
        vector(
            "hdr-hop-by-hop",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, X-Named\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nUpgrade: websocket\r\nProxy-Connection: keep-alive\r\nX-Named: secret\r\nX-Kept: yes\r\n\r\n"),
                expect(resp(200).body("/x")),
                Step::Canary,
            ],
        )
        .requests(vec![req("GET /x HTTP/1.1")
            .has("x-kept", "yes")
            .lacks(&["keep-alive", "te", "upgrade", "proxy-connection", "x-named"])]),
    );
    vectors.push(
        vector(
            "hdr-connection-not-forwarded",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\nConnection: X-Other\r\nX-Other: 1\r\n\r\n"),
                expect(resp(200).body("/x")),
            ],
        )
        .requests(vec![req("GET /x HTTP/1.1").lacks(&["x-other"])]),
    );
    vectors.push(
        vector(
            "hdr-upgrade-h2c-dropped",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"),
                expect(resp(200).body("/x")),
                Step::Canary,
            ],
        )
        .requests(vec![req("GET /x HTTP/1.1").lacks(&["upgrade", "http2-settings"])]),
    );
    vectors.push(
        vector(
            "hdr-xff-added",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\n\r\n"),
                expect(resp(200).body("/x")),
            ],
        )
        .requests(vec![
            req("GET /x HTTP/1.1").has("x-forwarded-for", "127.0.0.1"),
        ]),
    );
    vectors.push(
        vector(
            "hdr-xff-appended",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 1.2.3.4\r\n\r\n"),
                expect(resp(200).body("/x")),
            ],
        )
        .requests(vec![
            req("GET /x HTTP/1.1").has("x-forwarded-for", "1.2.3.4, 127.0.0.1"),
        ]),
    );
    vectors.push(
        vector(
            "hdr-xff-twice",
            vec![
                send("GET /x HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 1.1.1.1\r\nX-Forwarded-For: 2.2.2.2\r\n\r\n"),
                expect(resp(200).body("/x")),
            ],
        )
        .requests(vec![req("GET /x HTTP/1.1").has("x-forwarded-for", "1.1.1.1, 2.2.2.2, 127.0.0.1")]),
    );
    vectors.push(
        vector(
            "hdr-host-forwarded",
            vec![
                send("GET /x HTTP/1.1\r\nHost: example.test\r\nX-A: 1\r\n\r\n"),
                expect(resp(200).body("/x")),
            ],
        )
        .requests(vec![
            req("GET /x HTTP/1.1")
                .has("host", "example.test")
                .has("x-a", "1"),
        ]),
    );
    vectors.push(
        vector(
            "hdr-head-request",
            vec![
                send("HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n"),
                expect(resp(200).for_head().header("content-length", "2")),
                Step::Canary,
            ],
        )
        .requests(vec![req("HEAD /x HTTP/1.1")]),
    );
    vectors.push(
        vector(
            "hdr-long-value",
            vec![
                send(format!(
                    "GET /x HTTP/1.1\r\nHost: a\r\nX-Long: {}\r\n\r\n",
                    "v".repeat(8000)
                )),
                expect(resp(200).body("/x")),
            ],
        )
        .requests(vec![
            req("GET /x HTTP/1.1").has("x-long", &"v".repeat(8000)),
        ]),
    );
    vectors
}
