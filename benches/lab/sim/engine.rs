//! Stepped batching ([`Batching::Stepped`](super::Batching::Stepped)): one loop per replica runs the engine's steps, as
//! vLLM's scheduler does with chunked prefill.
//!
//! At each step boundary the loop takes the requests that arrived, admits waiting ones in FIFO
//! order while a slot is free and the head's KV reservation fits (the head waits otherwise, and
//! so does everything behind it), then plans the step:
//!
//! - every running request whose prompt is done decodes one token;
//! - the token budget left (`token_budget` minus those decodes) goes to prompt tokens of requests
//!   still in prefill, oldest first, a chunk each;
//! - the step lasts `(step_ms + step_per_batch_ms × decodes + prefill_per_token_ms × prefill
//!   tokens + prefill_ms × prefills finished in it) / speed`, so a prefill in progress slows every
//!   decode of its replica;
//! - at its end each decode yields its token, and a request whose last prompt chunk was in the
//!   step yields its first token (its time to first token ends there).
//!
//! A request whose client is gone is dropped at the next boundary and frees its slot and KV.
//! Steps run against deadlines (`previous deadline + step`), like the per-request model.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::prompt::Prompt;
use super::{ClosedMidStream, SimState, SimStats, millis, token_event, wait_for_stop};

/// A request handed to the engine loop.
pub(super) struct Job {
    /// Its prompt.
    pub prompt: Prompt,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// The API it speaks (the shape of its events).
    pub api: super::Api,
    /// Where its tokens go.
    pub output: Output,
}

/// Where a request's tokens go.
pub(super) enum Output {
    /// One server-sent event per token, then `[DONE]`.
    Stream(mpsc::UnboundedSender<Result<Bytes, ClosedMidStream>>),
    /// Told once, at the end: the answer's usage when every token was generated.
    Whole(oneshot::Sender<Option<super::Usage>>),
}

impl Output {
    fn is_closed(&self) -> bool {
        match self {
            Output::Stream(sender) => sender.is_closed(),
            Output::Whole(sender) => sender.is_closed(),
        }
    }
}

/// A request holding a slot.
struct Sequence {
    job: Job,
    admission: super::Admission,
    /// Prompt tokens not yet prefilled.
    prefill_left: u64,
    /// Prompt tokens prefilled in the step being run.
    chunk: u64,
    /// Tokens generated so far.
    generated: u32,
}

/// What happened to a sequence at the end of a step.
enum After {
    Running,
    Finished,
    Dropped,
}

/// The loop of one replica; ends when the replica stops.
pub(super) async fn run(
    state: Arc<SimState>,
    mut incoming: mpsc::UnboundedReceiver<Job>,
    token_budget: u32,
) {
    let mut stopped = state.stopped.clone();
    let mut engine = Engine {
        state,
        token_budget,
        waiting: VecDeque::new(),
        running: Vec::new(),
    };
    let mut deadline = Instant::now();
    loop {
        if engine.waiting.is_empty() && engine.running.is_empty() {
            let job = tokio::select! {
                job = incoming.recv() => job,
                _ = wait_for_stop(&mut stopped) => None,
            };
            let Some(job) = job else { return };
            engine.waiting.push_back(job);
            deadline = Instant::now();
        }
        while let Ok(job) = incoming.try_recv() {
            engine.waiting.push_back(job);
        }
        engine.drop_abandoned();
        engine.admit();
        if engine.running.is_empty() {
            continue;
        }
        deadline += engine.plan_step();
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {}
            _ = wait_for_stop(&mut stopped) => return,
        }
        engine.finish_step();
    }
}

struct Engine {
    state: Arc<SimState>,
    token_budget: u32,
    waiting: VecDeque<Job>,
    running: Vec<Sequence>,
}

impl Engine {
    fn stats(&self) -> &SimStats {
        &self.state.stats
    }

