//! One-sided bounds on JSON numbers as regexes over their plain decimal spellings (no
//! exponent): `x >= a`, `x > a`, `x <= b`, `x < b`. A two-sided range is the intersection of
//! two of these DFAs. Comparison is exact on the decimal text, digit by digit, so the DFA
//! refuses a digit as soon as no number in range can start with what was written.
//!
//! Not admitted, though in range: exponent spellings (`1e-05`) and `-0` where zero is the
//! bound. Both are rare in bounded fields; refusing them keeps every admitted number valid.

use super::int_range::natural_range;

/// Any non-negative number without exponent.
const MAGNITUDE: &str = r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?";
/// An optional fraction.
const ANY_FRACTION: &str = r"(?:\.[0-9]+)?";
const NOTHING: &str = r"[^\x00-\x{10FFFF}]";

/// A finite bound as (sign, integer digits, fraction digits without trailing zeros); `None`
/// when its integer part does not fit the integer range builder.
fn split(bound: f64) -> Option<(bool, u128, String)> {
    if !bound.is_finite() {
        return None;
    }
    // Display never uses an exponent and prints the shortest text that reads back the same.
    let text = format!("{}", bound.abs());
    let (int, frac) = text.split_once('.').unwrap_or((&text, ""));
    Some((bound < 0.0, int.parse().ok()?, frac.trim_end_matches('0').to_string()))
}

/// Numbers `>= bound` (`> bound` when `exclusive`).
pub fn at_least(bound: f64, exclusive: bool) -> Option<String> {
    let (negative, int, frac) = split(bound)?;
    Some(if !negative || (int == 0 && frac.is_empty()) {
        format!("(?:{})", magnitude_at_least(int, &frac, exclusive))
    } else {
        format!("(?:{MAGNITUDE}|-(?:{}))", magnitude_at_most(int, &frac, exclusive))
    })
}

/// Numbers `<= bound` (`< bound` when `exclusive`).
pub fn at_most(bound: f64, exclusive: bool) -> Option<String> {
    let (negative, int, frac) = split(bound)?;
    Some(if !negative || (int == 0 && frac.is_empty()) {
        // Below zero everything is in range, except `-0` when zero itself is not.
        let below = if int == 0 && frac.is_empty() && exclusive {
            magnitude_at_least(0, "", true)
        } else {
            MAGNITUDE.to_string()
        };
        format!("(?:{}|-(?:{below}))", magnitude_at_most(int, &frac, exclusive))
    } else {
        format!("(?:-(?:{}))", magnitude_at_least(int, &frac, exclusive))
    })
}

/// Non-negative numbers at least `int.frac`.
fn magnitude_at_least(int: u128, frac: &str, exclusive: bool) -> String {
    let above = match int.checked_add(1) {
        Some(next) => format!("(?:{}){ANY_FRACTION}", natural_range(next, None)),
        None => NOTHING.to_string(),
    };
    let fraction = if frac.is_empty() {
        if exclusive {
            r"\.[0-9]*[1-9][0-9]*".to_string()
        } else {
            ANY_FRACTION.to_string()
        }
    } else {
        // Without a fraction the number is `int`, below `int.frac`.
        format!(r"\.{}", digits_at_least(frac.as_bytes(), exclusive))
    };
    format!("{above}|{int}(?:{fraction})")
}

/// Non-negative numbers at most `int.frac`.
fn magnitude_at_most(int: u128, frac: &str, exclusive: bool) -> String {
    let below = match int.checked_sub(1) {
        Some(prev) => format!("(?:{}){ANY_FRACTION}|", natural_range(0, Some(prev))),
        None => String::new(),
    };
    let fraction = if frac.is_empty() {
        if exclusive {
            NOTHING.to_string()
        } else {
            r"(?:\.0+)?".to_string()
        }
    } else {
        format!(r"(?:\.{})?", digits_at_most(frac.as_bytes(), exclusive))
    };
    format!("{below}{int}(?:{fraction})")
}

