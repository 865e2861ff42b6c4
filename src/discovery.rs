//! Backends named in the configuration: fixed addresses, and DNS names followed over time.
//!
//! `backends` (`CUSTOM_ROUTER_BACKENDS`) takes the address forms set-backends takes (`host:port`,
//! `http://host:port`, `https://host:port`) and two more: `dns://NAME:PORT` and
//! `dns+https://NAME:PORT`. A DNS entry stands for every address `NAME` resolves to (A and AAAA
//! records), each a backend on `PORT`; this is how a Kubernetes headless Service or a compose
//! service name is followed. Names are resolved every `dns_refresh` seconds by the system
//! resolver (`getaddrinfo`, through tokio), so `/etc/hosts`, search domains and the cluster's
//! `resolv.conf` apply as for every other program on the host. A backend whose address stays
//! keeps its statistics (the balancer keeps backends by address); a lookup that fails keeps
//! that name's last good addresses, and is logged and counted
//! (`custom_router_dns_lookup_failures`).
//!
//! The names are looked up side by side, each bounded by `dns_refresh`: a lookup not answered
//! by then counts as failed for that round and is waited for again in the next, never started
//! twice, so a hung resolver neither delays the other names nor piles up lookups.
//!
//! The set is the configured entries in order, each DNS name's addresses sorted. A set-backends
//! call replaces the whole set, as always, and from then on the admin API owns it: discovery
//! stops, so the two never overwrite each other.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::task::JoinHandle;

use crate::backend::{BackendAddr, canonical_host};
use crate::balancer::Balancer;
use crate::upstream::TlsNames;

/// One configured backend entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A fixed address.
    Fixed(BackendAddr),
    /// Every address a DNS name resolves to.
    Dns(DnsName),
}

/// A name to resolve, the port its backends listen on, and whether they speak TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DnsName {
    /// The name, as configured.
    pub name: String,
    /// The backends' port.
    pub port: u16,
    /// Whether the backends are `https://`.
    pub https: bool,
}

impl Entry {
    /// Parses one entry; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let trimmed = text.trim();
        let dns = split_scheme(trimmed, "dns://")
            .map(|rest| (rest, false))
            .or_else(|| split_scheme(trimmed, "dns+https://").map(|rest| (rest, true)));
        let Some((rest, https)) = dns else {
            return trimmed
                .parse::<BackendAddr>()
                .map(Entry::Fixed)
                .map_err(|error| error.to_string());
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let Some((name, port)) = rest.rsplit_once(':') else {
            return Err(format!(
                "{trimmed:?} has no port (expected dns://NAME:PORT)"
            ));
        };
        let digits = port.bytes().all(|b| b.is_ascii_digit());
        let port = match port.parse::<u16>() {
            Ok(port) if port > 0 && digits => port,
            _ => return Err(format!("{trimmed:?} has an invalid port")),
        };
        // Held to the rules of a set-backends host: labels of 1 to 63 letters, digits, `-` or
        // `_`, 253 bytes in all.
        if name.is_empty() || name.starts_with('[') || canonical_host(name).is_none() {
            return Err(format!("{trimmed:?} does not name a DNS host"));
        }
        Ok(Entry::Dns(DnsName {
            name: name.to_ascii_lowercase(),
            port,
            https,
        }))
    }
}

fn split_scheme<'a>(text: &'a str, scheme: &str) -> Option<&'a str> {
    let head = text.get(..scheme.len())?;
    head.eq_ignore_ascii_case(scheme)
        .then(|| &text[scheme.len()..])
}

/// Parses every entry; the error names the first bad one (`backends[1]: ...`).
pub fn parse_entries(entries: &[String]) -> Result<Vec<Entry>, String> {
    entries
        .iter()
        .enumerate()
        .map(|(index, text)| {
            Entry::parse(text).map_err(|error| format!("backends[{index}]: {error}"))
        })
        .collect()
}

/// Looks a name up: the system resolver, or a stand-in in tests.
type Resolve = fn(String, u16) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>>;

/// The configured entries and the last good addresses of each DNS name.
#[derive(Debug)]
pub struct Discovery {
    entries: Vec<Entry>,
    /// Per entry: the addresses it stands for now (one for a fixed address).
    resolved: Vec<Vec<BackendAddr>>,
    /// Per entry: a lookup still under way from an earlier round.
    pending: Vec<Option<JoinHandle<std::io::Result<Vec<SocketAddr>>>>>,
    refresh: Duration,
    resolve: Resolve,
}

fn system_resolve(name: String, port: u16) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
    Box::pin(async move {
        Ok(tokio::net::lookup_host((name.as_str(), port))
            .await?
            .collect())
    })
}

