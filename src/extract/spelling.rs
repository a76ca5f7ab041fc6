//! Numbers and dates as documents spell them. A record says `55.5` where the invoice says
//! `55.50`, `1234.5` for `1,234.50` or `1.234,50`, and `2025-03-14` for `14/03/2025` or
//! `March 14, 2025`: grounding finds those values by what they mean, not by their characters.
//! Positions are characters of the document (Unicode scalar values), as spans count them.

/// A number written in the document: where, and every value its spelling can mean.
#[derive(Debug, Clone, PartialEq)]
pub struct NumberToken {
    pub start: usize,
    pub end: usize,
    pub values: Vec<f64>,
}

/// A date written in the document: where, and every (year, month, day) it can mean.
#[derive(Debug, Clone, PartialEq)]
pub struct DateToken {
    pub start: usize,
    pub end: usize,
    pub dates: Vec<(i32, u32, u32)>,
}

/// Every run of digits with `.`, `,` or `'` between digit groups, with a `-` before it where
/// that is no hyphen (nothing alphanumeric just before), in document order.
pub fn numbers(chars: &[char]) -> Vec<NumberToken> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_digit() || (i > 0 && chars[i - 1].is_ascii_digit()) {
            i += 1;
            continue;
        }
        let mut end = i;
        // Digits, and a separator only where a digit follows it (a sentence's full stop or a
        // list's comma is no part of the number).
        while end < chars.len()
            && (chars[end].is_ascii_digit()
                || (matches!(chars[end], '.' | ',' | '\'') && chars.get(end + 1).is_some_and(char::is_ascii_digit)))
        {
            end += 1;
        }
        let negative = i > 0 && chars[i - 1] == '-' && (i < 2 || !chars[i - 2].is_alphanumeric());
        let start = if negative { i - 1 } else { i };
        let text: String = chars[i..end].iter().collect();
        let sign = if negative { -1.0 } else { 1.0 };
        let values = readings(&text).into_iter().map(|v| sign * v).collect();
        out.push(NumberToken { start, end, values });
        i = end;
    }
    out
}

/// The values a run of digit groups can mean: its last separator as the decimal point (with
/// the others grouping thousands), and, where every group after the first has three digits,
/// all separators grouping thousands.
fn readings(text: &str) -> Vec<f64> {
    let groups: Vec<&str> = text.split(['.', ',', '\'']).collect();
    let digits: String = groups.concat();
    let mut out = Vec::new();
    if groups.len() == 1 {
        out.extend(digits.parse::<f64>().ok());
        return out;
    }
    let (whole, fraction) = groups.split_at(groups.len() - 1);
    if let Ok(v) = format!("{}.{}", whole.concat(), fraction[0]).parse::<f64>() {
        out.push(v);
    }
    if groups[1..].iter().all(|g| g.len() == 3) {
        out.extend(digits.parse::<f64>().ok());
    }
    out
}

/// Whether a number from the record is one of a token's readings.
pub fn same_number(value: f64, token: &NumberToken) -> bool {
    token
        .values
        .iter()
        .any(|v| (v - value).abs() <= 1e-9 * value.abs().max(1.0))
}

const MONTHS: [&str; 12] = [
    "january",
    "february",
    "march",
    "april",
    "may",
    "june",
    "july",
    "august",
    "september",
    "october",
    "november",
    "december",
];

/// An English month name or its abbreviation of three letters or more (`Sept` included).
fn month(word: &str) -> Option<u32> {
    let w = word.to_lowercase();
    let w = w.trim_end_matches('.');
    if w.len() < 3 {
        return None;
    }
    MONTHS.iter().position(|m| m.starts_with(w)).map(|i| i as u32 + 1)
}

/// A year as written: four digits, or two (taken as 19xx and 20xx).
fn years(text: &str) -> Vec<i32> {
    match (text.len(), text.parse::<i32>()) {
        (4, Ok(y)) => vec![y],
        (2, Ok(y)) => vec![2000 + y, 1900 + y],
        _ => Vec::new(),
    }
}

fn valid(y: i32, m: u32, d: u32) -> Option<(i32, u32, u32)> {
    ((1..=12).contains(&m) && (1..=31).contains(&d)).then_some((y, m, d))
}

