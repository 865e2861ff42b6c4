//! The process's own resources: its open-file limit, raised at start, and the number of client
//! connections that limit allows when `max_connections = "auto"`.
//!
//! A proxy holds two descriptors per stream (the client's connection and one to its backend), so
//! the usual soft limit of 1024 would cap the router near 500 streams: the binary raises the soft
//! limit to the hard one before it serves ([`raise_open_file_limit`]), and the configuration
//! derives its connection count from what is in force then ([`connections_for_open_files`]).

/// Open files a proxied connection may take: the client's and one to its backend.
const FILES_PER_CONNECTION: u64 = 2;
/// Open files kept for everything else (the listener, log and trace exports, DNS lookups,
/// idle backend connections beyond one per client).
const FILES_KEPT: u64 = 256;
/// The most connections `max_connections = "auto"` allows, whatever the open-file limit: at the
/// memory a stream costs ([performance.md](../docs/performance.md)), 65 536 streams hold about
/// 1 GiB.
const MAX_AUTO_CONNECTIONS: u64 = 65_536;
/// The least connections `max_connections = "auto"` allows.
const MIN_AUTO_CONNECTIONS: u64 = 64;

/// The process's `RLIMIT_NOFILE`, soft and hard.
fn nofile() -> Option<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes the limit into the struct it is given, which lives on the stack
    // for the call.
    let read = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    (read == 0).then_some(limit)
}

/// The process's open-file limit (the soft `RLIMIT_NOFILE`).
pub fn open_file_limit() -> Option<u64> {
    #[allow(clippy::unnecessary_cast)] // `rlim_t` is not `u64` on every target.
    nofile().map(|limit| limit.rlim_cur as u64)
}

/// Raises the soft open-file limit to the hard one (as the Go runtime does at start, and nginx's
/// `worker_rlimit_nofile`): a proxy holds two descriptors per stream, and the usual soft limit of
/// 1024 would cap it near 500 streams. Returns the limit in force afterwards.
pub fn raise_open_file_limit() -> Option<u64> {
    let limit = nofile()?;
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: `setrlimit` only reads the struct it is given.
        // The result is read back below, whether or not the raise was allowed.
        let _ = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) };
    }
    open_file_limit()
}

/// `max_connections = "auto"` for an open-file limit: two descriptors a connection, less those
/// kept for the rest, between 64 and 65 536.
pub fn connections_for_open_files(limit: u64) -> usize {
    (limit.saturating_sub(FILES_KEPT) / FILES_PER_CONNECTION)
        .clamp(MIN_AUTO_CONNECTIONS, MAX_AUTO_CONNECTIONS) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_connections_follow_the_open_file_limit_within_bounds() {
        // The usual soft limit: two descriptors a connection, 256 kept.
        assert_eq!(connections_for_open_files(1024), 384);
        assert_eq!(connections_for_open_files(20_000), 9_872);
        // Container defaults (2^20) stop at the memory bound; tiny limits at the floor.
        assert_eq!(connections_for_open_files(1 << 20), 65_536);
        assert_eq!(connections_for_open_files(100), 64);
        // Raising leaves the limit at least where it was.
        let before = open_file_limit().expect("getrlimit");
        assert!(raise_open_file_limit().expect("setrlimit") >= before);
    }
}
