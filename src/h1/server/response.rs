//! Writing an answer: its head encoded into the connection's write buffer (`Content-Length`,
//! chunked, or to the end of the connection; a `Date` when it has none; a plain-HTTP backend's
//! lines as it sent them), then its body frame by frame, frames ready at once in one write; and
//! the refusals the server writes itself.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::Poll;

use http::StatusCode;
use http::header;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::dates::http_date_now;
use crate::h1::{
    COALESCE, append_chunk, append_chunk_size, append_field, append_last_chunk, buffers, digits,
    parse_content_length, write_all_vectored,
};

use super::{Answer, Inbound, client_gone, still_watched};

/// A streamed body's frames that are ready at once are gathered into one write, up to this
/// many bytes (events that piled up while the connection waited for the CPU go out together, as
/// nginx's and HAProxy's buffers send them).
const MAX_BATCH: usize = 16 * 1024;

/// A refusal the server writes itself: `{"error": message}` with `status`, then the connection
/// closes.
pub(super) fn refusal(out: &mut Vec<u8>, status: StatusCode, message: &str) {
    let mut body = Vec::with_capacity(message.len() + 12);
    body.extend_from_slice(b"{\"error\":");
    json_string(&mut body, message);
    body.push(b'}');
    buffers::ensure_write(out);
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\ncontent-type: application/json\r\ncontent-length: ");
    out.extend_from_slice(digits::<10>(body.len() as u64).as_bytes());
    out.extend_from_slice(b"\r\nconnection: close\r\ndate: ");
    out.extend_from_slice(&http_date_now());
    out.extend_from_slice(b"\r\n\r\n");
    out.extend_from_slice(&body);
}

