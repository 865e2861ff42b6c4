//! Keep-alive connections to plain-HTTP backends: a small stack of idle HTTP/1.1 connections per
//! backend.
//!
//! Each [`Backend`] owns its [`IdleConnections`]. A request takes the most recently used idle
//! connection the backend has not closed (closed ones are dropped on the way), or opens a new
//! one: TCP connect under the connect timeout and `TCP_NODELAY`. The exchange itself is
//! [`crate::h1`]'s. The connection goes back on the stack only once the response body has been
//! read to its end and the exchange left it reusable ([`crate::body::ObservedBody`]); a response
//! dropped early closes it. At most
//! [`MAX_IDLE_PER_BACKEND`] connections wait per backend (the oldest is closed beyond that), and
//! one idle for [`IDLE_TIMEOUT`] is closed, at the next checkout or by the periodic reap.
//!
//! A connection the backend closed while it was idle must not fail a request: when the request
//! could not be handed to a reused connection, it is sent again on a new one.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::Response;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::backend::{Backend, ErrorKind};
use crate::body::{BodyFailure, UpstreamBody};
pub use crate::h1::Connection;
use crate::h1::{RequestHead, ResponseStream, SendError};

/// Idle connections kept per backend; more are closed when they come back.
pub const MAX_IDLE_PER_BACKEND: usize = 128;

/// How long a connection may stay idle before it is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

struct Idle {
    connection: Connection,
    since: Instant,
}

/// A backend's idle keep-alive connections, most recently used last.
#[derive(Default)]
pub struct IdleConnections {
    stack: Mutex<VecDeque<Idle>>,
}

impl std::fmt::Debug for IdleConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleConnections")
            .field("idle", &self.len())
            .finish()
    }
}

impl IdleConnections {
    fn lock(&self) -> MutexGuard<'_, VecDeque<Idle>> {
        self.stack
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Idle connections waiting.
    fn len(&self) -> usize {
        self.lock().len()
    }

    /// Puts back a connection whose last exchange ended cleanly (at `since`), unless the
    /// backend already sent something more on it.
    pub fn put(&self, connection: Connection, since: Instant) {
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
        self.lock().retain(|idle| {
            now.saturating_duration_since(idle.since) < timeout
                && idle.connection.kernel_says_clean()
        });
    }

    /// Takes the most recently used idle connection on which the backend has sent nothing since
    /// its last response; the others are closed on the way.
    fn checkout(&self) -> Option<Connection> {
        let now = Instant::now();
        loop {
            let idle = {
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

/// Opens a connection to `backend` within `timeout`.
async fn connect(backend: &Backend, timeout: Duration) -> Result<Connection, ErrorKind> {
    let authority = backend.addr().authority().as_str();
    let stream = match tokio::time::timeout(timeout, TcpStream::connect(authority)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::TimedOut => {
            return Err(ErrorKind::ConnectTimeout);
        }
        Ok(Err(_)) => return Err(ErrorKind::Connect),
        Err(_) => return Err(ErrorKind::ConnectTimeout),
    };
    let _ = stream.set_nodelay(true);
    Ok(Connection::new(stream))
}

/// Why an exchange gave no response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The backend could not be reached, or the exchange with it failed.
    Backend(ErrorKind),
    /// The client's request body failed: the exchange was abandoned and its connection closed;
    /// nothing is held against the backend.
    RequestBody(BodyFailure),
}

/// Sends the request `head` with `body` to `backend` over a pooled connection, or a new one
/// opened within `connect_timeout`; a backend that takes none of the request for `stall` fails
/// the exchange. The response body holds the connection; it goes back to the
/// pool once the body has been read to its end ([`crate::body::ObservedBody`]).
///
/// Fails with [`ErrorKind::Connect`] or [`ErrorKind::ConnectTimeout`] when no connection could
/// be opened (nothing was sent), [`ErrorKind::Io`] when the exchange failed, and
/// [`Failure::RequestBody`] when the client's body did.
pub async fn send(
    backend: &Arc<Backend>,
    head: RequestHead<'_>,
    mut body: UpstreamBody,
    connect_timeout: Duration,
    stall: Option<Duration>,
) -> Result<Response<ResponseStream>, Failure> {
    if let Some(connection) = backend.connections().checkout() {
        match connection.send(&head, body, stall).await {
            // The connection closed before the request could be written: try a new one.
            Err(SendError::Unsent(unsent)) => body = unsent,
            sent => return answered(backend, sent),
        }
    }
    let connection = connect(backend, connect_timeout)
        .await
        .map_err(Failure::Backend)?;
    answered(backend, connection.send(&head, body, stall).await)
}

fn answered(
    backend: &Backend,
    sent: Result<Response<ResponseStream>, SendError>,
) -> Result<Response<ResponseStream>, Failure> {
    match sent {
        Ok(response) => Ok(response),
        Err(SendError::Body(error)) => {
            tracing::debug!(%error, backend = %backend.addr(), "request body failed");
            Err(Failure::RequestBody(BodyFailure::of(&error)))
        }
        Err(SendError::Failed(error)) => {
            tracing::debug!(%error, backend = %backend.addr(), "backend exchange failed");
            Err(Failure::Backend(ErrorKind::Io))
        }
        Err(SendError::Unsent(_)) => Err(Failure::Backend(ErrorKind::Io)),
    }
}
