//! Where a GPU step's time goes, when `QUARRY_CUDA_TIMING=1`: an event before each kernel and
//! GEMM, read back once the step is done, summed per kind of work and printed when the backend
//! is dropped. Off by default: the events and the synchronization cost time themselves. Events
//! between kernels also stop them overlapping (launcher.rs), so the phases add up to more than
//! the step takes; `QUARRY_CUDA_TIMING=step` puts events only around each step and its sampling,
//! which gives the GPU's own time for a step, from its first kernel to its last, overlaps kept,
//! and the device's idle gaps: before each forward (the host preparing the step) and between
//! the forward and its sampling. That mode reads each step's events a step later, so that
//! measuring does not make the host wait. A pipelined draw's interval closes when it is
//! launched, since the next pass is queued before the draw is read; its wall time is then the
//! launch's alone. In step mode `QUARRY_CUDA_TIMING_STEPS=<file>` also writes each forward as
//! a line (its tokens, sequences, longest sequence, whether a graph ran it, its span and the
//! idle gap before it), so that steps of a kind can be set against steps of as many rows.

use std::cell::RefCell;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Gemm,
    Attention,
    Elementwise,
    Head,
    Sample,
    /// Tensor parallelism's all-reduces.
    Reduce,
    End,
}

const PHASES: [Phase; 6] = [
    Phase::Gemm,
    Phase::Attention,
    Phase::Elementwise,
    Phase::Head,
    Phase::Sample,
    Phase::Reduce,
];

#[derive(Default)]
struct Totals {
    gpu_ms: [f64; 6],
    /// The same, over steps whose every sequence has one query token (and their sampling).
    decode_ms: [f64; 6],
    decode_steps: usize,
    /// Whether the last `run` was such a step (its sampling counts with it).
    last_decode: bool,
    steps: usize,
    tokens: usize,
    run_wall: Duration,
    sample_wall: Duration,
    /// Step mode: the device idle before decode steps' forwards, and before their sampling.
    decode_gap_ms: f64,
    decode_sample_gap_ms: f64,
}

/// A step's or a sampling's events in step mode, read once the next one is queued.
struct Deferred {
    marks: Vec<(Phase, CudaEvent)>,
    sampling: bool,
    decode: bool,
    shape: StepShape,
}

/// What a forward carried, for the per-step log.
#[derive(Clone, Copy, Default)]
pub struct StepShape {
    pub tokens: usize,
    pub seqs: usize,
    pub longest: usize,
    pub graph: bool,
}

pub struct Timing {
    ctx: Arc<CudaContext>,
    /// `QUARRY_CUDA_TIMING=step`: one interval per step, counted under its first phase.
    whole_steps: bool,
    marks: RefCell<Vec<(Phase, CudaEvent)>>,
    totals: RefCell<Totals>,
    deferred: RefCell<Option<Deferred>>,
    /// Step mode: the end of the last interval read, where the device's idle gap starts.
    last_end: RefCell<Option<CudaEvent>>,
    /// `QUARRY_CUDA_TIMING_STEPS`: a line per forward; passes between reports are numbered.
    steps_log: RefCell<Option<(std::io::BufWriter<std::fs::File>, usize)>>,
}

impl Timing {
    pub fn from_env(ctx: &Arc<CudaContext>) -> Option<Self> {
        let mode = std::env::var("QUARRY_CUDA_TIMING").ok()?;
        (mode == "1" || mode == "step").then(|| Timing {
            ctx: ctx.clone(),
            whole_steps: mode == "step",
            marks: RefCell::new(Vec::new()),
            totals: RefCell::new(Totals::default()),
            deferred: RefCell::new(None),
            last_end: RefCell::new(None),
            steps_log: RefCell::new(Self::open_steps_log(mode == "step")),
        })
    }

    fn open_steps_log(whole_steps: bool) -> Option<(std::io::BufWriter<std::fs::File>, usize)> {
        let path = std::env::var("QUARRY_CUDA_TIMING_STEPS").ok().filter(|_| whole_steps)?;
        match std::fs::File::create(&path) {
            Ok(f) => {
                let mut w = std::io::BufWriter::new(f);
                let _ = writeln!(w, "pass\ttokens\tseqs\tlongest\tgraph\tspan_ms\tidle_before_ms");
                Some((w, 0))
            }
            Err(e) => {
                eprintln!("QUARRY_CUDA_TIMING_STEPS: {path}: {e}; no step log");
                None
            }
        }
    }

    /// Events between kernels (`QUARRY_CUDA_TIMING=1`), not only around steps.
    pub fn per_phase(&self) -> bool {
        !self.whole_steps
    }

    /// The work queued from here to the next mark counts as `phase`.
    pub fn mark(&self, phase: Phase, stream: &CudaStream) {
        if self.whole_steps && phase != Phase::End && !self.marks.borrow().is_empty() {
            return;
        }
        if let Ok(e) = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        {
            if e.record(stream).is_ok() {
                self.marks.borrow_mut().push((phase, e));
            }
        }
    }