/// Appends `text` as a JSON string.
fn json_string(out: &mut Vec<u8>, text: &str) {
    out.push(b'"');
    for ch in text.chars() {
        match ch {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            ch if (ch as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", ch as u32).as_bytes());
            }
            ch => {
                let mut buffer = [0u8; 4];
                out.extend_from_slice(ch.encode_utf8(&mut buffer).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// What the request said about how its response is written.
#[derive(Debug, Clone, Copy)]
pub(super) struct Written {
    /// The request was `HEAD`: no body.
    pub(super) head_request: bool,
    /// The client speaks HTTP/1.0.
    pub(super) http10: bool,
    /// The connection ends after this response.
    pub(super) close: bool,
}

/// How a response body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outgoing {
    None,
    Length(u64),
    Chunked,
    Close,
}

/// Encodes the head of a response of `parts` and `body` into `out`; how its body is delimited,
/// and whether the connection ends after it.
pub(super) fn encode_response_head<B: Answer>(
    out: &mut Vec<u8>,
    parts: &http::response::Parts,
    body: &B,
    written: Written,
) -> (Outgoing, bool) {
    let Written {
        head_request,
        http10,
        mut close,
    } = written;
    let status = parts.status;
    let bodiless = head_request
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    buffers::ensure_write(out);
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut declared: Option<u64> = None;
    let mut dated = false;
    for (name, value) in &parts.headers {
        if name == header::CONNECTION {
            // The router's own answers say `close` when the connection must end; the line
            // itself is written below.
            close |= value
                .as_bytes()
                .split(|&b| b == b',')
                .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"close"));
            continue;
        }
        if name == header::TRANSFER_ENCODING {
            continue;
        }
        if name == header::CONTENT_LENGTH {
            match parse_content_length(value.as_bytes()) {
                Ok(length) if declared.is_none_or(|seen| seen == length) => declared = Some(length),
                _ => continue,
            }
        } else if name == header::DATE {
            dated = true;
        }
        append_field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    if let Some(fields) = body.passthrough() {
        // A plain-HTTP backend's fields, as it sent them.
        out.extend_from_slice(&fields.lines);
        dated |= fields.has_date;
    }
    if !dated {
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(&http_date_now());
        out.extend_from_slice(b"\r\n");
    }
    let framing = if bodiless {
        Outgoing::None
    } else if let Some(length) = declared {
        Outgoing::Length(length)
    } else if let Some(length) = body.size_hint().exact() {
        append_field(out, b"content-length", digits::<10>(length).as_bytes());
        Outgoing::Length(length)
    } else if http10 {
        close = true;
        Outgoing::Close
    } else {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        Outgoing::Chunked
    };
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    } else if http10 {
        // An HTTP/1.0 client keeps the connection only when told so (RFC 9112 §9.3, Appendix C.2.2).
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
    (framing, close)
}

/// Writes the head waiting in `out` ([`encode_response_head`]) and `body` delimited as
/// `framing` says; `Ok(true)` when the connection may serve another request. `close` says the
/// connection ends after this response (the head then says `Connection: close`); an HTTP/1.0
/// client gets a body of unknown length delimited by the end of the connection.
// Not an `async fn`: an `async fn` moves its arguments into its body's own locals, and the
// future then holds the body twice; an `async` block uses what it captured in place.
#[allow(clippy::manual_async_fn)]
pub(super) fn write_body<'a, B: Answer + 'a>(
    writer: &'a mut (impl AsyncWrite + Unpin),
    out: &'a mut Vec<u8>,
    mut body: B,
    framing: Outgoing,
    close: bool,
    mut input: Option<&'a mut Inbound>,
) -> impl Future<Output = io::Result<bool>> + 'a {
    async move {
        if framing == Outgoing::None {
            drop(body);
            writer.write_all(out).await?;
            buffers::give_write(out);
            return Ok(!close);
        }
        let mut sent: u64 = 0;
        loop {
            let frame = if body.is_end_stream() {
                None
            } else {
                // A frame that is ready at once goes out with what is waiting in `out`.
                match std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx)))
                    .await
                {
                    Poll::Ready(frame) => frame,
                    Poll::Pending => {
                        // Everything that was ready goes out in one write before the wait.
                        if !out.is_empty() {
                            writer.write_all(out).await?;
                            out.clear();
                        }
                        // A waiting stream holds no write buffer.
                        buffers::give_write(out);
                        let next = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx));
                        match input.as_deref_mut() {
                            // While the body waits on its backend, a client that leaves ends it.
                            Some(watched) => tokio::select! {
                                biased;
                                frame = next => frame,
                                gone = client_gone(watched) => {
                                    if gone {
                                        return Err(io::ErrorKind::ConnectionAborted.into());
                                    }
                                    // A pipelined request came: it waits in the buffer.
                                    if !still_watched(input.as_deref()) {
                                        input = None;
                                    }
                                    continue;
                                }
                            },
                            None => next.await,
                        }
                    }
                }
            };
            // Given back if the body waited; whatever comes next is written from it.
            buffers::ensure_write(out);
            let frame = match frame {
                None => {
                    if framing == Outgoing::Chunked {
                        append_last_chunk(out, None);
                    }
                    break;
                }
                // The body failed midway: the client can only learn it from the connection's end.
                Some(Err(_)) => {
                    let _ = writer.write_all(out).await;
                    return Ok(false);
                }
                Some(Ok(frame)) => frame,
            };
            match frame.into_data() {
                Ok(data) => {
                    if data.is_empty() {
                        continue;
                    }
                    sent += data.len() as u64;
                    if let Outgoing::Length(length) = framing {
                        if sent > length {
                            // A body longer than the length its head announced: what fits goes
                            // out and the connection ends, so that no byte past the length can
                            // be read by the client as another answer.
                            let over = usize::try_from(sent - length).unwrap_or(usize::MAX);
                            out.extend_from_slice(&data[..data.len().saturating_sub(over)]);
                            writer.write_all(out).await?;
                            out.clear();
                            buffers::give_write(out);
                            return Ok(false);
                        }
                    }
                    if data.len() > COALESCE {
                        // Written from where it is, behind what waits in `out` (the head, a chunk
                        // size line), with the chunk's end, and the last chunk when it is the last.
                        let chunked = framing == Outgoing::Chunked;
                        let end = body.is_end_stream();
                        if chunked {
                            append_chunk_size(out, data.len());
                        }
                        let tail: &[u8] = match (chunked, end) {
                            (true, true) => b"\r\n0\r\n\r\n",
                            (true, false) => b"\r\n",
                            (false, _) => b"",
                        };
                        let mut parts = [
                            io::IoSlice::new(out),
                            io::IoSlice::new(&data),
                            io::IoSlice::new(tail),
                        ];
                        write_all_vectored(writer, &mut parts).await?;
                        out.clear();
                        if end {
                            // The last chunk went out with it: nothing is left in `out`.
                            break;
                        }
                        continue;
                    }
                    if framing == Outgoing::Chunked {
                        append_chunk(out, &data);
                    } else {
                        out.extend_from_slice(&data);
                    }
                }
                Err(frame) => {
                    if let (Ok(trailers), Outgoing::Chunked) = (frame.into_trailers(), framing) {
                        append_last_chunk(out, Some(&trailers));
                        break;
                    }
                    continue;
                }
            }
            if out.len() >= MAX_BATCH {
                // A long run of frames ready at once goes out in batches of this size.
                writer.write_all(out).await?;
                out.clear();
            }
        }
        writer.write_all(out).await?;
        // An idle connection holds no write buffer.
        buffers::give_write(out);
        drop(body);
        let complete = match framing {
            Outgoing::Length(length) => sent == length,
            _ => true,
        };
        Ok(!close && complete && framing != Outgoing::Close)
    }
}
