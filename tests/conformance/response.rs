//! Response-side vectors (backend → router → client): desynchronisation attempts (bytes after
//! a complete response, bodies on bodiless responses, unsolicited responses, a backend that
//! ignores request bodies) and response framing (lengths, transfer codings, malformed heads,
//! truncated bodies, interim responses, trailers, early answers).

use crate::harness::*;

/// A complete response carrying the marker `POISON`: if it ever reaches a client, the router
/// took bytes a backend sent outside an exchange as an answer.
const POISON: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nPOISON";

/// How long a client waits after its answer before its next request, so that bytes a backend
/// sends late have reached the router's idle connection first.
const SETTLE: u64 = 120;

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// `GET /x` answered by `reply`; the client expects `want`, waits, and sends a canary on the same
/// connection. `POISON` must never reach a client.
fn desync(id: &str, request: &str, reply: Reply, want: Resp) -> Vector {
    vector(
        id,
        vec![
            send(request),
            expect(want),
            Step::Wait(SETTLE),
            Step::Canary,
        ],
    )
    .script(Script::default().path("/x", reply))
    .forbid("POISON")
}

const GET_X: &str = "GET /x HTTP/1.1\r\nHost: a\r\n\r\n";
const HEAD_X: &str = "HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n";

/// `head` and `POISON` in one write (`later`: `POISON` 40 ms after).
fn with_poison(head: &[u8], later: bool) -> Reply {
    if later {
        Reply::owned(vec![(0, head.to_vec()), (40, POISON.to_vec())])
    } else {
        Reply::raw(cat(&[head, POISON]))
    }
}

