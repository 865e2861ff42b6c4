//! The raw-byte HTTP/1 conformance corpus: vectors that write scripted bytes to the router over
//! loopback sockets, let it proxy to a scripted raw backend, and check what the backend received,
//! what each client received, and that canaries on fresh connections (three on new connections,
//! two on one kept-alive connection) get exactly their own answers afterwards, with nothing left
//! in flight.
//!
//! Vectors are data ([`harness::Vector`]) grouped by class, one test per class; a failing test
//! lists every failing vector by id. The classes: request smuggling forms, request framing,
//! header rules, response desynchronisation, response framing, aborts and stalls.

mod common;

#[path = "conformance/harness.rs"]
mod harness;
#[path = "conformance/request.rs"]
mod request;
#[path = "conformance/response.rs"]
mod response;
#[path = "conformance/stall.rs"]
mod stall;

use harness::run_group;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_smuggling_forms() {
    run_group("request smuggling", request::smuggling()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_framing() {
    run_group("request framing", request::framing()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_rules() {
    run_group("header rules", request::headers()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_desync() {
    run_group("response desync", response::desyncs()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_framing() {
    run_group("response framing", response::framings()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborts_and_stalls() {
    run_group("aborts and stalls", stall::stalls()).await;
}
