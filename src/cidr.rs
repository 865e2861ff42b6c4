//! IP networks in CIDR notation, for the backend allow-list.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An IPv4 or IPv6 network such as `10.0.0.0/8` or `fd00::/8`. A bare address is a /32 or /128.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Whether `ip` is inside the network. IPv4-mapped IPv6 addresses match IPv4 networks.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.network, ip.to_canonical()) {
            (IpAddr::V4(network), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(network) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(network), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(network) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let (address, prefix) = match text.split_once('/') {
            Some((address, prefix)) => (address, Some(prefix)),
            None => (text, None),
        };
        let network: IpAddr = address
            .parse()
            .map_err(|_| format!("{text:?} is not an IP network (expected e.g. 10.0.0.0/8)"))?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(prefix) => prefix
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{text:?} has an invalid prefix length (0-{max})"))?,
        };
        Ok(Self { network, prefix })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(text: &str) -> Cidr {
        text.parse().unwrap()
    }

    #[test]
    fn matches_inside_and_not_outside() {
        assert!(cidr("10.0.0.0/8").contains("10.200.3.4".parse().unwrap()));
        assert!(!cidr("10.0.0.0/8").contains("11.0.0.1".parse().unwrap()));
        assert!(cidr("0.0.0.0/0").contains("192.0.2.1".parse().unwrap()));
        assert!(cidr("127.0.0.1").contains("127.0.0.1".parse().unwrap()));
        assert!(!cidr("127.0.0.1").contains("127.0.0.2".parse().unwrap()));
        assert!(cidr("fd00::/8").contains("fd12::1".parse().unwrap()));
        assert!(!cidr("fd00::/8").contains("10.0.0.1".parse().unwrap()));
        assert!(cidr("10.0.0.0/8").contains("::ffff:10.1.1.1".parse().unwrap()));
    }

    #[test]
    fn rejects_bad_networks() {
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("fd00::/129".parse::<Cidr>().is_err());
        assert!("example.com/8".parse::<Cidr>().is_err());
        assert!("10.0.0.0/x".parse::<Cidr>().is_err());
    }
}
