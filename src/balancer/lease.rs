//! One request's claim on a backend ([`Lease`]), from dispatch to its end ([`Finish`]): what it
//! adds to the backend's in-flight counters and prefix index, its first byte and outcome told to
//! the strategy, and its release, which lets the queue move.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::StatusCode;
use tokio::time::Instant;

use super::Balancer;
use crate::backend::{Backend, ErrorKind, InFlightWork};
use crate::prefix_index::Recall;
use crate::prompt::Prompt;
use crate::strategy::{Candidates, FirstByte, Pick, RequestInfo};
use crate::usage::Usage;

/// How a proxied request ended, for [`Lease::finish`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Finish {
    /// The backend's status code, if it answered.
    pub status: Option<StatusCode>,
    /// The upstream failure, if any.
    pub error: Option<ErrorKind>,
    /// The response's `Retry-After`, if any (with 429 or 503 it pauses the backend).
    pub retry_after: Option<Duration>,
    /// Response body bytes relayed.
    pub bytes: u64,
    /// The answer's usage, when it reported one and the lease asked for it
    /// ([`Lease::reads_usage`]).
    pub usage: Option<Usage>,
}

/// What `backend`'s index held of `prompt`
/// ([`crate::prefix_index::PrefixIndex::record_prompt`]); the prompt is recorded there: it is
/// about to be sent to it.
fn recall(backend: &Backend, prompt: &Prompt) -> Recall {
    backend.prefixes().record_prompt(prompt)
}

/// The backend a pick chose, with what the strategy's [`Pick`] said of it.
pub(super) struct Choice {
    backend: Arc<Backend>,
    /// [`Pick::past_limit`].
    past_limit: bool,
}

impl Choice {
    /// The backend of `candidates` that `pick` names.
    pub(super) fn of(candidates: Candidates<'_>, pick: Pick) -> Self {
        Self {
            backend: Arc::clone(&candidates.all()[pick.index]),
            past_limit: pick.past_limit,
        }
    }
}

/// One request's claim on a backend: counted in the backend's in-flight until dropped.
///
/// [`Lease::finish`] records the outcome; a lease dropped without it (client went away) gives no
/// latency sample. Either way the in-flight count is released and the queue may move on.
pub struct Lease {
    balancer: Arc<Balancer>,
    pub(super) backend: Arc<Backend>,
    dispatched_at: Instant,
    pub(super) first_byte: Option<Duration>,
    pub(super) streamed: bool,
    released: bool,
    /// What the request adds to its backend's in-flight counters.
    work: InFlightWork,
    /// The backend's queued prefill when the request was dispatched.
    queued_tokens: u64,
    /// The backend's requests in flight when it was dispatched, this one included.
    pub(super) in_flight: usize,
    /// Whether the pick sent it past the strategy's limit ([`Pick::past_limit`]).
    past_limit: bool,
    /// The request's prompt tokens (0 without a prompt): its answer's usage is read.
    pub(super) prompt_tokens: u64,
    /// What the backend's index held of the prompt at dispatch.
    pub(super) recall: Recall,
    /// The prompt, released in the backend's index when the request ends.
    prompt: Option<Arc<Prompt>>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("backend", &self.backend.addr().as_str())
            .finish_non_exhaustive()
    }
}

impl Lease {
    pub(super) fn new(balancer: &Arc<Balancer>, choice: Choice, info: &RequestInfo) -> Self {
        let Choice {
            backend,
            past_limit,
        } = choice;
        let queued_tokens = backend.prefill_in_flight();
        let prompt_tokens = info
            .prompt
            .as_ref()
            .map_or(0, |prompt| u64::from(prompt.tokens));
        let recall = info
            .prompt
            .as_ref()
            .map_or_else(Recall::default, |prompt| recall(&backend, prompt));
        let work = InFlightWork {
            // The prompt past the longest prefix the index held.
            prefill: prompt_tokens.saturating_sub(Prompt::blocks_tokens(recall.held)),
            output: u64::from(info.expected_output_tokens()),
        };
        backend.acquire_work(&work);
        balancer.strategy.load().on_dispatch(&backend, work.prefill);
        let in_flight = backend.in_flight();
        balancer.leased.fetch_add(1, Ordering::Relaxed);
        Self {
            balancer: Arc::clone(balancer),
            backend,
            dispatched_at: Instant::now(),
            first_byte: None,
            streamed: false,
            released: false,
            work,
            queued_tokens,
            in_flight,
            past_limit,
            prompt_tokens,
            recall,
            prompt: info.prompt.clone(),
        }
    }

