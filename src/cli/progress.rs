//! A progress line on stderr for batch commands: redrawn in place on a terminal, one line per
//! tenth of the work otherwise (logs of CI and cron jobs stay short).

use std::io::{IsTerminal, Write};
use std::time::Instant;

pub struct Progress {
    total: usize,
    done: usize,
    failed: usize,
    started: Instant,
    terminal: bool,
    last_tenth: usize,
}

impl Progress {
    pub fn new(total: usize) -> Progress {
        Progress {
            total,
            done: 0,
            failed: 0,
            started: Instant::now(),
            terminal: std::io::stderr().is_terminal(),
            last_tenth: 0,
        }
    }

    pub fn item_done(&mut self, ok: bool) {
        self.done += 1;
        self.failed += usize::from(!ok);
        let tenth = self.done * 10 / self.total.max(1);
        if self.terminal {
            eprint!("\r{}", self.line());
            let _ = std::io::stderr().flush();
        } else if tenth > self.last_tenth {
            self.last_tenth = tenth;
            eprintln!("{}", self.line());
        }
    }

    /// Ends the progress line and says how the batch went.
    pub fn finish(&self) {
        if self.terminal {
            eprintln!();
        }
        eprintln!(
            "done: {} items, {} ok, {} failed in {:.1} s",
            self.done,
            self.done - self.failed,
            self.failed,
            self.started.elapsed().as_secs_f64()
        );
    }

    fn line(&self) -> String {
        const WIDTH: usize = 30;
        let filled = self.done * WIDTH / self.total.max(1);
        let secs = self.started.elapsed().as_secs_f64();
        let rate = self.done as f64 / secs.max(1e-9);
        let eta = (self.total - self.done) as f64 / rate.max(1e-9);
        format!(
            "[{}{}] {}/{}  ok {}  failed {}  {:.1} items/s  ETA {:.0} s ",
            "=".repeat(filled),
            " ".repeat(WIDTH - filled),
            self.done,
            self.total,
            self.done - self.failed,
            self.failed,
            rate,
            eta
        )
    }
}