    /// Forgets waiting requests whose client is gone.
    fn drop_abandoned(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|job| !job.output.is_closed());
        let dropped = before - self.waiting.len();
        self.stats().waiting.fetch_sub(dropped, Ordering::SeqCst);
    }

    /// Admits waiting requests in order while a slot is free and the head's reservation fits.
    fn admit(&mut self) {
        while self.running.len() < self.state.config.slots.max(1) {
            let Some(job) = self.waiting.front() else {
                return;
            };
            let Some(admission) = self.state.try_admit(&job.prompt, job.max_tokens) else {
                return;
            };
            let job = self.waiting.pop_front().expect("the front is there");
            self.stats().waiting.fetch_sub(1, Ordering::SeqCst);
            self.running.push(Sequence {
                prefill_left: admission.uncached_tokens,
                admission,
                job,
                chunk: 0,
                generated: 0,
            });
        }
    }

    /// Assigns this step's prompt chunks and returns how long the step takes.
    fn plan_step(&mut self) -> std::time::Duration {
        let config = &self.state.config;
        let mut decodes = self.running.iter().filter(|s| s.prefill_left == 0).count();
        if config.full_batch {
            // Timed as a full batch: every slot decoding, whatever runs here.
            decodes = decodes.max(config.slots);
        }
        let mut budget = u64::from(self.token_budget)
            .saturating_sub(decodes as u64)
            .max(1);
        let (mut prefill_tokens, mut prefills_done) = (0u64, 0usize);
        for sequence in self.running.iter_mut().filter(|s| s.prefill_left > 0) {
            if budget == 0 {
                break;
            }
            let chunk = sequence.prefill_left.min(budget);
            sequence.chunk = chunk;
            budget -= chunk;
            prefill_tokens += chunk;
            prefills_done += usize::from(chunk == sequence.prefill_left);
        }
        millis(
            (config.step_ms
                + config.step_per_batch_ms * decodes as f64
                + config.prefill_per_token_ms * prefill_tokens as f64
                + config.prefill_ms * prefills_done as f64)
                / config.speed,
        )
    }

    /// Hands out the step's tokens and retires finished and abandoned requests.
    fn finish_step(&mut self) {
        let state = Arc::clone(&self.state);
        let running = std::mem::take(&mut self.running);
        for mut sequence in running {
            match advance(&state, &mut sequence) {
                After::Running => self.running.push(sequence),
                After::Finished => finish(&state, sequence),
                After::Dropped => {}
            }
        }
    }
}

/// One step of `sequence`: its prompt chunk, or its next token.
fn advance(state: &SimState, sequence: &mut Sequence) -> After {
    if sequence.job.output.is_closed() {
        return After::Dropped;
    }
    if sequence.chunk > 0 {
        sequence.prefill_left -= std::mem::take(&mut sequence.chunk);
        if sequence.prefill_left > 0 {
            return After::Running;
        }
        state.remember(&sequence.job.prompt, 0, &sequence.admission);
    } else if sequence.prefill_left > 0 {
        return After::Running;
    }
    if sequence.generated < sequence.job.max_tokens {
        if !emit(
            state,
            &sequence.job.output,
            sequence.job.api,
            sequence.generated,
        ) {
            return After::Dropped;
        }
        sequence.generated += 1;
    }
    if sequence.generated < sequence.job.max_tokens {
        After::Running
    } else {
        After::Finished
    }
}

/// Ends the answer of a request whose every token was generated (its slot and KV are freed when
/// it is dropped).
fn finish(state: &SimState, sequence: Sequence) {
    state.remember(
        &sequence.job.prompt,
        sequence.generated,
        &sequence.admission,
    );
    let usage = sequence.admission.usage(sequence.generated);
    let delivered = match sequence.job.output {
        Output::Stream(sender) => {
            if let Some(event) = state.usage_event(sequence.job.api, usage) {
                let _ = sender.send(Ok(event));
            }
            sender
                .send(Ok(Bytes::from_static(b"data: [DONE]\n\n")))
                .is_ok()
        }
        Output::Whole(sender) => sender.send(Some(usage)).is_ok(),
    };
    if delivered {
        SimStats::bump(&state.stats.completed);
    }
}

/// Sends token `index`, or closes the answer when the replica is set to; false when the answer
/// ends here (closed on purpose, or the client is gone).
fn emit(state: &SimState, output: &Output, api: super::Api, index: u32) -> bool {
    if state.config.faults.close_after_tokens == Some(index) {
        SimStats::bump(&state.stats.closed_mid_stream);
        if let Output::Stream(sender) = output {
            let _ = sender.send(Err(ClosedMidStream));
        }
        return false;
    }
    state.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
    match output {
        Output::Stream(sender) => sender.send(Ok(token_event(api, index))).is_ok(),
        Output::Whole(sender) => !sender.is_closed(),
    }
}
