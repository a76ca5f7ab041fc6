//! JSON Schema string formats as regexes over the string's characters. None of them contains
//! `"`, `\` or a control character, so each is also exactly the JSON-encoded body.
//!
//! Where a format is wider than its RFC, the docs say so; `format_exactness` reports it.

use crate::json::ir::StringFormat;

const DATE: &str = r"[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-9]))";
const TIME: &str =
    r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])";
const DURATION_TIME: &str = r"T(?:[0-9]+H(?:[0-9]+M)?(?:[0-9]+S)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)";
const LABEL: &str = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
const OCTET: &str = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";
const H16: &str = r"[0-9A-Fa-f]{1,4}";

/// The regex of `format` (unanchored text, to be embedded).
pub fn format_regex(format: StringFormat) -> String {
    let hostname = format!(r"{LABEL}(?:\.{LABEL})*");
    let ipv4 = format!(r"{OCTET}(?:\.{OCTET}){{3}}");
    match format {
        StringFormat::Date => DATE.to_string(),
        StringFormat::Time => TIME.to_string(),
        StringFormat::DateTime => format!("{DATE}[Tt]{TIME}"),
        StringFormat::Duration => format!(
            r"P(?:[0-9]+W|(?:[0-9]+Y(?:[0-9]+M)?(?:[0-9]+D)?|[0-9]+M(?:[0-9]+D)?|[0-9]+D)(?:{DURATION_TIME})?|{DURATION_TIME})"
        ),
        StringFormat::Email => {
            format!(r"[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{{|}}~-]+)*@{hostname}")
        }
        StringFormat::Hostname => hostname,
        StringFormat::Ipv4 => ipv4,
        StringFormat::Ipv6 => ipv6(&ipv4),
        StringFormat::Uuid => {
            r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}".to_string()
        }
        StringFormat::Uri => {
            r"[A-Za-z][A-Za-z0-9+.-]*:(?:[A-Za-z0-9._~:/?#\[\]@!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*".to_string()
        }
    }
}

/// How `format_regex` departs from the format's definition, if it does.
pub fn format_exactness(format: StringFormat) -> Option<&'static str> {
    match format {
        StringFormat::Date | StringFormat::DateTime => Some("February 29 is accepted in every year"),
        StringFormat::Hostname | StringFormat::Email => {
            Some("labels are checked, the 253-character total is not; email local parts are dot-atoms only")
        }
        StringFormat::Time => Some("a leap second is accepted at any minute"),
        _ => None,
    }
}

/// RFC 4291 text forms: eight groups, or fewer with one `::`, optionally ending in IPv4.
fn ipv6(ipv4: &str) -> String {
    let g = H16;
    let tail32 = format!(r"(?:{g}:{g}|{ipv4})");
    let forms = [
        format!(r"(?:{g}:){{6}}{tail32}"),
        format!(r"::(?:{g}:){{5}}{tail32}"),
        format!(r"(?:{g})?::(?:{g}:){{4}}{tail32}"),
        format!(r"(?:(?:{g}:){{0,1}}{g})?::(?:{g}:){{3}}{tail32}"),
        format!(r"(?:(?:{g}:){{0,2}}{g})?::(?:{g}:){{2}}{tail32}"),
        format!(r"(?:(?:{g}:){{0,3}}{g})?::{g}:{tail32}"),
        format!(r"(?:(?:{g}:){{0,4}}{g})?::{tail32}"),
        format!(r"(?:(?:{g}:){{0,5}}{g})?::{g}"),
        format!(r"(?:(?:{g}:){{0,6}}{g})?::"),
    ];
    format!("(?:{})", forms.join("|"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use StringFormat::*;

    fn check(format: StringFormat, valid: &[&str], invalid: &[&str]) {
        let re = regex::Regex::new(&format!("^(?:{})$", format_regex(format))).unwrap();
        for v in valid {
            assert!(re.is_match(v), "{format:?} should accept {v:?}");
        }
        for v in invalid {
            assert!(!re.is_match(v), "{format:?} should refuse {v:?}");
        }
        // Each format must also compile to one of our byte DFAs.
        crate::dfa::ByteDfa::from_regex(&format_regex(format), Default::default()).unwrap();
    }

    #[test]
    fn dates_and_times() {
        check(
            Date,
            &["2024-01-31", "2023-04-30", "2024-02-29", "0001-12-01"],
            &[
                "2024-04-31",
                "2024-02-30",
                "2024-13-01",
                "2024-00-10",
                "24-01-01",
                "2024-1-01",
                "2024-01-01T00:00:00Z",
            ],
        );
        check(
            Time,
            &["23:59:59Z", "00:00:00.123+05:30", "12:30:60z", "08:15:00-08:00"],
            &["24:00:00Z", "12:60:00Z", "12:30:00", "12:30Z", "1:30:00Z"],
        );
        check(
            DateTime,
            &["2024-01-31T23:59:59Z", "1999-12-31t00:00:00.5-01:00"],
            &["2024-01-31 23:59:59Z", "2024-01-31T23:59:59", "2024-01-31"],
        );
        check(
            Duration,
            &["P1D", "PT1H", "P1Y2M3DT4H5M6S", "P4W", "PT0S"],
            &["P", "PT", "1D", "P1H", "PT1D", "P1W2D"],
        );
    }

    #[test]
    fn names_and_addresses() {
        check(
            Email,
            &["jane.doe@example.com", "a+b@x.org", "x@localhost"],
            &["jane@", "@example.com", "jane doe@x.com", "a..b@x.com", "a@-x.com"],
        );
        check(
            Hostname,
            &["example.com", "a", "xn--bcher-kva.example", "my-host1"],
            &["-a.com", "a-.com", "a..b", "", "ex ample.com"],
        );
        check(
            Ipv4,
            &["0.0.0.0", "192.168.1.255", "255.255.255.255"],
            &["256.1.1.1", "1.2.3", "01.2.3.4", "1.2.3.4.5"],
        );
        check(
            Ipv6,
            &[
                "::",
                "::1",
                "2001:db8::8a2e:370:7334",
                "2001:0db8:85a3:0000:0000:8a2e:0370:7334",
                "::ffff:192.168.1.1",
                "fe80::",
            ],
            &[":::", "1::2::3", "12345::", "1:2:3:4:5:6:7:8:9", "g::1"],
        );
        check(
            Uuid,
            &[
                "123e4567-e89b-12d3-a456-426614174000",
                "AAAAAAAA-BBBB-CCCC-DDDD-EEEEEEEEEEEE",
            ],
            &[
                "123e4567e89b12d3a456426614174000",
                "123e4567-e89b-12d3-a456-42661417400",
                "g23e4567-e89b-12d3-a456-426614174000",
            ],
        );
        check(
            Uri,
            &[
                "https://example.com/a?b=c#d",
                "urn:isbn:0451450523",
                "mailto:a@b.c",
                "http://x/%20y",
            ],
            &["example.com", "://x", "http://x y", "1http://x", "http://x/%zz"],
        );
    }
}
