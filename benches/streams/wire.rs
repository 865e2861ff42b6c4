//! The little HTTP/1.1 the streaming bench needs on both ends: a shared clock for the events'
//! send stamps, the event format, and an incremental decoder of chunked bodies.

use std::sync::OnceLock;
use std::time::Instant;

/// The clock every stamp is counted from: the backend and the client run in the same process,
/// so `Instant` (CLOCK_MONOTONIC) relative to one base is comparable on both ends.
pub fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// Nanoseconds since [`base`].
pub fn stamp_ns() -> u64 {
    base().elapsed().as_nanos() as u64
}

/// Nanoseconds from [`base`] to `at`.
pub fn ns_at(at: Instant) -> u64 {
    at.saturating_duration_since(base()).as_nanos() as u64
}

/// Appends event `index` as one chunk whose payload, an SSE event carrying the send stamp
/// `stamp`, is `size` bytes long (more if the stamp alone does not fit):
/// `data: {"t":STAMP,"i":INDEX,"p":"xxx…"}\n\n`.
pub fn append_event(out: &mut Vec<u8>, stamp: u64, index: u32, size: usize) {
    use std::io::Write as _;
    let mut payload = [0u8; 64];
    let mut cursor = std::io::Cursor::new(&mut payload[..]);
    let _ = write!(cursor, "data: {{\"t\":{stamp},\"i\":{index},\"p\":\"");
    let head = cursor.position() as usize;
    // The payload's tail is `"}` and two line feeds.
    let pad = size.saturating_sub(head + 4);
    let _ = write!(out, "{:x}\r\n", head + pad + 4);
    out.extend_from_slice(&payload[..head]);
    out.resize(out.len() + pad, b'x');
    out.extend_from_slice(b"\"}\n\n\r\n");
}

/// The send stamp of one event (the bytes between `data: ` and the blank line).
pub fn event_stamp(event: &[u8]) -> Option<u64> {
    let at = memchr::memmem::find(event, b"\"t\":")? + 4;
    let digits = event[at..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    std::str::from_utf8(&event[at..at + digits])
        .ok()?
        .parse()
        .ok()
}

/// Where a chunked body's decoder is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum State {
    /// At a chunk-size line.
    #[default]
    Size,
    /// Inside a chunk, this many bytes left.
    Data(u64),
    /// At the line end after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines up to an empty one.
    Trailers,
    /// The body ended.
    Done,
}

/// Incremental decoder of a chunked body.
#[derive(Debug, Default)]
pub struct Chunked {
    state: State,
}

impl Chunked {
    /// Decodes what it can of `input`, appending the body's bytes to `out` when given, and
    /// returns how many bytes of `input` it used (a partial line is left for the next call).
    pub fn decode(
        &mut self,
        input: &[u8],
        mut out: Option<&mut Vec<u8>>,
    ) -> Result<usize, &'static str> {
        let mut at = 0;
        loop {
            let rest = &input[at..];
            match self.state {
                State::Done => return Ok(at),
                State::Size | State::Trailers => {
                    let Some(end) = memchr::memchr(b'\n', rest) else {
                        if rest.len() > 4096 {
                            return Err("chunk-size line too long");
                        }
                        return Ok(at);
                    };
                    let line = rest[..end].strip_suffix(b"\r").unwrap_or(&rest[..end]);
                    at += end + 1;
                    if self.state == State::Trailers {
                        if line.is_empty() {
                            self.state = State::Done;
                        }
                        continue;
                    }
                    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
                    let size = std::str::from_utf8(&line[..digits])
                        .ok()
                        .and_then(|text| u64::from_str_radix(text, 16).ok())
                        .ok_or("invalid chunk size")?;
                    self.state = if size == 0 {
                        State::Trailers
                    } else {
                        State::Data(size)
                    };
                }
                State::Data(left) => {
                    if rest.is_empty() {
                        return Ok(at);
                    }
                    let taken = rest.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    if let Some(out) = out.as_deref_mut() {
                        out.extend_from_slice(&rest[..taken]);
                    }
                    at += taken;
                    self.state = if taken as u64 == left {
                        State::DataEnd
                    } else {
                        State::Data(left - taken as u64)
                    };
                }
                State::DataEnd => {
                    if rest.len() < 2 {
                        return Ok(at);
                    }
                    if &rest[..2] != b"\r\n" {
                        return Err("chunk longer than its size");
                    }
                    at += 2;
                    self.state = State::Size;
                }
            }
        }
    }

    /// Whether the last chunk and the trailers were read.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }
}