/// Every date in the document: numeric (`2025-03-14`, `14/03/2025`, `3/14/25`, `14.03.2025`;
/// a day and month that could be either way round mean both) and with English month names
/// (`March 14, 2025`, `14 Mar 2025`, `14th of March 2025`).
pub fn dates(chars: &[char]) -> Vec<DateToken> {
    // Words: runs of letters or digits, with their positions.
    let mut words: Vec<(usize, usize, String)> = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_alphanumeric() {
            i += 1;
            continue;
        }
        let digit = chars[i].is_ascii_digit();
        let mut end = i;
        while end < chars.len() && chars[end].is_alphanumeric() && chars[end].is_ascii_digit() == digit {
            end += 1;
        }
        words.push((i, end, chars[i..end].iter().collect()));
        i = end;
    }
    let mut out = Vec::new();
    let number = |w: &str| {
        w.chars()
            .all(|c| c.is_ascii_digit())
            .then(|| w.parse::<u32>().ok())
            .flatten()
    };
    let day = |k: usize| {
        let w = &words.get(k)?.2;
        number(w).filter(|d| (1..=31).contains(d) && w.len() <= 2)
    };
    // The word after a day, past an ordinal's letters written onto it (`14th`).
    let after_day = |k: usize| match words.get(k + 1) {
        Some(w) if w.0 == words[k].1 && ["st", "nd", "rd", "th"].contains(&w.2.to_lowercase().as_str()) => k + 2,
        _ => k + 1,
    };
    let year_at = |k: usize| words.get(k).and_then(|w| years(&w.2).first().copied());
    for k in 0..words.len() {
        // Numeric: three digit groups joined by one separator (`-`, `/` or `.`), used twice.
        if k + 2 < words.len() {
            let (a, b, c) = (&words[k], &words[k + 1], &words[k + 2]);
            let sep1: String = chars[a.1..b.0].iter().collect();
            let sep2: String = chars[b.1..c.0].iter().collect();
            if let (Some(x), Some(y), Some(z)) = (number(&a.2), number(&b.2), number(&c.2)) {
                if sep1 == sep2 && matches!(sep1.as_str(), "-" | "/" | ".") {
                    let mut found = Vec::new();
                    if a.2.len() == 4 {
                        found.extend(valid(x as i32, y, z));
                    } else {
                        for year in years(&c.2) {
                            found.extend(valid(year, y, x)); // day, month, year
                            found.extend(valid(year, x, y)); // month, day, year
                        }
                    }
                    found.dedup();
                    out.push(DateToken {
                        start: a.0,
                        end: c.1,
                        dates: found,
                    });
                }
            }
        }
        // Month name first: `March 14, 2025`, `Mar 14th 2025`.
        if let (Some(m), Some(d)) = (month(&words[k].2), day(k + 1)) {
            let y = after_day(k + 1);
            if let Some(year) = year_at(y) {
                out.push(DateToken {
                    start: words[k].0,
                    end: words[y].1,
                    dates: valid(year, m, d).into_iter().collect(),
                });
            }
        }
        // Day first: `14 March 2025`, `14th of March, 2025`.
        if let Some(d) = day(k) {
            let mut j = after_day(k);
            if words.get(j).is_some_and(|w| w.2.eq_ignore_ascii_case("of")) {
                j += 1;
            }
            if let (Some(m), Some(year)) = (words.get(j).and_then(|w| month(&w.2)), year_at(j + 1)) {
                out.push(DateToken {
                    start: words[k].0,
                    end: words[j + 1].1,
                    dates: valid(year, m, d).into_iter().collect(),
                });
            }
        }
    }
    out.retain(|t| !t.dates.is_empty());
    out.sort_by_key(|t| t.start);
    out
}

