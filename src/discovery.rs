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
//! The set is the configured entries in order, each DNS name's addresses sorted. A set-backends
//! call replaces the whole set, as always, and from then on the admin API owns it: discovery
//! stops, so the two never overwrite each other.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{BackendAddr, canonical_host};
use crate::balancer::Balancer;

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

/// The configured entries and the last good addresses of each DNS name.
#[derive(Debug)]
pub struct Discovery {
    entries: Vec<Entry>,
    /// Per entry: the addresses it stands for now (one for a fixed address).
    resolved: Vec<Vec<BackendAddr>>,
    refresh: Duration,
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
        Self {
            entries,
            resolved,
            refresh,
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

    /// Resolves every DNS name once; a failed lookup keeps the name's last good addresses.
    /// Returns how many lookups failed.
    pub async fn refresh(&mut self, balancer: &Balancer) -> usize {
        let mut failures = 0;
        for (entry, resolved) in self.entries.iter().zip(self.resolved.iter_mut()) {
            let Entry::Dns(dns) = entry else { continue };
            match lookup(dns).await {
                Ok(addrs) => *resolved = addrs,
                Err(error) => {
                    failures += 1;
                    balancer.metrics().dns_lookup_failures.add(1, &[]);
                    tracing::warn!(
                        name = dns.name,
                        %error,
                        kept = resolved.len(),
                        "DNS lookup failed; keeping the last good addresses"
                    );
                }
            }
        }
        failures
    }

    /// Resolves every `dns_refresh` and applies each change to `balancer`, until a set-backends
    /// call takes the set over.
    pub async fn run(mut self, balancer: Arc<Balancer>) {
        let mut applied = self.addrs();
        let mut ticker = tokio::time::interval(self.refresh);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            if balancer.backends_set_by_admin() {
                tracing::info!(
                    "set-backends replaced the configured backends; DNS discovery stops"
                );
                return;
            }
            self.refresh(&balancer).await;
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

/// The addresses `dns` resolves to, as backends, sorted and without repeats.
async fn lookup(dns: &DnsName) -> std::io::Result<Vec<BackendAddr>> {
    let found = tokio::net::lookup_host((dns.name.as_str(), dns.port)).await?;
    let scheme = if dns.https { "https://" } else { "" };
    let unique: BTreeSet<std::net::SocketAddr> = found.collect();
    if dns.https {
        // Reached at its address, checked for the name.
        for addr in &unique {
            crate::upstream::name_tls_address(*addr, &dns.name);
        }
    }
    Ok(unique
        .into_iter()
        .filter_map(|addr| format!("{scheme}{addr}").parse().ok())
        .collect())
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
}