pub fn desyncs() -> Vec<Vector> {
    let mut vectors = Vec::new();
    for (later, when) in [(false, "same"), (true, "later")] {
        vectors.push(desync(
            &format!("resp-cl-extra-{when}"),
            GET_X,
            with_poison(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", later),
            resp(200).body("hello"),
        ));
        vectors.push(desync(
            &format!("resp-head-with-body-{when}"),
            HEAD_X,
            with_poison(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                    POISON.len()
                )
                .as_bytes(),
                later,
            ),
            resp(200).for_head(),
        ));
        vectors.push(desync(
            &format!("resp-204-with-body-{when}"),
            GET_X,
            with_poison(b"HTTP/1.1 204 No Content\r\n\r\n", later),
            resp(204),
        ));
        vectors.push(desync(
            &format!("resp-204-with-length-and-body-{when}"),
            GET_X,
            with_poison(
                format!(
                    "HTTP/1.1 204 No Content\r\ncontent-length: {}\r\n\r\n",
                    POISON.len()
                )
                .as_bytes(),
                later,
            ),
            resp(204),
        ));
        vectors.push(desync(
            &format!("resp-304-with-body-{when}"),
            GET_X,
            with_poison(b"HTTP/1.1 304 Not Modified\r\netag: \"a\"\r\n\r\n", later),
            resp(304),
        ));
        vectors.push(desync(
            &format!("resp-http10-keep-alive-stray-{when}"),
            GET_X,
            with_poison(
                b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 5\r\n\r\nhello",
                later,
            ),
            resp(200).body("hello"),
        ));
        vectors.push(desync(
            &format!("resp-chunked-extra-{when}"),
            GET_X,
            with_poison(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                later,
            ),
            resp(200).body("hello"),
        ));
        vectors.push(desync(
            &format!("resp-cl-zero-extra-{when}"),
            GET_X,
            with_poison(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", later),
            resp(200).body(""),
        ));
        // `do_HEAD = do_GET`: the HEAD answer carries the GET body, which looks like a response.
        vectors.push(
            vector(
                &format!("resp-head-as-get-{when}"),
                vec![send(HEAD_X), expect(resp(200).for_head())],
            )
            .script(Script::default().method("HEAD", {
                let page = b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nHIJACK!";
                let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", page.len());
                if later {
                    Reply::owned(vec![(0, head.into_bytes()), (40, page.to_vec())])
                } else {
                    Reply::raw(cat(&[head.as_bytes(), page]))
                }
            }))
            .then_client(vec![
                Step::Wait(SETTLE),
                send("GET /account HTTP/1.1\r\nHost: a\r\n\r\n"),
                expect(resp(200).body("/account")),
            ])
            .forbid("HIJACK"),
        );
    }
    for (later, when) in [(false, "same"), (true, "later")] {
        vectors.push(desync(
            &format!("resp-head-chunked-body-{when}"),
            HEAD_X,
            with_poison(
                format!(
                    "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n",
                    POISON.len()
                )
                .as_bytes(),
                later,
            ),
            resp(200).for_head(),
        ));
        // `Connection: close` said, the socket left open, then more bytes.
        vectors.push(desync(
            &format!("resp-connection-close-kept-open-{when}"),
            GET_X,
            with_poison(
                b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 5\r\n\r\nhello",
                later,
            ),
            resp(200).body("hello"),
        ));
    }
    // The end of the body and the extra bytes come together, in a later segment.
    vectors.push(desync(
        "resp-cl-extra-with-body-end-later",
        GET_X,
        Reply::owned(vec![
            (
                0,
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhel".to_vec(),
            ),
            (40, cat(&[b"lo", POISON])),
        ]),
        resp(200).body("hello"),
    ));
    vectors.push(desync(
        "resp-chunk-16-digits",
        GET_X,
        Reply::raw(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0000000000000005\r\nhello\r\n0\r\n\r\n",
        ),
        resp(200).body("hello"),
    ));
    // An HTTP/1.0 message with Transfer-Encoding has faulty framing (RFC 9112 §6.1): it is read,
    // and its connection closed, whatever `Connection` says.
    vectors.push(
        desync(
            "resp-http10-chunked-keep-alive",
            GET_X,
            Reply::raw(
                "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            ),
            resp(200).body("hello"),
        )
        .backend_closed_within(1000),
    );
    // A complete answer, then a whole unsolicited response on the idle connection.
    vectors.push(desync(
        "resp-unsolicited-after-idle",
        GET_X,
        Reply::pieces(&[
            (0, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
            (30, POISON),
        ]),
        resp(200).body("ok"),
    ));
    vectors.push(
        vector(
            "resp-unsolicited-next-client",
            vec![send(GET_X), expect(resp(200).body("ok"))],
        )
        .script(Script::default().path(
            "/x",
            Reply::pieces(&[
                (0, b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
                (30, POISON),
            ]),
        ))
        .then_client(vec![
            Step::Wait(SETTLE),
            send("GET /other HTTP/1.1\r\nHost: a\r\n\r\n"),
            expect(resp(200).body("/other")),
        ])
        .forbid("POISON"),
    );
    // A backend that answers a POST without reading its body, then reads the body as a request.
    let planted = "GET /planted HTTP/1.1\r\nHost: a\r\n\r\n";
    vectors.push(
        vector(
            "resp-backend-ignores-body",
            vec![
                send(format!(
                    "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n{planted}",
                    planted.len()
                )),
                expect(resp(200).body("posted")),
                Step::Wait(SETTLE),
                Step::Canary,
            ],
        )
        .script(
            Script::default()
                .path("/x", Reply::ok("posted").ignoring_body())
                .path("/planted", Reply::ok("PLANTED")),
        )
        .then_client(vec![
            send("GET /next HTTP/1.1\r\nHost: a\r\n\r\n"),
            expect(resp(200).body("/next")),
        ])
        .forbid("PLANTED"),
    );
    vectors.push(
        vector(
            "resp-backend-ignores-chunked-body",
            vec![
                send(format!(
                    "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{planted}\r\n0\r\n\r\n",
                    planted.len()
                )),
                expect(resp(200).body("posted")),
                Step::Wait(SETTLE),
                Step::Canary,
            ],
        )
        .script(
            Script::default()
                .path("/x", Reply::ok("posted").ignoring_body())
                .path("/planted", Reply::ok("PLANTED")),
        )
        .forbid("PLANTED"),
    );
    // Interim responses are skipped.
    let final_answer: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfinal";
    vectors.push(desync(
        "resp-interim-100",
        GET_X,
        Reply::raw(cat(&[b"HTTP/1.1 100 Continue\r\n\r\n", final_answer])),
        resp(200).body("final"),
    ));
    vectors.push(desync(
        "resp-interim-103",
        GET_X,
        Reply::pieces(&[
            (
                0,
                b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n",
            ),
            (30, final_answer),
        ]),
        resp(200).body("final"),
    ));
    vectors.push(desync(
        "resp-interim-100-103-split",
        GET_X,
        Reply::pieces(&[
            (0, b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 10"),
            (30, b"3 Early Hints\r\n\r\n"),
            (30, final_answer),
        ]),
        resp(200).body("final"),
    ));
    // Framings that end properly.
    vectors.push(
        vector(
            "resp-close-delimited",
            vec![
                send(GET_X),
                expect(resp(200).body("all of it, up to the close")),
            ],
        )
        .script(
            Script::default().path(
                "/x",
                Reply::pieces(&[
                    (0, b"HTTP/1.1 200 OK\r\n\r\nall of it, "),
                    (30, b"up to the close"),
                ])
                .close(),
            ),
        ),
    );
    vectors.push(
        vector(
            "resp-close-delimited-http10",
            vec![send(GET_X), expect(resp(200).body("old style"))],
        )
        .script(
            Script::default().path("/x", Reply::raw("HTTP/1.0 200 OK\r\n\r\nold style").close()),
        ),
    );
    vectors.push(desync(
        "resp-chunked-trailers",
        "GET /x HTTP/1.1\r\nHost: a\r\nTE: trailers\r\n\r\n",
        Reply::raw(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\nx-sum: 42\r\n\r\n",
        ),
        resp(200).body("hello world").trailer("x-sum", "42"),
    ));
    // Trailer fields that frame, route or belong to the hop are dropped; the trailer's own
    // field goes on.
    vectors.push(desync(
        "resp-chunked-trailers-framing-fields",
        "GET /x HTTP/1.1\r\nHost: a\r\nTE: trailers\r\n\r\n",
        Reply::raw(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\nx-sum: 42\r\nConnection: close\r\nKeep-Alive: timeout=5\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\nHost: elsewhere\r\n\r\n",
        ),
        resp(200)
            .body("hello world")
            .trailer("x-sum", "42")
            .no_trailer("connection")
            .no_trailer("keep-alive")
            .no_trailer("content-length")
            .no_trailer("transfer-encoding")
            .no_trailer("host"),
    ));
    vectors.push(desync(
        "resp-chunked-split-writes",
        GET_X,
        Reply::pieces(&[
            (
                0,
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel",
            ),
            (30, b"lo\r\n6;ext=1\r\n world\r"),
            (30, b"\n0\r\n"),
            (30, b"\r\n"),
        ]),
        resp(200).body("hello world"),
    ));
    vectors.push(desync(
        "resp-chunked-bare-lf",
        GET_X,
        Reply::raw("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\nhello\n0\n\n"),
        resp(200).body("hello"),
    ));
    // An early answer to an upload the backend does not read.
    let mut upload = format!(
        "POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n",
        2 * 1024 * 1024
    )
    .into_bytes();
    upload.extend(std::iter::repeat_n(b'u', 64 * 1024));
    vectors.push(
        vector("resp-early-413", vec![send(upload), expect(resp(413).body("too big!"))]).script(
            Script::default().path(
                "/upload",
                Reply::raw(
                    "HTTP/1.1 413 Payload Too Large\r\ncontent-length: 8\r\nconnection: close\r\n\r\ntoo big!",
                )
                .ignoring_body()
                .close(),
            ),
        ),
    );
    vectors
}

/// `GET /x` answered by `reply`; the client gets 502.
fn bad_gateway(id: &str, reply: Reply) -> Vector {
    vector(id, vec![send(GET_X), expect(resp(502))])
        .script(Script::default().path("/x", reply))
        .forbid("POISON")
}

/// `GET /x` answered by `reply`, whose body breaks after `sent` was relayed: the client gets
/// a body cut short and the connection ends.
fn cut_short(id: &str, reply: Reply, full: &str) -> Vector {
    vector(
        id,
        vec![send(GET_X), expect(resp(200).truncated(full)), Step::Closed],
    )
    .script(Script::default().path("/x", reply))
}

pub fn framings() -> Vec<Vector> {
    let mut too_many = b"HTTP/1.1 200 OK\r\n".to_vec();
    for i in 0..150 {
        too_many.extend_from_slice(format!("x-f{i}: {i}\r\n").as_bytes());
    }
    too_many.extend_from_slice(b"content-length: 2\r\n\r\nok");
    let mut too_large = b"HTTP/1.1 200 OK\r\nx-big: ".to_vec();
    too_large.extend(std::iter::repeat_n(b'a', 70 * 1024));
    too_large.extend_from_slice(b"\r\ncontent-length: 2\r\n\r\nok");
    vec![
        bad_gateway(
            "rframe-101-unrequested",
            Reply::raw(cat(&[
                b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
                POISON,
            ])),
        ),
        bad_gateway(
            "rframe-cl-differ",
            Reply::raw("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!"),
        ),
        bad_gateway(
            "rframe-cl-list-same",
            Reply::raw("HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\n\r\nhello"),
        ),
        // RFC 9112 lets a recipient read identical duplicates as one length; nginx (since 1.23)
        // refuses a duplicate Content-Length from a backend, the safer outcome taken here.
        bad_gateway(
            "rframe-cl-dup-same",
            Reply::raw("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\nhello"),
        ),
        bad_gateway(
            "rframe-cl-te",
            Reply::raw(cat(&[
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                POISON,
            ])),
        ),
        bad_gateway(
            "rframe-te-gzip",
            Reply::raw("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nnot really gzip"),
        ),
        bad_gateway(
            "rframe-cl-negative",
            Reply::raw("HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\nhello"),
        ),
        bad_gateway(
            "rframe-cl-plus",
            Reply::raw("HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\nhello"),
        ),
        bad_gateway(
            "rframe-cl-20-digits",
            Reply::raw("HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\nhello"),
        ),
        bad_gateway("rframe-status-words", Reply::raw("HTTP/1.1 abc\r\n\r\n")),
        bad_gateway(
            "rframe-status-four-digits",
            Reply::raw("HTTP/1.1 2000 OK\r\ncontent-length: 2\r\n\r\nok"),
        ),
        bad_gateway(
            "rframe-status-bad-version",
            Reply::raw("HTTX/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
        ),
        bad_gateway(
            "rframe-status-http2",
            Reply::raw("HTTP/2.0 200 OK\r\ncontent-length: 2\r\n\r\nok"),
        ),
        bad_gateway(
            "rframe-status-binary",
            Reply::raw(b"\x00\x01 not http at all\r\n\r\n"),
        ),
        bad_gateway(
            "rframe-space-before-colon",
            Reply::raw("HTTP/1.1 200 OK\r\ncontent-length : 2\r\n\r\nok"),
        ),
        bad_gateway(
            "rframe-nul-in-value",
            Reply::raw(b"HTTP/1.1 200 OK\r\nx-a: a\x00b\r\ncontent-length: 2\r\n\r\nok"),
        ),
        bad_gateway("rframe-head-too-large", Reply::raw(&too_large)),
        bad_gateway("rframe-too-many-fields", Reply::raw(&too_many)),
        bad_gateway("rframe-close-before-head", Reply::silent().close()),
        bad_gateway(
            "rframe-close-mid-head",
            Reply::raw("HTTP/1.1 200 OK\r\ncontent-le").close(),
        ),
        cut_short(
            "rframe-chunked-malformed",
            Reply::pieces(&[
                (0, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"),
                (40, b"zz\r\nbad\r\n0\r\n\r\n"),
            ]),
            "hello",
        ),
        cut_short(
            "rframe-chunked-data-longer",
            Reply::pieces(&[
                (0, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"),
                (40, b"3\r\nabcdef\r\n0\r\n\r\n"),
            ]),
            "helloabc",
        ),
        cut_short(
            "rframe-chunked-eof",
            Reply::pieces(&[
                (0, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"),
                (40, b"6\r\n wo"),
            ])
            .close(),
            "hello world",
        ),
        cut_short(
            "rframe-cl-eof",
            Reply::pieces(&[
                (0, b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello"),
                (40, b" wo"),
            ])
            .close(),
            "hello world",
        ),
        cut_short(
            "rframe-chunk-size-overflow",
            Reply::pieces(&[
                (0, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"),
                (40, b"10000000000000005\r\nhello\r\n0\r\n\r\n"),
            ]),
            "hello",
        ),
    ]
}
