//! Pick: a lease on a backend for each attempt. The first goes through admission (the fast path
//! or the router queue, [`Balancer::admit_as`]); a retry asks for a backend the request has not
//! tried ([`Balancer::admit_retry`]), re-queued after a busy answer, with what is left of its
//! deadline. [`Tries`] is what the earlier attempts left for the next.

use std::sync::Arc;

use super::admit::Ask;
use super::answer::RouterAnswer;
use crate::backend::{Backend, ErrorKind};
use crate::balancer::{Balancer, Lease, Rejection};
use crate::metrics::RetryReason;
use crate::observed::Observation;
use crate::response;
use crate::retry_budget::RetryBudget;

/// What a request's earlier attempts left for the next.
#[derive(Debug, Default)]
pub(super) struct Tries {
    /// The backends tried, in order.
    tried: Vec<Arc<Backend>>,
    /// The last attempt's failure and backend, unless it was a busy answer.
    last_failure: Option<(ErrorKind, Arc<Backend>)>,
    /// Why the next attempt is a retry, until it is dispatched.
    reason: Option<RetryReason>,
}

impl Tries {
    /// The attempt on `backend` ended in `failure` (`None`: a busy answer) and is retried for
    /// `reason`.
    pub fn retried(
        &mut self,
        reason: RetryReason,
        failure: Option<ErrorKind>,
        backend: Arc<Backend>,
    ) {
        self.last_failure = failure.map(|kind| (kind, Arc::clone(&backend)));
        self.reason = Some(reason);
        self.tried.push(backend);
    }

    /// Why the attempt being dispatched is a retry (once; `None` for the first).
    pub fn take_reason(&mut self) -> Option<RetryReason> {
        self.reason.take()
    }

    /// The client's answer when a retry found no backend left to try: the last failure, or a
    /// busy refusal when every backend tried answered busy (not a refusal of the router's).
    fn exhausted(&self) -> RouterAnswer {
        match &self.last_failure {
            Some((kind, backend)) => RouterAnswer::Failure(*kind, Arc::clone(backend)),
            None => RouterAnswer::Rejection(Rejection::Busy),
        }
    }
}

/// A lease for the request's next attempt, or the client's answer when there is none.
pub(super) async fn pick(
    balancer: &Arc<Balancer>,
    ask: &Ask,
    tries: &Tries,
    seen: &mut Observation,
    budget: &RetryBudget,
) -> Result<Lease, RouterAnswer> {
    if let Some(span) = seen.span.as_mut() {
        span.queue_started();
    }
    let admitted = if tries.tried.is_empty() {
        balancer
            .admit_as(ask.info.clone(), ask.admission)
            .await
            .map(Some)
    } else {
        let requeue = tries.last_failure.is_none();
        let admission = ask.admission_for_retry();
        balancer
            .admit_retry(ask.info.clone(), admission, &tries.tried, requeue)
            .await
    };
    if let Some(span) = seen.span.as_mut() {
        span.queue_ended(admitted.as_ref().err().map(|r| response::reason(*r)));
    }
    // A failure retry took its retry from the budget before it was admitted: with no backend to
    // try it on, it is given back.
    if tries.last_failure.is_some() && !matches!(admitted, Ok(Some(_))) {
        budget.refund();
    }
    match admitted {
        Ok(Some(lease)) => Ok(lease),
        Ok(None) => Err(tries.exhausted()),
        Err(rejection) => Err(RouterAnswer::Rejection(rejection)),
    }
}
