//! Keep-alive connections to plain-HTTP backends: a small stack of idle HTTP/1.1 connections per
//! backend.
//!
//! Each [`Backend`] owns its [`IdleConnections`]. A request takes the most recently used idle
//! connection the backend has not closed (closed ones are dropped on the way), or opens a new
//! one: TCP connect under the connect timeout and `TCP_NODELAY`. The exchange itself is
//! [`crate::h1`]'s. The connection goes back on the stack only once the response body has been
//! read to its end and the exchange left it reusable ([`crate::observed::ObservedBody`]); a
//! response dropped early closes it. At most
//! [`MAX_IDLE_PER_BACKEND`] connections wait per backend (the oldest is closed beyond that), and
//! one idle for [`IDLE_TIMEOUT`] is closed, at the next checkout or by the periodic reap.
//!
//! A connection the backend closed while it was idle must not fail a request: when the request
//! could not be handed to a reused connection, it is sent again on a new one.

use std::sync::Arc;
use std::time::Duration;

use http::Response;
use tokio::net::TcpStream;

use crate::backend::{Backend, ErrorKind};
use crate::body::{BodyFailure, UpstreamBody};
pub use crate::h1::Connection;
pub use crate::h1::idle::{IDLE_TIMEOUT, IdleConnections, MAX_IDLE_PER_BACKEND};
use crate::h1::{OutgoingHead, ResponseStream, SendError};

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
/// pool once the body has been read to its end ([`crate::observed::ObservedBody`]).
///
/// Fails with [`ErrorKind::Connect`] or [`ErrorKind::ConnectTimeout`] when no connection could
/// be opened (nothing was sent), [`ErrorKind::Io`] when the exchange failed, and
/// [`Failure::RequestBody`] when the client's body did.
pub async fn send(
    backend: &Arc<Backend>,
    head: OutgoingHead<'_>,
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
    sent: Result<Response<ResponseStream>, SendError<UpstreamBody>>,
) -> Result<Response<ResponseStream>, Failure> {
    match sent {
        Ok(response) => Ok(response),
        Err(SendError::Body(error)) => {
            tracing::debug!(%error, backend = %backend.addr(), "request body failed");
            Err(Failure::RequestBody(BodyFailure::of(&*error)))
        }
        Err(SendError::Failed(error)) => {
            tracing::debug!(%error, backend = %backend.addr(), "backend exchange failed");
            Err(Failure::Backend(ErrorKind::Io))
        }
        Err(SendError::Unsent(_)) => Err(Failure::Backend(ErrorKind::Io)),
    }
}
