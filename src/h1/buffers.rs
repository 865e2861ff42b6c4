//! Free lists of the small buffers connections read into and write from, one per thread.
//!
//! A connection that waits (a client between two requests or while its answer streams, a
//! backend between two events) gives its empty buffers back here, and takes one again when it
//! has something to read or write: a read takes one before it is tried and gives it back when
//! the socket has nothing, the response writer gives its write buffer back before it waits for
//! the body's next frame. So a waiting connection holds no buffer, and 2,000 streams between
//! two events hold as many as are in use at that moment, not four each (HAProxy returns its
//! empty buffers to a pool the same way).
//!
//! Only buffers of the small size are kept ([`READ_BUFFER`] and [`WRITE_BUFFER`], up to twice
//! that), at most [`KEEP`] of each kind per thread. A larger read buffer stays with its
//! connection (a large body is being read) and so does one whose memory is still shared; a
//! larger write buffer is freed. Taking and giving are a pop and a push on a thread-local list:
//! no allocation while the list has one.

use std::cell::RefCell;

use bytes::BytesMut;

use super::READ_BUFFER;

/// The size a write buffer starts with: a response head, a request head, or a few small frames
/// with their chunk lines.
pub(crate) const WRITE_BUFFER: usize = 1024;

/// The most buffers of each kind a thread keeps for later.
pub(crate) const KEEP: usize = 256;

thread_local! {
    static READS: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
    static WRITES: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// An empty read buffer of at least [`READ_BUFFER`] bytes: a kept one, or a new one.
pub(crate) fn read_buffer() -> BytesMut {
    READS
        .with(|kept| kept.borrow_mut().pop())
        .unwrap_or_else(|| BytesMut::with_capacity(READ_BUFFER))
}

/// Takes `buffer` when it is empty and of the small size (it is then left with no capacity),
/// to be handed out again by [`read_buffer`]. A larger one is left where it is (a large body is
/// being read), and so is one that shares its memory with bytes still in use (a request head
/// the handler holds): that memory is not free until they are gone, and the buffer is given at
/// a later wait, once it is the buffer's alone again.
pub(crate) fn give_read(buffer: &mut BytesMut) {
    // Room for a whole small buffer without allocating: the memory is this buffer's alone.
    if !buffer.is_empty()
        || buffer.capacity() > 2 * READ_BUFFER
        || !buffer.try_reclaim(READ_BUFFER)
        || buffer.capacity() > 2 * READ_BUFFER
    {
        return;
    }
    let given = std::mem::take(buffer);
    READS.with(|kept| {
        let mut kept = kept.borrow_mut();
        if kept.len() < KEEP {
            kept.push(given);
        }
    });
}

/// An empty write buffer of at least [`WRITE_BUFFER`] bytes: a kept one, or a new one.
pub(crate) fn write_buffer() -> Vec<u8> {
    WRITES
        .with(|kept| kept.borrow_mut().pop())
        .unwrap_or_else(|| Vec::with_capacity(WRITE_BUFFER))
}

/// Takes `buffer` (emptied; it is left with no capacity) to be handed out again by
/// [`write_buffer`] when it is of the small size; a larger one is freed.
pub(crate) fn give_write(buffer: &mut Vec<u8>) {
    if buffer.capacity() == 0 {
        return;
    }
    let mut given = std::mem::take(buffer);
    if (WRITE_BUFFER..=2 * WRITE_BUFFER).contains(&given.capacity()) {
        given.clear();
        WRITES.with(|kept| {
            let mut kept = kept.borrow_mut();
            if kept.len() < KEEP {
                kept.push(given);
            }
        });
    }
}

/// `buffer`, or a kept write buffer in its place when it has none.
pub(crate) fn ensure_write(buffer: &mut Vec<u8>) {
    if buffer.capacity() == 0 {
        *buffer = write_buffer();
    }
}

/// How many read and write buffers this thread keeps.
#[cfg(test)]
pub(crate) fn kept() -> (usize, usize) {
    (
        READS.with(|kept| kept.borrow().len()),
        WRITES.with(|kept| kept.borrow().len()),
    )
}

/// Frees what this thread keeps.
#[cfg(test)]
pub(crate) fn clear() {
    READS.with(|kept| kept.borrow_mut().clear());
    WRITES.with(|kept| kept.borrow_mut().clear());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_buffer_is_handed_out_again_and_a_shared_or_large_one_is_not() {
        clear();
        let mut buffer = read_buffer();
        let at = buffer.as_ptr();
        buffer.extend_from_slice(b"event");
        // Not while it holds bytes.
        give_read(&mut buffer);
        assert_eq!(&buffer[..], b"event");
        let _ = buffer.split();
        give_read(&mut buffer);
        assert_eq!(buffer.capacity(), 0);
        let again = read_buffer();
        assert_eq!(again.as_ptr(), at, "the same memory, not a new allocation");
        assert!(again.capacity() >= READ_BUFFER && again.is_empty());

        // Empty, but its memory is shared with a frame still in use: left where it is, and
        // given once the frame is gone.
        let mut shared = again;
        shared.extend_from_slice(b"frame");
        let frame = shared.split().freeze();
        give_read(&mut shared);
        assert!(shared.capacity() > 0);
        assert_eq!(kept(), (0, 0));
        drop(frame);
        give_read(&mut shared);
        assert_eq!(shared.capacity(), 0);
        assert_eq!(read_buffer().as_ptr(), at);

        // A large one stays with its connection.
        let mut large = BytesMut::with_capacity(64 * 1024);
        give_read(&mut large);
        assert_eq!(large.capacity(), 64 * 1024);

        let mut out = write_buffer();
        let at = out.as_ptr();
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        give_write(&mut out);
        assert_eq!(out.capacity(), 0);
        ensure_write(&mut out);
        assert_eq!(out.as_ptr(), at);
        assert!(out.is_empty());
        let mut grown = Vec::with_capacity(64 * 1024);
        give_write(&mut grown);
        assert_eq!(grown.capacity(), 0);
    }

    #[test]
    fn a_thread_keeps_a_bounded_number() {
        clear();
        let mut given: Vec<BytesMut> = (0..KEEP + 10).map(|_| read_buffer()).collect();
        for buffer in &mut given {
            give_read(buffer);
        }
        assert_eq!(READS.with(|kept| kept.borrow().len()), KEEP);
        let mut writes: Vec<Vec<u8>> = (0..KEEP + 10).map(|_| write_buffer()).collect();
        for buffer in &mut writes {
            give_write(buffer);
        }
        assert_eq!(WRITES.with(|kept| kept.borrow().len()), KEEP);
    }
}