    /// Closes the step: waits for the GPU (step mode: for the one before), then adds each
    /// interval to its phase. A forward whose every sequence has one query token is a decode
    /// step; a sampling (its shape left default) counts with the forward it follows.
    pub fn finish(&self, stream: &CudaStream, started: Instant, sampling: bool, shape: StepShape) {
        let (tokens, decode) = (shape.tokens, shape.tokens == shape.seqs && !sampling);
        self.mark(Phase::End, stream);
        let marks = std::mem::take(&mut *self.marks.borrow_mut());
        {
            let mut t = self.totals.borrow_mut();
            if sampling {
                t.sample_wall += started.elapsed();
            } else {
                t.steps += 1;
                t.tokens += tokens;
                t.run_wall += started.elapsed();
            }
        }
        let this = Deferred {
            marks,
            sampling,
            decode,
            shape,
        };
        if self.whole_steps {
            if let Some(before) = self.deferred.replace(Some(this)) {
                self.read(before);
            }
        } else {
            let _ = stream.synchronize();
            self.read(this);
        }
    }

    /// Adds a finished step's (or sampling's) intervals to the totals.
    fn read(&self, d: Deferred) {
        if let Some((_, end)) = d.marks.last() {
            let _ = end.synchronize();
        }
        let mut t = self.totals.borrow_mut();
        if !d.sampling {
            t.last_decode = d.decode;
            t.decode_steps += d.decode as usize;
        }
        let gap = match (self.last_end.borrow().as_ref(), d.marks.first()) {
            (Some(before), Some((_, first))) => before.elapsed_ms(first).ok(),
            _ => None,
        };
        if let (true, Some(ms)) = (t.last_decode, gap) {
            match d.sampling {
                true => t.decode_sample_gap_ms += ms as f64,
                false => t.decode_gap_ms += ms as f64,
            }
        }
        if let (Some((w, pass)), false, Some((_, first)), Some((_, end))) = (
            self.steps_log.borrow_mut().as_mut(),
            d.sampling,
            d.marks.first(),
            d.marks.last(),
        ) {
            let s = d.shape;
            let span = first.elapsed_ms(end).unwrap_or(f32::NAN);
            let gap = gap.unwrap_or(f32::NAN);
            let _ = writeln!(
                w,
                "{pass}\t{}\t{}\t{}\t{}\t{span:.4}\t{gap:.4}",
                s.tokens, s.seqs, s.longest, s.graph as u8
            );
        }
        for pair in d.marks.windows(2) {
            if let (Some(i), Ok(ms)) = (
                PHASES.iter().position(|&p| p == pair[0].0),
                pair[0].1.elapsed_ms(&pair[1].1),
            ) {
                t.gpu_ms[i] += ms as f64;
                if t.last_decode {
                    t.decode_ms[i] += ms as f64;
                }
            }
        }
        drop(t);
        let mut marks = d.marks;
        if let Some((_, end)) = marks.pop() {
            *self.last_end.borrow_mut() = Some(end);
        }
    }

    /// The totals so far, once the device is idle; the count starts again (and the idle gap
    /// before the next step, which the host's pause between workloads would fill, is not taken).
    pub fn take_report(&self) -> String {
        let last = self.deferred.borrow_mut().take();
        if let Some(last) = last {
            self.read(last);
        }
        let line = self.report();
        if let Some((w, pass)) = self.steps_log.borrow_mut().as_mut() {
            let _ = w.flush();
            *pass += 1;
        }
        *self.totals.borrow_mut() = Totals::default();
        *self.last_end.borrow_mut() = None;
        line
    }

    fn report(&self) -> String {
        let t = self.totals.borrow();
        let steps = t.steps.max(1) as f64;
        let mut line = format!(
            "quarry cuda timing: {} steps, {} tokens; per step: run {:.2} ms wall, sample {:.2} ms wall; GPU",
            t.steps,
            t.tokens,
            t.run_wall.as_secs_f64() * 1e3 / steps,
            t.sample_wall.as_secs_f64() * 1e3 / steps
        );
        let decode = t.decode_steps.max(1) as f64;
        if self.whole_steps {
            // A step's interval counts under its first phase; sampling's under its own.
            let at = PHASES
                .iter()
                .position(|&p| p == Phase::Sample)
                .expect("sampling is a phase");
            let sample = t.gpu_ms[at];
            let run: f64 = t.gpu_ms.iter().sum::<f64>() - sample;
            let decode_run = t.decode_ms.iter().sum::<f64>() - t.decode_ms[at];
            let (gap, sample_gap) = (t.decode_gap_ms / decode, t.decode_sample_gap_ms / decode);
            let whole = decode_run / decode + t.decode_ms[at] / decode + gap + sample_gap;
            line.push_str(&format!(
                " span {:.3} ms a step, sampling {:.3} ms\nquarry cuda timing, the {} decode steps alone: GPU span {:.3} ms a step, sampling {:.3} ms; the device idle {:.3} ms before a step's forward and {:.3} ms before its sampling: {:.1}% of the step",
                run / steps,
                sample / steps,
                t.decode_steps,
                decode_run / decode,
                t.decode_ms[at] / decode,
                gap,
                sample_gap,
                100.0 * (gap + sample_gap) / whole.max(f64::MIN_POSITIVE)
            ));
            return line;
        }
        for (p, ms) in PHASES.iter().zip(t.gpu_ms) {
            line.push_str(&format!(" {p:?} {:.2} ms", ms / steps));
        }
        line.push_str(&format!(
            "\nquarry cuda timing, the {} decode steps alone: GPU {:.2} ms a step:",
            t.decode_steps,
            t.decode_ms.iter().sum::<f64>() / decode
        ));
        for (p, ms) in PHASES.iter().zip(t.decode_ms) {
            line.push_str(&format!(" {p:?} {:.2} ms", ms / decode));
        }
        line
    }
}
