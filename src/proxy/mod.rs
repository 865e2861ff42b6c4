//! Forwarding a request to backends (with retries where safe) and streaming the answer back.
//!
//! A request's life is a sequence of named phases, each in a room of its own (the shape of
//! pingora's `ProxyHttp` phases):
//!
//! | Phase | Where | What |
//! |---|---|---|
//! | receive, admit | [`admit`] | `CONNECT` refused, body kept for replay; admission read, head prepared |
//! | pick | [`pick`] | a lease on a backend: through the queue first, untried backends for a retry |
//! | dispatch, send | [`attempt`] | the attempt noted and counted; sent, its response head awaited |
//! | classify | [`attempt`] | how it ended ([`crate::classify::Class`]), a failure recorded at once |
//! | retry decision | [`retry`] | retry or not, and why: a pure policy, apart from the loop |
//! | stream back | [`answer`] | the backend's answer streamed, or the router's own |
//!
//! The request keeps its method, path and query; hop-by-hop headers (RFC 9110 §7.6.1, plus those
//! named in `Connection`) are removed both ways; `X-Forwarded-For` gets the client address
//! appended and `X-Forwarded-Proto` is set to `http`. The client's `Host` is kept (for HTTP/2
//! clients, the `:authority`). A request body of at most `retry.body_limit` bytes is read into
//! memory first (within a global budget, `retry.max_buffered_bytes`) so it can be sent again; a
//! larger one is streamed once. Responses are always streamed. Requests go out as HTTP/1.1 over
//! keep-alive connections ([`crate::pool`] for `http://` backends).

mod admit;
mod answer;
mod attempt;
mod pick;
pub mod retry;

use std::sync::Arc;

use http::{Request, Response};
use tokio::sync::Semaphore;

use crate::access_log::AccessLog;
use crate::balancer::Balancer;
use crate::body::ClientBody;
use crate::forwarding::ForwardedFor;
use crate::h1::FieldLines;
use crate::observed::ResponseBody;
use crate::retry_budget::RetryBudget;
use crate::traces::Traces;
use crate::upstream::UpstreamClient;
use admit::{admit, observe, receive};
use answer::RouterAnswer;
use attempt::{classify, dispatch, send};
use pick::{Tries, pick};
use retry::{Decision, Stop};

pub use attempt::retry_after_value;
pub use retry::{RetryConfig, RetryPolicy};

/// How requests are proxied: what retries may do, and what the response says of the decision.
#[derive(Debug, Clone)]
pub struct ProxyPolicy {
    /// The `[retry]` section.
    pub retry: RetryConfig,
    /// Its retry rules ([`RetryPolicy::new`]), made once rather than for each request.
    pub retry_rules: RetryPolicy,
    /// KiB of request bodies all requests together may keep in memory
    /// (`retry.max_buffered_bytes`).
    pub buffer_budget: Arc<Semaphore>,
    /// Whether responses carry `x-custom-router-backend` and `x-custom-router-queue-ms`.
    pub decision_headers: bool,
    /// Where finished requests are logged, when the access log is on.
    pub access_log: Option<AccessLog>,
    /// The tracer, when traces are on.
    pub traces: Option<Traces>,
    /// How attempts reach backends, and their timeouts ([`UpstreamClient::config`]).
    pub client: Arc<UpstreamClient>,
    /// Failure retries allowed (shared by all requests, kept across reloads).
    pub retry_budget: Arc<RetryBudget>,
}

/// Proxies a client request: admits it, sends it, and retries where that is safe.
///
/// A connect failure (the backend saw nothing) or a busy answer (429, or 503 with
/// `Retry-After`) is retried on another backend for any method; any other failure only for
/// idempotent methods, and a generation request (a `POST` on `retry.generation_paths`) after a
/// reset or a 5xx head of `retry.generation_statuses`. Only bodies kept in memory (at most
/// `body_limit`) are sent again, never more than `retry.max_attempts` in all, and failure
/// retries draw on the shared retry budget (the rules: [`retry`]).
///
/// After admission, attempt after attempt (pick, dispatch, send, classify) until the retry
/// decision says an attempt's ending is the client's answer.
///
/// Not an `async fn`: its future would keep the request and its fields twice (an `async fn`
/// moves its arguments into its body), and the loop is the future's own, so that the response
/// it returns is not moved out of one more future.
pub fn proxy<'a>(
    balancer: &'a Arc<Balancer>,
    policy: Arc<ProxyPolicy>,
    request: Request<ClientBody>,
    mut fields: Option<FieldLines>,
    client: &'a ForwardedFor,
) -> impl Future<Output = Response<ResponseBody>> + 'a {
    let mut seen = observe(&policy, &request, fields.as_ref());
    let (mut parts, body) = request.into_parts();
    async move {
        let body = match receive(&parts, body, &policy, &mut seen).await {
            Ok(body) => body,
            Err(refused) => return refused.respond(seen),
        };
        let mut request = admit(
            balancer,
            &policy,
            &mut parts,
            body,
            &mut fields,
            client,
            &mut seen,
        );
        let retry = &policy.retry_rules;
        let budget = &policy.retry_budget;
        budget.deposit();
        let mut tries = Tries::default();
        for number in 1..=policy.retry.max_attempts {
            let lease = match pick(balancer, &request.ask, &tries, &mut seen, budget).await {
                Ok(lease) => lease,
                Err(refused) => return refused.respond(seen),
            };
            let span = dispatch(
                balancer,
                &request.ask.info,
                &mut request.head,
                &lease,
                number,
                &mut seen,
                tries.take_reason(),
            );
            let backend = Arc::clone(lease.backend());
            let queued = request.queued(&lease);
            let last = retry.is_last(number, request.body.is_replayable());
            let Some(body) = request.body.for_attempt() else {
                return RouterAnswer::BodyAlreadySent.respond(seen);
            };
            let sent = send(&policy.client, &lease, &mut request.head, body, last).await;
            let ended = classify(sent, lease);
            let attempted = request.attempted(ended.ending(), ended.status(), number);
            let decision = retry.decide(&attempted, || budget.try_withdraw());
            if let Some(span) = span {
                ended.trace(*span, decision);
            }
            match decision {
                Decision::Retry(reason) => tries.retried(reason, ended.set_aside(), backend),
                Decision::Stop(stop) => {
                    count_stop(balancer, stop);
                    let idle_timeout = policy.client.config().idle_timeout;
                    return answer::of(ended, backend, queued, idle_timeout, seen);
                }
            }
        }
        // The loop returns on its last attempt.
        RouterAnswer::NoAttemptLeft.respond(seen)
    }
}

/// Counts a retry the budget refused (`custom_router_retry_budget_exhausted_total`).
fn count_stop(balancer: &Balancer, stop: Stop) {
    if stop == Stop::BudgetSpent {
        balancer.metrics().retry_budget_exhausted.add(1, &[]);
    }
}
