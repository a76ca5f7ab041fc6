//! Stop strings over streamed text. Text that might be the start of a stop string is held back
//! until it is known not to be, so a stop string never reaches the client, even in part.

pub struct StopStrings {
    stops: Vec<String>,
    text: String,
    emitted: usize,
}

pub enum StopScan {
    /// Text safe to emit now.
    Continue(String),
    /// A stop string matched: the text before it, and the stop string.
    Stopped(String, String),
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings {
            stops,
            text: String::new(),
            emitted: 0,
        }
    }

    pub fn push(&mut self, delta: &str) -> StopScan {
        let search_from = floor_char_boundary(&self.text, self.emitted.saturating_sub(self.longest()));
        self.text.push_str(delta);
        let found = self
            .stops
            .iter()
            .filter_map(|s| self.text[search_from..].find(s.as_str()).map(|i| (search_from + i, s)))
            .min_by_key(|(i, _)| *i);
        if let Some((at, stop)) = found {
            let out = self.text[self.emitted..at].to_string();
            let stop = stop.clone();
            self.text.truncate(at);
            self.emitted = at;
            return StopScan::Stopped(out, stop);
        }
        let hold = self.held_back();
        let safe = floor_char_boundary(&self.text, self.text.len() - hold).max(self.emitted);
        let out = self.text[self.emitted..safe].to_string();
        self.emitted = safe;
        StopScan::Continue(out)
    }

    /// Text kept back at the end, released when the generation ends for another reason.
    pub fn flush(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }

    fn longest(&self) -> usize {
        self.stops.iter().map(|s| s.len()).max().unwrap_or(0)
    }

    /// Length of the longest tail of the text that is a proper prefix of a stop string.
    fn held_back(&self) -> usize {
        let mut best = 0;
        for s in &self.stops {
            for n in (1..s.len()).rev() {
                if n > best && s.is_char_boundary(n) && self.text.ends_with(&s[..n]) {
                    best = n;
                    break;
                }
            }
        }
        best
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, Option<String>) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for d in deltas {
            match s.push(d) {
                StopScan::Continue(t) => out.push_str(&t),
                StopScan::Stopped(t, stop) => {
                    out.push_str(&t);
                    return (out, Some(stop));
                }
            }
        }
        out.push_str(&s.flush());
        (out, None)
    }

    #[test]
    fn stop_string_split_across_tokens_is_cut_and_never_emitted() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".into(), Some("END".into()))
        );
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), Some("\n\n".into())));
    }

    #[test]
    fn near_misses_are_released() {
        assert_eq!(run(&["END"], &["E", "N", "x"]), ("ENx".into(), None));
        assert_eq!(
            run(&["END"], &["abc", "EN"]),
            ("abcEN".into(), None),
            "flush releases held text"
        );
    }

    #[test]
    fn earliest_stop_wins_and_unicode_is_safe() {
        assert_eq!(run(&["b", "a"], &["xyab"]), ("xy".into(), Some("a".into())));
        assert_eq!(run(&["é!"], &["café", "!x"]), ("caf".into(), Some("é!".into())));
    }
}
