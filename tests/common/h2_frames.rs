//! Raw HTTP/2 frames for the tests that speak h2c byte by byte: frame types, flags and error
//! codes, a frame's bytes, and the `:status` of a response header block.

pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const CONTINUATION: u8 = 0x9;

pub const END_STREAM: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
pub const ACK: u8 = 0x1;

pub const NO_ERROR: u32 = 0x0;
pub const CANCEL: u32 = 0x8;

/// Takes the first frame off `read` once it has come whole: kind, flags, stream and payload.
pub fn take_frame(read: &mut Vec<u8>) -> Option<(u8, u8, u32, Vec<u8>)> {
    if read.len() < 9 {
        return None;
    }
    let length = usize::from(read[0]) << 16 | usize::from(read[1]) << 8 | usize::from(read[2]);
    if read.len() < 9 + length {
        return None;
    }
    let head: Vec<u8> = read.drain(..9).collect();
    let payload = read.drain(..length).collect();
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    Some((head[3], head[4], stream, payload))
}

/// A frame: its 9-byte header, then `payload`.
pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let length = payload.len();
    let mut out = vec![
        (length >> 16) as u8,
        (length >> 8) as u8,
        length as u8,
        kind,
        flags,
    ];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The `:status` of a response header block that starts with it (as hyper writes it: an
/// indexed field of the static table, or a literal with its name indexed and a Huffman-coded or
/// plain value of three digits).
pub fn status(block: &[u8]) -> u16 {
    let mut at = 0;
    // Dynamic table size updates first.
    while block[at] & 0xe0 == 0x20 {
        at += 1;
    }
    let first = block[at];
    if first & 0x80 != 0 {
        return match first & 0x7f {
            8 => 200,
            9 => 204,
            10 => 206,
            11 => 304,
            12 => 400,
            13 => 404,
            14 => 500,
            index => panic!("status at index {index}"),
        };
    }
    // A literal whose name is `:status` (index 8), with or without indexing.
    assert!(first == 0x48 || first == 0x08 || first == 0x18, "{block:?}");
    let value = block[at + 1];
    let bytes = &block[at + 2..at + 2 + usize::from(value & 0x7f)];
    if value & 0x80 == 0 {
        return std::str::from_utf8(bytes).unwrap().parse().unwrap();
    }
    // Huffman-coded digits: 0-2 take five bits, 3-9 six (RFC 7541 Appendix B).
    let bit = |index: usize| u16::from(bytes[index / 8] >> (7 - index % 8) & 1);
    let (mut index, mut status) = (0, 0);
    for _ in 0..3 {
        let five = (0..5).fold(0, |code, _| {
            index += 1;
            code << 1 | bit(index - 1)
        });
        let digit = if five <= 2 {
            five
        } else {
            index += 1;
            (five << 1 | bit(index - 1)) - 22
        };
        status = status * 10 + digit;
    }
    status
}