/// Non-empty digit strings `f` with `0.f >= 0.bound` (`>` when `exclusive`); `bound` is
/// non-empty and ends in a non-zero digit, so a string that stops short of it is smaller.
fn digits_at_least(bound: &[u8], exclusive: bool) -> String {
    let d = bound[0] - b'0';
    let rest = &bound[1..];
    let tail = if !rest.is_empty() {
        digits_at_least(rest, exclusive)
    } else if exclusive {
        "[0-9]*[1-9][0-9]*".to_string()
    } else {
        "[0-9]*".to_string()
    };
    let mut alts = vec![format!("{d}(?:{tail})")];
    if d < 9 {
        alts.push(format!("[{}-9][0-9]*", d + 1));
    }
    format!("(?:{})", alts.join("|"))
}

/// Non-empty digit strings `f` with `0.f <= 0.bound` (`<` when `exclusive`).
fn digits_at_most(bound: &[u8], exclusive: bool) -> String {
    let d = bound[0] - b'0';
    let rest = &bound[1..];
    // After the same digit: stopping is smaller while digits of the bound remain.
    let tail = if !rest.is_empty() {
        format!("(?:{})?", digits_at_most(rest, exclusive))
    } else if exclusive {
        NOTHING.to_string()
    } else {
        "0*".to_string()
    };
    let mut alts = vec![format!("{d}{tail}")];
    if d > 0 {
        alts.push(format!("[0-{}][0-9]*", d - 1));
    }
    format!("(?:{})", alts.join("|"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spellings of the hundredths in [-3, 3] (with and without trailing zeros), each with its
    /// value in hundredths.
    fn samples() -> Vec<(String, i64)> {
        let mut out = Vec::new();
        for i in -300i64..=300 {
            let sign = if i < 0 { "-" } else { "" };
            let (int, frac) = (i.abs() / 100, i.abs() % 100);
            out.push((format!("{sign}{int}.{frac:02}"), i));
            out.push((format!("{sign}{int}.{frac:02}0"), i));
            if frac % 10 == 0 {
                out.push((format!("{sign}{int}.{}", frac / 10), i));
            }
            if frac == 0 {
                out.push((format!("{sign}{int}"), i));
            }
        }
        out.retain(|(t, i)| *i != 0 || !t.starts_with('-'));
        out
    }

    #[test]
    fn one_sided_bounds_agree_with_arithmetic() {
        let bounds = [-2.5, -1.0, -0.35, -0.05, 0.0, 0.05, 0.1, 0.35, 1.0, 1.25, 2.5];
        for &b in &bounds {
            for exclusive in [false, true] {
                let lo = regex::Regex::new(&format!("^{}$", at_least(b, exclusive).unwrap())).unwrap();
                let hi = regex::Regex::new(&format!("^{}$", at_most(b, exclusive).unwrap())).unwrap();
                for (text, x) in samples() {
                    let b = (b * 100.0).round() as i64;
                    let want_lo = if exclusive { x > b } else { x >= b };
                    let want_hi = if exclusive { x < b } else { x <= b };
                    assert_eq!(
                        lo.is_match(&text),
                        want_lo,
                        "{text} >{} {b}",
                        if exclusive { "" } else { "=" }
                    );
                    assert_eq!(
                        hi.is_match(&text),
                        want_hi,
                        "{text} <{} {b}",
                        if exclusive { "" } else { "=" }
                    );
                }
                for bad in ["01", "1.", ".5", "+1", "1e3", "--1", ""] {
                    assert!(!lo.is_match(bad) && !hi.is_match(bad), "{bad}");
                }
            }
        }
    }

    #[test]
    fn huge_and_odd_bounds() {
        assert!(at_least(f64::INFINITY, false).is_none());
        assert!(at_least(1e300, false).is_none());
        let re = regex::Regex::new(&format!("^{}$", at_most(1e20, false).unwrap())).unwrap();
        assert!(re.is_match("100000000000000000000") && !re.is_match("100000000000000000000.5"));
    }
}
