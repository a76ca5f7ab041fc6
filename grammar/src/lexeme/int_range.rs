//! Integer bounds as a regex over canonical JSON integers (no leading zeros, no `-0`): the DFA
//! then refuses a digit as soon as no number in range can start with what was written, so a
//! bounded integer can never paint itself into a corner.

/// A regex matching exactly the decimal spellings of the integers in `[lo, hi]` (either end
/// open when `None`). `None` when the range is empty.
pub fn int_range_regex(lo: Option<i128>, hi: Option<i128>) -> Option<String> {
    if let (Some(l), Some(h)) = (lo, hi) {
        if l > h {
            return None;
        }
    }
    let mut parts = Vec::new();
    // Negative numbers: `-` then the magnitudes in [max(1, -hi), -lo].
    if lo.is_none_or(|l| l < 0) {
        let mag_lo = hi.map_or(1, |h| if h < 0 { -h } else { 1 });
        let mag_hi = lo.map(|l| -l);
        if mag_hi.is_none_or(|m| m >= mag_lo) {
            parts.push(format!(
                "-(?:{})",
                natural_range(mag_lo as u128, mag_hi.map(|m| m as u128))
            ));
        }
    }
    // Zero and positive numbers: [max(0, lo), hi].
    if hi.is_none_or(|h| h >= 0) {
        let from = lo.map_or(0, |l| l.max(0)) as u128;
        parts.push(natural_range(from, hi.map(|h| h as u128)));
    }
    Some(format!("(?:{})", parts.join("|")))
}

/// Regex for the naturals in `[lo, hi]` (`hi = None`: unbounded), canonical spellings.
pub(crate) fn natural_range(lo: u128, hi: Option<u128>) -> String {
    let mut alts = Vec::new();
    let lo_digits = digits(lo);
    match hi {
        Some(hi) => {
            for len in lo_digits..=digits(hi) {
                let a = if len == lo_digits { lo } else { pow10(len - 1) };
                let b = if len == digits(hi) { hi } else { pow10(len) - 1 };
                same_length(&a.to_string(), &b.to_string(), &mut alts);
            }
        }
        None => {
            // Up to the end of lo's length exactly, then every longer number.
            same_length(&lo.to_string(), &(pow10(lo_digits) - 1).to_string(), &mut alts);
            alts.push(format!("[1-9][0-9]{{{},}}", lo_digits));
        }
    }
    alts.join("|")
}

fn digits(n: u128) -> u32 {
    n.checked_ilog10().unwrap_or(0) + 1
}

fn pow10(k: u32) -> u128 {
    10u128.pow(k)
}

/// Alternatives covering the equal-length digit strings from `a` to `b` (`a <= b`).
fn same_length(a: &str, b: &str, out: &mut Vec<String>) {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.is_empty() {
        out.push(String::new());
        return;
    }
    if a.len() == 1 {
        out.push(class(a[0], b[0]));
        return;
    }
    let rest = a.len() - 1;
    if a[1..].iter().all(|&d| d == b'0') && b[1..].iter().all(|&d| d == b'9') {
        // Every tail: one class and a free run (without this the split below is exponential).
        out.push(format!("{}[0-9]{{{rest}}}", class(a[0], b[0])));
        return;
    }
    if a[0] == b[0] {
        let mut inner = Vec::new();
        same_length(
            std::str::from_utf8(&a[1..]).unwrap_or(""),
            std::str::from_utf8(&b[1..]).unwrap_or(""),
            &mut inner,
        );
        out.push(format!("{}(?:{})", a[0] as char, inner.join("|")));
        return;
    }
    // a0 followed by [a_rest, 99..9], the digits strictly between with any tail, then b0
    // followed by [00..0, b_rest].
    let all_nines = "9".repeat(rest);
    let all_zeros = "0".repeat(rest);
    let mut low = Vec::new();
    same_length(std::str::from_utf8(&a[1..]).unwrap_or(""), &all_nines, &mut low);
    out.push(format!("{}(?:{})", a[0] as char, low.join("|")));
    if b[0] - a[0] > 1 {
        out.push(format!("{}[0-9]{{{rest}}}", class(a[0] + 1, b[0] - 1)));
    }
    let mut high = Vec::new();
    same_length(&all_zeros, std::str::from_utf8(&b[1..]).unwrap_or(""), &mut high);
    out.push(format!("{}(?:{})", b[0] as char, high.join("|")));
}

fn class(lo: u8, hi: u8) -> String {
    if lo == hi {
        (lo as char).to_string()
    } else {
        format!("[{}-{}]", lo as char, hi as char)
    }
}

/// Integer bounds from JSON Schema's (possibly fractional, possibly exclusive) limits.
pub fn integer_bounds(
    minimum: Option<f64>,
    exclusive_min: bool,
    maximum: Option<f64>,
    exclusive_max: bool,
) -> (Option<i128>, Option<i128>) {
    let lo = minimum.map(|m| {
        let c = m.ceil();
        (if exclusive_min && c == m { c + 1.0 } else { c }) as i128
    });
    let hi = maximum.map(|m| {
        let f = m.floor();
        (if exclusive_max && f == m { f - 1.0 } else { f }) as i128
    });
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(lo: Option<i128>, hi: Option<i128>) -> Option<regex::Regex> {
        int_range_regex(lo, hi).map(|r| regex::Regex::new(&format!("^{r}$")).unwrap())
    }

    #[test]
    fn every_range_over_small_numbers_is_exact() {
        let bounds: Vec<Option<i128>> = [None]
            .into_iter()
            .chain(
                [
                    -1001, -100, -99, -10, -9, -1, 0, 1, 5, 9, 10, 19, 20, 99, 100, 101, 999, 1000, 1234,
                ]
                .map(Some),
            )
            .collect();
        for &lo in &bounds {
            for &hi in &bounds {
                let Some(re) = matcher(lo, hi) else {
                    assert!(lo.unwrap() > hi.unwrap());
                    continue;
                };
                for n in -1500i128..=1500 {
                    let inside = lo.is_none_or(|l| n >= l) && hi.is_none_or(|h| n <= h);
                    assert_eq!(re.is_match(&n.to_string()), inside, "{n} in [{lo:?}, {hi:?}]: {re}");
                }
                for bad in ["-0", "00", "01", "-01", "", "-", "1.0", "+1"] {
                    assert!(!re.is_match(bad), "{bad:?} in [{lo:?}, {hi:?}]");
                }
            }
        }
    }

    #[test]
    fn large_and_open_ranges() {
        let re = matcher(Some(0), None).unwrap();
        assert!(re.is_match("0") && re.is_match("123456789012345678901234567890"));
        assert!(!re.is_match("-1"));
        let re = matcher(Some(i64::MIN as i128), Some(i64::MAX as i128)).unwrap();
        assert!(re.is_match("9223372036854775807") && re.is_match("-9223372036854775808"));
        assert!(!re.is_match("9223372036854775808") && !re.is_match("-9223372036854775809"));
    }

    #[test]
    fn schema_bounds_become_integer_bounds() {
        assert_eq!(integer_bounds(Some(1.5), false, Some(9.5), false), (Some(2), Some(9)));
        assert_eq!(integer_bounds(Some(1.0), true, Some(9.0), true), (Some(2), Some(8)));
        assert_eq!(integer_bounds(Some(-0.5), true, None, false), (Some(0), None));
        assert_eq!(integer_bounds(None, false, Some(0.0), false), (None, Some(0)));
    }
}