    /// Whether the answer's usage is read for the strategy: the request has a prompt (the
    /// strategy reads prompts, and this is an LLM request).
    pub fn reads_usage(&self) -> bool {
        self.prompt_tokens > 0
    }

    /// The backend this request goes to.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    /// When the lease was handed out.
    pub fn dispatched_at(&self) -> Instant {
        self.dispatched_at
    }

    /// The prompt tokens the backend is expected to prefill: those past the longest prefix the
    /// router's index held for it at dispatch (0 without a prompt).
    pub fn uncached_tokens(&self) -> u64 {
        self.work.prefill
    }

    /// Marks the answer as a stream (see [`Outcome::streamed`](crate::strategy::Outcome::streamed)).
    pub fn mark_streamed(&mut self) {
        self.streamed = true;
    }

    /// Notes the first response body byte (once).
    pub fn mark_first_byte(&mut self) {
        if self.first_byte.is_none() {
            self.first_byte_after(self.dispatched_at.elapsed());
        }
    }

    fn first_byte_after(&mut self, elapsed: Duration) {
        if self.first_byte.is_none() {
            self.first_byte = Some(elapsed);
            self.backend.prefilled(&self.work);
            let seconds = elapsed.as_secs_f64();
            self.balancer.first_byte_time.record(seconds);
            self.balancer
                .metrics
                .time_to_first_byte
                .record(seconds, &[]);
            self.balancer.strategy.load().on_first_byte(
                &self.backend,
                &FirstByte {
                    seconds,
                    streamed: self.streamed,
                    uncached_tokens: self.work.prefill,
                    prompt_tokens: self.prompt_tokens,
                    recall: self.recall,
                    queued_tokens: self.queued_tokens,
                    in_flight: self.in_flight,
                    dispatched_at: self.dispatched_at,
                    past_limit: self.past_limit,
                },
            );
            // A stream's first byte can raise the backend's limit and ends its share of queued
            // prefill: a waiting request may go now rather than when some answer ends (seconds
            // to minutes later). A whole answer's first byte comes with its end, and the release
            // that follows lets the queue move.
            if self.streamed {
                self.balancer.capacity_freed();
            }
        }
    }

    /// Records how the request ended, then releases the backend.
    ///
    /// A failed attempt keeps the backend occupied until `latency.threshold` has passed since
    /// dispatch, as if it had taken that long: a replica that fails fast must not look free.
    pub fn finish(self, finish: Finish) {
        self.finish_at(finish, Instant::now());
    }

    /// [`Lease::finish`] with the time it ended read already (`now`). A body that ends with its
    /// first bytes had them at `now` too.
    pub fn finish_at(mut self, finish: Finish, now: Instant) {
        let latency = now.saturating_duration_since(self.dispatched_at);
        if finish.error.is_none() {
            self.first_byte_after(latency);
        }
        let failed = self.balancer.record_outcome(&self, &finish, latency);
        if failed {
            let threshold = self.balancer.tuning.load().latency.threshold;
            let penalty = threshold.saturating_sub(latency);
            if let (false, Ok(runtime)) = (penalty.is_zero(), tokio::runtime::Handle::try_current())
            {
                runtime.spawn(async move {
                    tokio::time::sleep(penalty).await;
                    drop(self);
                });
            }
        }
        // Otherwise dropping releases the in-flight count and lets the queue move.
    }

    /// The client left before the answer's end (`status`: the answer's, when its head came):
    /// the backend's response is counted (its status class, the time so far), but nothing is
    /// learned from it: the strategy and availability see no sample. Dropping releases the
    /// backend.
    pub fn client_left(self, status: Option<http::StatusCode>) {
        if let Some(status) = status {
            self.backend.record_status(status);
        }
        let elapsed = self.dispatched_at.elapsed().as_secs_f64();
        self.balancer.metrics.request_duration.record(elapsed, &[]);
    }

    pub(super) fn release_locked(mut self) {
        self.release();
    }

    /// Gives the backend back what the request held of it: its in-flight work, and, in its
    /// prefix index, the prompt (the engine frees the prompt's blocks as the request ends).
    fn release(&mut self) {
        self.backend
            .release_work(&self.work, self.first_byte.is_none());
        if let Some(prompt) = &self.prompt {
            self.backend.prefixes().release(&prompt.blocks);
        }
        self.balancer.leased.fetch_sub(1, Ordering::Relaxed);
        self.released = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.released {
            self.release();
            self.balancer.capacity_freed();
        }
    }
}
