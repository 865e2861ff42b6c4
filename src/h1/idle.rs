//! A backend's idle keep-alive HTTP/1.1 connections: a small stack, most recently used last.
//!
//! A connection goes back on the stack only after an exchange that left it reusable, and only if
//! the backend sent nothing more on it ([`Connection::is_clean`]); it is taken again only if the
//! backend still sent nothing (the check is made again at checkout). At most
//! [`MAX_IDLE_PER_BACKEND`] connections wait (the oldest is closed beyond that), and one idle for
//! [`IDLE_TIMEOUT`] is closed, at the next checkout or by the periodic reap.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

use super::Connection;
use super::client::Transport;

/// Idle connections kept per backend; more are closed when they come back.
pub const MAX_IDLE_PER_BACKEND: usize = 128;

/// How long a connection may stay idle before it is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

struct Idle<S> {
    connection: Connection<S>,
    since: Instant,
}

/// A backend's idle keep-alive connections, most recently used last.
pub struct IdleConnections<S = TcpStream> {
    stack: Mutex<VecDeque<Idle<S>>>,
}

impl<S> Default for IdleConnections<S> {
    fn default() -> Self {
        Self {
            stack: Mutex::new(VecDeque::new()),
        }
    }
}

impl<S> std::fmt::Debug for IdleConnections<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleConnections")
            .field("idle", &self.len())
            .finish()
    }
}

impl<S> IdleConnections<S> {
    fn lock(&self) -> MutexGuard<'_, VecDeque<Idle<S>>> {
        self.stack
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Idle connections waiting.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no connection waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<S: Transport> IdleConnections<S> {
    /// Puts back a connection whose last exchange ended cleanly (at `since`), unless the
    /// backend already sent something more on it.
    pub fn put(&self, mut connection: Connection<S>, since: Instant) {
        if !connection.is_clean() {
            return;
        }
        let mut stack = self.lock();
        if stack.len() >= MAX_IDLE_PER_BACKEND {
            stack.pop_front();
        }
        stack.push_back(Idle { connection, since });
    }

    /// Closes the connections idle for longer than `timeout`, and those on which the backend
    /// sent anything (bytes or the end of the stream) since their last response.
    pub fn reap(&self, timeout: Duration) {
        let now = Instant::now();
        self.lock().retain_mut(|idle| {
            now.saturating_duration_since(idle.since) < timeout && idle.connection.is_clean()
        });
    }

    /// Takes the most recently used idle connection on which the backend has sent nothing since
    /// its last response; the others are closed on the way.
    pub fn checkout(&self) -> Option<Connection<S>> {
        let now = Instant::now();
        loop {
            let mut idle = {
                let mut stack = self.lock();
                let idle = stack.pop_back()?;
                if now.saturating_duration_since(idle.since) >= IDLE_TIMEOUT {
                    // The stack is ordered by age: everything below is older still.
                    stack.clear();
                    return None;
                }
                idle
            };
            // Checked outside the lock (it may make a system call).
            if idle.connection.is_clean() {
                return Some(idle.connection);
            }
        }
    }
}
