//! Dates as the router writes them: an HTTP `Date` (IMF-fixdate, RFC 9110 §5.6.7) for the HTTP/1
//! server's answers, and an RFC 3339 time with milliseconds for the access log. One calendar
//! computation serves both.

use std::time::{SystemTime, UNIX_EPOCH};

/// The current time as an HTTP date: `Sun, 06 Nov 1994 08:49:37 GMT`. Formatted once per second
/// on each thread (answers are dated to the second).
pub fn http_date_now() -> [u8; 29] {
    thread_local! {
        static CACHED: std::cell::Cell<(u64, [u8; 29])> = const { std::cell::Cell::new((u64::MAX, [0; 29])) };
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    CACHED.with(|cached| {
        let (second, text) = cached.get();
        if second == now {
            return text;
        }
        let text = http_date(now);
        cached.set((now, text));
        text
    })
}

/// `Sun, 06 Nov 1994 08:49:37 GMT` for `seconds` since the Unix epoch.
pub fn http_date(seconds: u64) -> [u8; 29] {
    const DAYS: [&[u8; 3]; 7] = [b"Thu", b"Fri", b"Sat", b"Sun", b"Mon", b"Tue", b"Wed"];
    const MONTHS: [&[u8; 3]; 12] = [
        b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov",
        b"Dec",
    ];
    let days = seconds / 86_400;
    let second_of_day = seconds % 86_400;
    let (year, month, day) = civil_date(days);
    let mut text = [0u8; 29];
    let two = |value: u64| [b'0' + (value / 10) as u8, b'0' + (value % 10) as u8];
    text[..3].copy_from_slice(DAYS[(days % 7) as usize]);
    text[3..5].copy_from_slice(b", ");
    text[5..7].copy_from_slice(&two(day as u64));
    text[7] = b' ';
    text[8..11].copy_from_slice(MONTHS[(month - 1) as usize]);
    text[11] = b' ';
    let year = year.clamp(0, 9999) as u64;
    text[12..14].copy_from_slice(&two(year / 100));
    text[14..16].copy_from_slice(&two(year % 100));
    text[16] = b' ';
    text[17..19].copy_from_slice(&two(second_of_day / 3600));
    text[19] = b':';
    text[20..22].copy_from_slice(&two(second_of_day / 60 % 60));
    text[22] = b':';
    text[23..25].copy_from_slice(&two(second_of_day % 60));
    text[25..29].copy_from_slice(b" GMT");
    text
}

/// `time` as `2026-12-01T10:00:00.123Z` (a time before the Unix epoch as the epoch).
pub fn rfc3339(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let seconds = since.as_secs();
    let (year, month, day) = civil_date(seconds / 86_400);
    let of_day = seconds % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60,
        since.subsec_millis()
    )
}

/// Year, month (1–12) and day of the month of the day `days` after 1970-01-01 (Howard
/// Hinnant's algorithm).
fn civil_date(days: u64) -> (i64, i64, i64) {
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    (year_of_era + era * 400 + i64::from(month <= 2), month, day)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn dates_are_imf_fixdates() {
        assert_eq!(&http_date(784_111_777), b"Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(&http_date(0), b"Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(&http_date(951_782_400), b"Tue, 29 Feb 2000 00:00:00 GMT");
        assert_eq!(&http_date(1_796_083_199), b"Mon, 30 Nov 2026 23:59:59 GMT");
    }

    #[test]
    fn times_are_rfc3339_with_milliseconds() {
        let at = |seconds: u64, millis: u64| {
            rfc3339(UNIX_EPOCH + Duration::from_secs(seconds) + Duration::from_millis(millis))
        };
        assert_eq!(at(784_111_777, 123), "1994-11-06T08:49:37.123Z");
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(951_782_400, 7), "2000-02-29T00:00:00.007Z");
        assert_eq!(at(1_796_083_199, 999), "2026-11-30T23:59:59.999Z");
    }

    #[test]
    fn the_date_now_is_the_date_of_now() {
        let before = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let now = http_date_now();
        let after = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(now == http_date(before) || now == http_date(after));
    }
}