impl Discovery {
    /// Discovery for `entries` (already validated), resolved every `refresh`.
    pub fn new(entries: Vec<Entry>, refresh: Duration) -> Self {
        let resolved = entries
            .iter()
            .map(|entry| match entry {
                Entry::Fixed(addr) => vec![addr.clone()],
                Entry::Dns(_) => Vec::new(),
            })
            .collect();
        let pending = entries.iter().map(|_| None).collect();
        Self {
            entries,
            resolved,
            pending,
            refresh,
            resolve: system_resolve,
        }
    }

    /// Whether any entry is a DNS name (then [`Discovery::run`] has work to do).
    pub fn has_dns(&self) -> bool {
        self.entries
            .iter()
            .any(|entry| matches!(entry, Entry::Dns(_)))
    }

    /// Whether nothing is configured.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The backend set as last resolved: entries in order, duplicates kept (the balancer
    /// collapses them).
    pub fn addrs(&self) -> Vec<BackendAddr> {
        self.resolved.iter().flatten().cloned().collect()
    }

    /// Resolves every DNS name once, side by side, each within `dns_refresh`; a failed or
    /// unanswered lookup keeps the name's last good addresses. Notes in `tls_names` the name
    /// each `dns+https` address is checked for. Returns how many lookups failed.
    pub async fn refresh(&mut self, balancer: &Balancer, tls_names: &TlsNames) -> usize {
        let deadline = tokio::time::Instant::now() + self.refresh;
        for (entry, pending) in self.entries.iter().zip(self.pending.iter_mut()) {
            if let (Entry::Dns(dns), None) = (entry, &pending) {
                *pending = Some(tokio::spawn((self.resolve)(dns.name.clone(), dns.port)));
            }
        }
        let mut failures = 0;
        let rounds = self
            .entries
            .iter()
            .zip(&mut self.resolved)
            .zip(&mut self.pending);
        for ((entry, resolved), pending) in rounds {
            let (Entry::Dns(dns), Some(lookup)) = (entry, pending.as_mut()) else {
                continue;
            };
            let error = match tokio::time::timeout_at(deadline, lookup).await {
                Ok(Ok(Ok(found))) => {
                    *pending = None;
                    *resolved = backends(dns, found);
                    continue;
                }
                Ok(Ok(Err(error))) => error.to_string(),
                Ok(Err(panicked)) => panicked.to_string(),
                Err(_) => "no answer within dns_refresh; waited for again next round".to_owned(),
            };
            if pending.as_ref().is_some_and(JoinHandle::is_finished) {
                *pending = None;
            }
            failures += 1;
            balancer.metrics().dns_lookup_failures.add(1, &[]);
            tracing::warn!(
                name = dns.name,
                %error,
                kept = resolved.len(),
                "DNS lookup failed; keeping the last good addresses"
            );
        }
        // The names `dns+https` backends are checked for: those of the addresses in the set.
        tls_names.set(
            self.entries
                .iter()
                .zip(&self.resolved)
                .flat_map(|(entry, resolved)| {
                    let name = match entry {
                        Entry::Dns(dns) if dns.https => Some(dns.name.as_str()),
                        _ => None,
                    };
                    resolved.iter().filter_map(move |addr| {
                        Some((addr.authority().as_str().parse().ok()?, name?))
                    })
                }),
        );
        failures
    }

    /// Resolves every `dns_refresh` and applies each change to `balancer`, until a set-backends
    /// call takes the set over.
    pub async fn run(mut self, balancer: Arc<Balancer>, tls_names: TlsNames) {
        let mut applied = self.addrs();
        let mut ticker = tokio::time::interval(self.refresh);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            if balancer.backends_set_by_admin() {
                // Addresses given by set-backends are checked for what they say.
                tls_names.set([]);
                tracing::info!(
                    "set-backends replaced the configured backends; DNS discovery stops"
                );
                return;
            }
            self.refresh(&balancer, &tls_names).await;
            let addrs = self.addrs();
            if addrs == applied {
                continue;
            }
            if balancer.set_discovered_backends(addrs.clone()).is_none() {
                continue;
            }
            let list: Vec<&str> = addrs.iter().map(BackendAddr::as_str).collect();
            tracing::info!(backends = ?list, "backend set replaced by DNS discovery");
            applied = addrs;
        }
    }
}

