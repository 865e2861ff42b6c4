//! Routing strategies and their registry.
//!
//! A strategy only chooses: given the request and the current backends (with the statistics the
//! core keeps for them), it returns a [`Pick`] of the one to use (its index, and whether it is
//! past the strategy's own limit), or `None` for "none right now".
//! It does no I/O, never sleeps and never queues; the core owns the queue, in-flight counting,
//! outcome measurement, timeouts and metrics.
//!
//! # Adding a strategy
//!
//! Write one file in this folder that exposes a [`StrategyEntry`] constant, declare the module
//! below and add one line to [`REGISTRY`]. The factory receives the `[strategy.params]` table,
//! deserializes it strictly (`#[serde(deny_unknown_fields)]`) and validates it. See
//! `docs/adding-a-strategy.md`.

pub use queued_least_latency::QueuedLeastLatency;
pub use round_robin::RoundRobin;

pub use crate::strategy::*;

mod affinity;
mod p2c_peak_ewma;
mod queued_least_latency;
mod round_robin;

/// Every registered strategy. The config name maps to its factory here and nowhere else.
pub const REGISTRY: &[StrategyEntry] = &[
    queued_least_latency::ENTRY,
    round_robin::ENTRY,
    p2c_peak_ewma::ENTRY,
    affinity::ENTRY,
];

/// The strategy used when the configuration names none.
pub const DEFAULT_STRATEGY: &str = queued_least_latency::ENTRY.name;

/// The registry entry called `name`.
pub fn find(name: &str) -> Option<&'static StrategyEntry> {
    REGISTRY.iter().find(|entry| entry.name == name)
}

/// All registered names, in registry order.
pub fn names() -> Vec<&'static str> {
    REGISTRY.iter().map(|entry| entry.name).collect()
}

/// The murmur3 64-bit finalizer: every input bit moves about half of the output's, so hashes
/// that differ in a few bits (or FNV's weak high bits) rank and spread evenly.
pub(crate) fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

#[cfg(test)]
mod tests {
    use std::ops::ControlFlow;
    use std::sync::Arc;

    use http::Method;

    use super::*;
    use crate::backend::Backend;
    use figment::value::{Dict, Value};

    fn empty() -> Value {
        Value::from(Dict::new())
    }

    fn backends(n: usize) -> Vec<Arc<Backend>> {
        (0..n)
            .map(|i| Arc::new(Backend::new(format!("10.0.0.{i}:80").parse().unwrap())))
            .collect()
    }

    #[test]
    fn registry_names_are_unique_and_include_the_default() {
        let names = names();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        assert!(names.contains(&DEFAULT_STRATEGY));
    }

    #[test]
    fn every_strategy_accepts_empty_params_and_reports_its_name() {
        for entry in REGISTRY {
            let strategy = (entry.build)(&StrategyContext::default(), &empty())
                .unwrap_or_else(|e| panic!("{}: {e}", entry.name));
            assert_eq!(strategy.name(), entry.name);
        }
    }

    #[test]
    fn every_strategy_rejects_unknown_params() {
        for entry in REGISTRY {
            let mut dict = Dict::new();
            dict.insert("no_such_param".into(), Value::from(1));
            let error = (entry.build)(&StrategyContext::default(), &Value::from(dict))
                .err()
                .unwrap_or_else(|| panic!("{} accepted an unknown param", entry.name));
            assert!(
                error.to_string().contains("no_such_param"),
                "{}: {error}",
                entry.name
            );
        }
    }

    #[test]
    fn every_strategy_picks_within_the_candidates() {
        let request = RequestInfo::default();
        for entry in REGISTRY {
            let strategy = (entry.build)(&StrategyContext::default(), &empty()).unwrap();
            for n in 1..6 {
                let set = backends(n);
                strategy.on_backends_changed(&set);
                for _ in 0..50 {
                    if let Some(Pick { index, .. }) = strategy.pick(&request, (&set).into()) {
                        assert!(index < n, "{} picked {index} of {n}", entry.name);
                        // Keep the candidates busy so load-aware strategies move on.
                        set[index].acquire();
                    }
                }
            }
        }
    }

    #[test]
    fn every_strategy_returns_none_without_candidates() {
        for entry in REGISTRY {
            let strategy = (entry.build)(&StrategyContext::default(), &empty()).unwrap();
            strategy.on_backends_changed(&[]);
            assert_eq!(
                strategy.pick(&RequestInfo::default(), Candidates::new(&[])),
                None,
                "{}",
                entry.name
            );
        }
    }

    #[test]
    fn every_strategy_picks_outside_the_exclusions() {
        let request = RequestInfo::default();
        for entry in REGISTRY {
            let strategy = (entry.build)(&StrategyContext::default(), &empty()).unwrap();
            let set = backends(4);
            strategy.on_backends_changed(&set);
            let tried = [Arc::clone(&set[0]), Arc::clone(&set[2])];
            for _ in 0..50 {
                let candidates = Candidates::new(&set).excluding(&tried).declining(&set[3]);
                assert_eq!(
                    strategy.pick(&request, candidates),
                    Some(Pick::at(1)),
                    "{}",
                    entry.name
                );
                let candidates = Candidates::new(&set).excluding(&tried);
                let index = strategy.pick(&request, candidates).unwrap().index;
                assert!(index == 1 || index == 3, "{} picked {index}", entry.name);
            }
        }
    }

    #[test]
    fn candidates_skip_the_exclusions_without_copying() {
        let set = backends(5);
        let all = Candidates::new(&set);
        assert_eq!((all.len(), all.nth(3).map(|(i, _)| i)), (5, Some(3)));
        assert!(!all.has_exclusions());
        let tried = [Arc::clone(&set[1]), Arc::clone(&set[3])];
        let some = all.excluding(&tried).declining(&set[0]);
        let left: Vec<usize> = some.iter().map(|(index, _)| index).collect();
        assert_eq!(left, [2, 4]);
        assert_eq!((some.len(), some.nth(1).map(|(i, _)| i)), (2, Some(4)));
        assert!(some.get(1).is_none() && some.get(2).is_some() && some.get(9).is_none());
        assert!(std::ptr::eq(some.all(), set.as_slice()));
        assert!(all.excluding(&set).is_empty());
    }

    struct Fields(Vec<(&'static str, &'static str)>);

    impl HeaderLookup for Fields {
        fn visit<'s>(&'s self, name: &str, each: &mut dyn FnMut(&'s [u8]) -> ControlFlow<()>) {
            for (field, value) in &self.0 {
                if *field == name && each(value.as_bytes()).is_break() {
                    return;
                }
            }
        }
    }

    #[test]
    fn the_request_view_reads_headers_and_parses_the_body_once() {
        let fields = Fields(vec![("a", "1"), ("b", "2"), ("a", "3")]);
        let uri = http::Uri::from_static("/v1/chat/completions?x=1");
        let body = br#"{"model": "m", "messages": []}"#;
        let view = RequestView::new(&Method::POST, &uri, &fields, body);
        assert_eq!(view.path(), "/v1/chat/completions");
        assert_eq!(view.method(), Method::POST);
        assert_eq!(view.header("a"), Some(&b"1"[..]));
        assert_eq!(view.headers().get_all("a"), [&b"1"[..], &b"3"[..]]);
        assert_eq!(view.header("c"), None);
        let json = view.json().unwrap();
        assert_eq!(json["model"], "m");
        assert!(std::ptr::eq(json, view.json().unwrap()), "parsed once");
        let cut = RequestView::new(&Method::POST, &uri, &fields, &body[..10]);
        assert!(cut.json().is_none());
    }
}