/// A record's date (`YYYY-MM-DD`, or the date part of a date-time), as (year, month, day).
pub fn iso_date(value: &str) -> Option<(i32, u32, u32)> {
    let v = value.trim();
    let date = v.get(..10)?;
    if v.len() > 10 && !v[10..].starts_with(['T', 't', ' ']) {
        return None;
    }
    let mut parts = date.split('-');
    let (y, m, d) = (parts.next()?, parts.next()?, parts.next()?);
    if y.len() != 4 || m.len() != 2 || d.len() != 2 {
        return None;
    }
    valid(y.parse().ok()?, m.parse().ok()?, d.parse().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chars(s: &str) -> Vec<char> {
        s.chars().collect()
    }

    fn number_at(doc: &str, value: f64) -> Option<String> {
        let c = chars(doc);
        numbers(&c)
            .into_iter()
            .find(|t| same_number(value, t))
            .map(|t| c[t.start..t.end].iter().collect())
    }

    #[test]
    fn numbers_are_read_in_the_spellings_documents_use() {
        assert_eq!(number_at("TOTAL DUE: 55.50 EUR", 55.5).as_deref(), Some("55.50"));
        assert_eq!(number_at("Total 1,234.50 USD", 1234.5).as_deref(), Some("1,234.50"));
        assert_eq!(number_at("Summe 1.234,50 EUR", 1234.5).as_deref(), Some("1.234,50"));
        assert_eq!(number_at("Betrag 15,50 €", 15.5).as_deref(), Some("15,50"));
        assert_eq!(number_at("pop. 1,234,567", 1234567.0).as_deref(), Some("1,234,567"));
        assert_eq!(number_at("CHF 12'500.00", 12500.0).as_deref(), Some("12'500.00"));
        // A hyphen after a letter is no minus sign; a minus before a number is.
        assert_eq!(number_at("INVOICE INV-2291", 2291.0).as_deref(), Some("2291"));
        assert_eq!(number_at("credit: -40.00", -40.0).as_deref(), Some("-40.00"));
        // A period that ends a sentence is not a decimal point.
        assert_eq!(number_at("We shipped 12. Thanks", 12.0).as_deref(), Some("12"));
        assert_eq!(number_at("55.50", 55.0), None);
        // Character positions, not bytes.
        let c = chars("Größe: 4,5 m");
        let t = numbers(&c);
        assert_eq!((t[0].start, t[0].end), (7, 10));
    }

    fn date_at(doc: &str, iso: &str) -> Option<String> {
        let c = chars(doc);
        let want = iso_date(iso).unwrap();
        dates(&c)
            .into_iter()
            .find(|t| t.dates.contains(&want))
            .map(|t| c[t.start..t.end].iter().collect())
    }

    #[test]
    fn dates_are_read_numeric_either_way_round_and_with_month_names() {
        assert_eq!(date_at("Date: 2025-03-14", "2025-03-14").as_deref(), Some("2025-03-14"));
        assert_eq!(
            date_at("Datum: 14.03.2025", "2025-03-14").as_deref(),
            Some("14.03.2025")
        );
        assert_eq!(date_at("on 14/03/2025", "2025-03-14").as_deref(), Some("14/03/2025"));
        assert_eq!(date_at("on 3/14/25", "2025-03-14").as_deref(), Some("3/14/25"));
        assert_eq!(date_at("04/05/2025", "2025-05-04").as_deref(), Some("04/05/2025"));
        assert_eq!(date_at("04/05/2025", "2025-04-05").as_deref(), Some("04/05/2025"));
        assert_eq!(
            date_at("Issued March 14, 2025.", "2025-03-14").as_deref(),
            Some("March 14, 2025")
        );
        assert_eq!(date_at("due 14 Mar 2025", "2025-03-14").as_deref(), Some("14 Mar 2025"));
        assert_eq!(
            date_at("the 14th of March 2025", "2025-03-14").as_deref(),
            Some("14th of March 2025")
        );
        assert_eq!(date_at("Sept. 3, 2024", "2024-09-03").as_deref(), Some("Sept. 3, 2024"));
        assert_eq!(date_at("March 14, 2025", "2025-03-15"), None);
        assert_eq!(date_at("may 2025 be good", "2025-05-01"), None);
        assert_eq!(iso_date("2025-03-14T10:00:00Z"), Some((2025, 3, 14)));
        assert_eq!(iso_date("2025-3-14"), None);
        assert_eq!(iso_date("2025-13-01"), None);
    }
}