/// The addresses `dns` resolved to, as backends, sorted and without repeats.
fn backends(dns: &DnsName, found: Vec<SocketAddr>) -> Vec<BackendAddr> {
    let scheme = if dns.https { "https://" } else { "" };
    let unique: BTreeSet<SocketAddr> = found.into_iter().collect();
    unique
        .into_iter()
        .filter_map(|addr| format!("{scheme}{addr}").parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_addresses_or_dns_names() {
        assert_eq!(
            Entry::parse("dns://vllm-headless.default.svc.cluster.local:8000").unwrap(),
            Entry::Dns(DnsName {
                name: "vllm-headless.default.svc.cluster.local".into(),
                port: 8000,
                https: false,
            })
        );
        assert!(matches!(
            Entry::parse("DNS+HTTPS://Replicas:443").unwrap(),
            Entry::Dns(DnsName {
                https: true,
                port: 443,
                ..
            })
        ));
        assert!(matches!(
            Entry::parse("10.0.0.1:8080").unwrap(),
            Entry::Fixed(_)
        ));
        for bad in [
            "dns://name",
            "dns://:80",
            "dns://name:0",
            "dns://a b:80",
            "10.0.0.1",
        ] {
            assert!(Entry::parse(bad).is_err(), "{bad}");
        }
        let error = parse_entries(&["a:1".into(), "dns://x".into()]).unwrap_err();
        assert!(error.starts_with("backends[1]: "), "{error}");
    }

    use std::sync::atomic::{AtomicUsize, Ordering};

    static SLOW_LOOKUPS: AtomicUsize = AtomicUsize::new(0);

    /// `fast` answers at once, `slow` after 58 s, `broken` fails.
    fn stand_in(name: String, port: u16) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
        Box::pin(async move {
            match name.as_str() {
                "fast" => Ok(vec![SocketAddr::from(([10, 0, 0, 1], port))]),
                "slow" => {
                    SLOW_LOOKUPS.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(58)).await;
                    Ok(vec![SocketAddr::from(([10, 0, 0, 2], port))])
                }
                _ => Err(std::io::Error::other("no such name")),
            }
        })
    }

    fn balancer() -> Arc<Balancer> {
        crate::config::Settings::from_config(crate::config::Config::default())
            .unwrap()
            .balancer()
            .unwrap()
    }

    /// A hung lookup costs one `dns_refresh`, not the other names' refresh: the names are looked
    /// up side by side, the hung one counts as failed for the round and is waited for again in
    /// the next (not started twice), and its answer is applied when it comes.
    #[tokio::test(start_paused = true)]
    async fn a_hung_lookup_neither_delays_the_others_nor_piles_up() {
        let entries = parse_entries(&[
            "dns://slow:80".into(),
            "dns://fast:80".into(),
            "dns://broken:80".into(),
        ])
        .unwrap();
        let mut discovery = Discovery::new(entries, Duration::from_secs(5));
        discovery.resolve = stand_in;
        let balancer = balancer();
        let names = TlsNames::default();
        let started = tokio::time::Instant::now();
        assert_eq!(discovery.refresh(&balancer, &names).await, 2);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        let addrs: Vec<String> = discovery.addrs().iter().map(|a| a.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.1:80"]);
        for _ in 0..11 {
            discovery.refresh(&balancer, &names).await;
        }
        assert_eq!(
            SLOW_LOOKUPS.load(Ordering::Relaxed),
            1,
            "one lookup of the hung name"
        );
        let addrs: Vec<String> = discovery.addrs().iter().map(|a| a.to_string()).collect();
        assert_eq!(addrs, ["10.0.0.2:80", "10.0.0.1:80"]);
        // Its answer came: the next round starts a new lookup.
        discovery.refresh(&balancer, &names).await;
        assert_eq!(SLOW_LOOKUPS.load(Ordering::Relaxed), 2);
    }

    /// A `dns+https` address is checked for the name that resolved to it while that name still
    /// resolves to it, and forgotten once it no longer stands for a `dns+https` backend.
    #[tokio::test(start_paused = true)]
    async fn tls_names_follow_the_resolved_set() {
        let balancer = balancer();
        let names = TlsNames::default();
        let addr = SocketAddr::from(([10, 0, 0, 1], 443));
        let mut https = Discovery::new(
            parse_entries(&["dns+https://fast:443".into()]).unwrap(),
            Duration::from_secs(1),
        );
        https.resolve = stand_in;
        assert_eq!(https.refresh(&balancer, &names).await, 0);
        let noted = names.get(addr).map(|name| name.to_str().into_owned());
        assert_eq!(noted.as_deref(), Some("fast"));
        let mut plain = Discovery::new(
            parse_entries(&["dns://fast:443".into()]).unwrap(),
            Duration::from_secs(1),
        );
        plain.resolve = stand_in;
        plain.refresh(&balancer, &names).await;
        assert!(names.get(addr).is_none());
    }
}
