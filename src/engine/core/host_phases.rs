//! Where the engine thread's time goes in pipelined steps, when `QUARRY_ENGINE_TIMING=1`: each
//! part of `pipelined` timed and summed, a line printed every `EVERY` steps. With the backend's
//! `QUARRY_CUDA_TIMING=step` it says which host work the device waits on (the committing, the
//! masks and the draws' upload all come between a pass and the draw that follows it). Off by
//! default: reading the clock is cheap, printing is not for everyone.

use std::time::{Duration, Instant};

/// Steps per printed line.
const EVERY: u32 = 100;

#[derive(Clone, Copy)]
pub(super) enum Part {
    /// Scheduling and preparing the next batch.
    Plan,
    /// Queueing the next pass.
    Queue,
    /// Waiting for the step in flight's draws.
    Wait,
    /// Checking and committing its tokens.
    Commit,
    /// The next step's masks (filled on the pool) and the queued pass's host side.
    Masks,
    /// What each row's draw asks for (its penalties, its twin), built on the engine thread.
    Asks,
    /// Queueing the next step's draws (the backend's staging and launches).
    Draws,
}

const PARTS: [(&str, Part); 7] = [
    ("plan", Part::Plan),
    ("queue pass", Part::Queue),
    ("wait for draws", Part::Wait),
    ("commit", Part::Commit),
    ("masks", Part::Masks),
    ("draws' asks", Part::Asks),
    ("queue draws", Part::Draws),
];

#[derive(Default)]
pub(super) struct HostPhases {
    on: bool,
    totals: [Duration; PARTS.len()],
    rows: usize,
    steps: u32,
    mark: Option<Instant>,
}

impl HostPhases {
    pub fn from_env() -> Self {
        HostPhases {
            on: std::env::var("QUARRY_ENGINE_TIMING").is_ok_and(|v| v == "1"),
            ..Default::default()
        }
    }

    /// Starts a step's clock.
    pub fn start(&mut self) {
        if self.on {
            self.mark = Some(Instant::now());
        }
    }

    /// The time since the last mark counts for `part`.
    pub fn lap(&mut self, part: Part) {
        let Some(mark) = self.mark.as_mut() else { return };
        let now = Instant::now();
        self.totals[part as usize] += now - *mark;
        *mark = now;
    }

    /// A step of `rows` sampled rows ends; every `EVERY` steps, the averages.
    pub fn end(&mut self, rows: usize) {
        if self.mark.take().is_none() {
            return;
        }
        self.rows += rows;
        self.steps += 1;
        if self.steps < EVERY {
            return;
        }
        let per_step = |d: Duration| d.as_secs_f64() * 1e3 / self.steps as f64;
        let parts: Vec<String> = PARTS
            .iter()
            .map(|(name, p)| format!("{name} {:.3}", per_step(self.totals[*p as usize])))
            .collect();
        eprintln!(
            "quarry engine timing: {} pipelined steps, {:.0} sampled rows a step; ms a step: {}",
            self.steps,
            self.rows as f64 / self.steps as f64,
            parts.join(", ")
        );
        *self = HostPhases {
            on: true,
            ..Default::default()
        };
    }
}
