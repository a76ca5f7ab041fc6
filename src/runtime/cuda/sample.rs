//! Sampling where the logits are (kernels/sampling.cu). Per drawn row, in the engine sampler's
//! order: contrast with its twin's row, the grammar's mask and the copy bias, the
//! log-probabilities where asked for, the penalties (the values they replace are kept), then the
//! argmax or a seeded draw, and the drawn token's confidence where asked for. Only token ids,
//! log-probabilities and confidences come back, and the logits of the rows the engine keeps for
//! itself.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};

use super::kernels::SampleParams;
use super::staging::Staging;
use super::timing::{Phase, StepShape};
use super::{device_err, launch, launch_items, CudaBackend, THREADS};
use crate::runtime::batch::Logits;
use crate::runtime::error::{Result, RuntimeError};
use crate::runtime::{Draw, Penalty, RowDraw, RowLogprobs, RowRequest, Sampled, TokenConfidence};

/// kernels/sampling.cu's MAX_TOP.
const MAX_TOP: usize = 32;

/// How a row of the last `sample` was drawn, kept for `redraw_within`.
#[derive(Clone)]
pub(super) struct Drawn {
    /// `None`: the argmax.
    seeded: Option<SampleParams>,
    logprobs: Option<usize>,
    confidence: bool,
    penalties: Vec<Penalty>,
    /// Where this row's penalties sit among the last upload's (`restore_values`).
    penalty_span: (usize, usize),
}

impl Drawn {
    fn of(draw: &Draw<'_>) -> Self {
        let d = &draw.params;
        let seeded = (d.temperature > 0.0).then(|| SampleParams {
            temperature: d.temperature,
            top_k: d.top_k.min(i32::MAX as usize) as i32,
            top_p: d.top_p,
            min_p: d.min_p,
            seed: d.seed,
            counter: d.counter,
        });
        Drawn {
            seeded,
            logprobs: d.logprobs.map(|n| n.min(MAX_TOP)),
            confidence: d.confidence,
            penalties: draw.penalties.to_vec(),
            penalty_span: (0, 0),
        }
    }
}

/// Device addresses of the last upload's penalties, and the values they replaced.
#[derive(Clone, Copy, Default)]
pub(super) struct PenaltyArrays {
    rows: u64,
    tokens: u64,
    saved: u64,
}

/// One row for `draw_rows`, relative to the logits it is given.
struct RowSpec<'a> {
    mask: Option<&'a [u32]>,
    bias: Option<(&'a [u32], f32)>,
    /// The twin row (among the same logits) and the weight, for contrast.
    contrast: Option<(usize, f32)>,
    drawn: &'a mut Drawn,
}

fn params_words(p: &SampleParams) -> [u32; 8] {
    [
        p.temperature.to_bits(),
        p.top_k as u32,
        p.top_p.to_bits(),
        p.min_p.to_bits(),
        p.seed as u32,
        (p.seed >> 32) as u32,
        p.counter as u32,
        (p.counter >> 32) as u32,
    ]
}

/// A mask cut or padded to `words` words (tokens past the grammar's vocabulary are refused).
fn fill_mask(dst: &mut [u32], mask: &[u32]) {
    let n = mask.len().min(dst.len());
    dst[..n].copy_from_slice(&mask[..n]);
    dst[n..].fill(0);
}

/// Records `slot`'s event on `s`, making it on first use: a step reuses its events rather
/// than creating them.
fn record_into(slot: &mut Option<CudaEvent>, s: &CudaStream) -> Result<()> {
    let event = match slot.take() {
        Some(e) => e,
        None => s.record_event(None).map_err(device_err("sampling"))?,
    };
    event.record(s).map_err(device_err("sampling"))?;
    *slot = Some(event);
    Ok(())
}

impl CudaBackend {
    pub(super) fn sample_rows(&mut self, requests: &[RowRequest<'_>]) -> Result<Sampled> {
        self.launch_rows(requests, false)?;
        self.collect_rows()
    }

    /// Queues the draws of the last pass's rows, and copies back the logits of the rows left
    /// to the engine. `pipelined`: the tokens come back by an asynchronous copy that
    /// `collect_rows` waits for, and a drawn row with a mask has its shaped scores kept aside
    /// for a redraw (the next pass, queued before the redraw, overwrites the logits).
    pub(super) fn launch_rows(&mut self, requests: &[RowRequest<'_>], pipelined: bool) -> Result<()> {
        let (vocab, rows) = (self.config.vocab_size, self.rows);
        if requests.len() != rows {
            return Err(RuntimeError::InvalidBatch(format!(
                "{} rows asked for, the last pass computed {rows}",
                requests.len()
            )));
        }
        let s = self.stream.clone();
        if self.draw_unread {
            // A draw launched and never read (its step failed): its uploads may be in flight.
            s.synchronize().map_err(device_err("sampling"))?;
            self.passed_run = self.run_index;
        }
        self.draw_started = std::time::Instant::now();
        self.mark(Phase::Sample);
        let mut drawn: Vec<Option<Drawn>> = requests.iter().map(|r| r.draw.as_ref().map(Drawn::of)).collect();
        let mut specs: Vec<Option<RowSpec<'_>>> = requests
            .iter()
            .zip(drawn.iter_mut())
            .map(|(r, d)| {
                d.as_mut().map(|drawn| RowSpec {
                    mask: r.mask,
                    bias: r.draw.as_ref().and_then(|d| d.bias),
                    contrast: r.draw.as_ref().and_then(|d| d.contrast),
                    drawn,
                })
            })
            .collect();
        let base = self.ptr(&self.buffers.logits);
        // Where a pipelined draw's masked rows keep their scores: `shape_scores` writes them
        // there as it writes the logits (redraws are read before the next launch, so none is
        // still reading the last step's).
        self.redraw_rows = specs
            .iter()
            .map(|r| pipelined && r.as_ref().is_some_and(|r| r.mask.is_some()))
            .collect();
        let keep = match self.redraw_rows.iter().any(|&m| m) {
            true => {
                if self.redraw_logits.len() < rows * vocab {
                    self.redraw_logits = s.alloc_zeros::<f32>(rows * vocab).map_err(device_err("sampling"))?;
                }
                Some(self.ptr(&self.redraw_logits))
            }
            false => None,
        };
        let queued = match specs.iter().any(Option::is_some) {
            true => Some(self.queue_draws(&s, base, &mut specs, false, keep)?),
            false => None,
        };
        drop(specs);
        self.drawn = drawn;

        // The rows left to the engine: their logits come back, one copy per run of rows.
        let has_logits: Vec<bool> = (0..rows)
            .map(|i| self.drawn[i].is_none() && requests[i].logits_back)
            .collect();
        self.rows_copied += has_logits.iter().filter(|&&h| h).count() as u64;
        let mut data = Vec::new();
        for run in runs(&has_logits) {
            let part = s
                .clone_dtoh(&self.buffers.logits.slice(run.start * vocab..run.end * vocab))
                .map_err(device_err("copying logits"))?;
            data.extend_from_slice(&part);
        }
        if let (Some(q), true) = (&queued, pipelined) {
            let words = q.scratch.len();
            if self.readback.as_ref().is_none_or(|r| r.len() < words) {
                // SAFETY: only the prefix the copy below writes is read (`collect_rows`).
                let pinned = unsafe { self.ctx.alloc_pinned::<u32>(words.max(1024)) };
                self.readback = Some(pinned.map_err(device_err("sampling"))?);
            }
            let readback = self.readback.as_mut().expect("allocated above");
            // Only the scratch's words: a copy takes its size from the host slice.
            let dst = &mut readback.as_mut_slice().map_err(device_err("copying sampled tokens"))?[..words];
            let (src, _read) = q.scratch.device_ptr(&s);
            // SAFETY: `dst` is page-locked and not read before `readback_done` has passed.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, s.cu_stream()) }
                .map_err(device_err("copying sampled tokens"))?;
            record_into(&mut self.readback_done, &s)?;
            if keep.is_some() {
                record_into(&mut self.redraw_ready, &s)?;
            }
        }
        if pipelined {
            // The draws' interval closes here: the next pass is queued before they are read.
            if let Some(timing) = &self.timing {
                timing.finish(&s, self.draw_started, true, StepShape::default());
            }
        }
        if let Some(q) = &queued {
            self.penalties = q.penalties;
        }
        self.queued = queued;
        self.host_logits = (data, has_logits);
        self.draw_pipelined = pipelined;
        self.draw_unread = true;
        self.sampled_run = self.run_index;
        self.run_since_draw = false;
        Ok(())
    }

    /// What the last `launch_rows` decided, once its tokens are back.
    pub(super) fn collect_rows(&mut self) -> Result<Sampled> {
        let s = self.stream.clone();
        let rows = self.drawn.len();
        let decided = match &self.queued {
            None => vec![None; rows],
            Some(q) => {
                let drawn: Vec<Option<&Drawn>> = self.drawn.iter().map(Option::as_ref).collect();
                match self.draw_pipelined {
                    true => {
                        if let Some(done) = &self.readback_done {
                            done.synchronize().map_err(device_err("sampling"))?;
                        }
                        let readback = self.readback.as_ref().expect("a pipelined draw copies back");
                        let back = readback.as_slice().map_err(device_err("sampling"))?;
                        q.read.decided(&drawn, &back[..q.scratch.len()])
                    }
                    false => {
                        let back = s.clone_dtoh(&q.scratch).map_err(device_err("copying sampled tokens"))?;
                        q.read.decided(&drawn, &back)
                    }
                }
            }
        };
        if self.draw_pipelined {
            // The pass's uploads came before the draws whose readback was waited for; a step
            // that drew nothing waited for nothing.
            if self.queued.is_some() {
                self.passed_run = self.passed_run.max(self.sampled_run);
            }
        } else {
            s.synchronize().map_err(device_err("sampling"))?;
            self.passed_run = self.run_index;
        }
        if let (Some(timing), false) = (&self.timing, self.draw_pipelined) {
            timing.finish(&s, self.draw_started, true, StepShape::default());
        }
        self.draw_unread = false;
        let (data, has_logits) = std::mem::take(&mut self.host_logits);
        let mut tokens = Vec::with_capacity(rows);
        let mut logprobs = Vec::with_capacity(rows);
        let mut confidence = Vec::with_capacity(rows);
        for d in decided {
            tokens.push(d.as_ref().map(|d| d.token));
            confidence.push(d.as_ref().and_then(|d| d.confidence));
            logprobs.push(d.and_then(|d| d.logprobs));
        }
        Ok(Sampled {
            tokens,
            logprobs,
            confidence,
            logits: Logits {
                vocab_size: self.config.vocab_size,
                data,
            },
            has_logits,
        })
    }

    /// Where the next pass finds the tokens the last draw left on the device: its scratch, and
    /// each row's word in it (`None`: not drawn there).
    pub(super) fn last_draw(&self) -> Option<(u64, &[Option<u32>])> {
        let q = self.queued.as_ref()?;
        Some((self.ptr(&q.scratch), &q.read.token_word))
    }

    /// `Backend::redraw_within`: the row's penalties are undone, then it is drawn again as
    /// before under the narrower mask (a subset of what its mask allowed; its bias stays).
    pub(super) fn redraw(&mut self, row: usize, mask: &[u32]) -> Result<RowDraw> {
        // A pipelined draw's logits were kept aside; another's are the last pass's, while no
        // pass has run since.
        let kept = match self.draw_pipelined {
            true => self.redraw_rows.get(row).copied().unwrap_or(false),
            false => !self.run_since_draw,
        };
        let drawn = self.drawn.get(row).filter(|_| kept).cloned();
        let Some(Some(mut drawn)) = drawn else {
            return Err(RuntimeError::InvalidBatch(format!(
                "row {row} was not drawn on the device in the last step (or, pipelined, had no mask)"
            )));
        };
        let vocab = self.config.vocab_size;
        // A pipelined draw's redraw runs on its own stream, behind the copy of its logits only:
        // on the backend's stream it would wait for the pass queued since, most of a step.
        let (s, all) = match self.draw_pipelined {
            true => {
                let side = self.redraw_stream.clone();
                if let Some(kept) = &self.redraw_ready {
                    side.wait(kept).map_err(device_err("sampling"))?;
                }
                (side, self.ptr(&self.redraw_logits))
            }
            false => (self.stream.clone(), self.ptr(&self.buffers.logits)),
        };
        let (start, count) = drawn.penalty_span;
        if count > 0 {
            let (v, st, n) = (vocab as i32, start as i32, count as i32);
            let p = self.penalties;
            launch_items(
                &s,
                &self.kernels.restore_values,
                count,
                &[&all, &v, &p.rows, &p.tokens, &p.saved, &st, &n],
            )?;
        }
        let at = all + (row * vocab * std::mem::size_of::<f32>()) as u64;
        // The row's logits were contrasted in place by its first draw.
        let mut specs = vec![Some(RowSpec {
            mask: Some(mask),
            bias: None,
            contrast: None,
            drawn: &mut drawn,
        })];
        // The row keeps its first draw's record: another redraw restores from the same values.
        let (decided, _scratch, _) = self.draw_rows(&s, at, &mut specs, true)?;
        drop(specs);
        s.synchronize().map_err(device_err("sampling"))?;
        if !self.draw_pipelined {
            self.passed_run = self.run_index;
        }
        decided
            .into_iter()
            .next()
            .flatten()
            .ok_or_else(|| RuntimeError::Backend("the redraw drew nothing".into()))
    }

    /// Draws the rows given a spec, of the `specs.len()` rows of logits from `logits` on; the
    /// others are left alone. Queues the work and reads back the tokens (which waits for it).
    /// Also returns the scratch that holds the values the penalties replaced, and where those
    /// penalties are; a redraw uploads through its own staging, so that the step's stay.
    fn draw_rows(
        &mut self,
        s: &Arc<CudaStream>,
        logits: u64,
        specs: &mut [Option<RowSpec<'_>>],
        redraw: bool,
    ) -> Result<(Vec<Option<RowDraw>>, CudaSlice<u32>, PenaltyArrays)> {
        let q = self.queue_draws(s, logits, specs, redraw, None)?;
        let back: Vec<u32> = s.clone_dtoh(&q.scratch).map_err(device_err("copying sampled tokens"))?;
        let drawn: Vec<Option<&Drawn>> = specs.iter().map(|s| s.as_ref().map(|s| &*s.drawn)).collect();
        Ok((q.read.decided(&drawn, &back), q.scratch, q.penalties))
    }

    /// `draw_rows`' work queued on the stream, nothing read back. `keep`: where the masked
    /// rows' shaped scores go as well, a row of the vocabulary each.
    fn queue_draws(
        &mut self,
        s: &Arc<CudaStream>,
        logits: u64,
        specs: &mut [Option<RowSpec<'_>>],
        redraw: bool,
        keep: Option<u64>,
    ) -> Result<Queued> {
        let vocab = self.config.vocab_size;
        let rows = specs.len();
        let words = vocab.div_ceil(32);

        // Everything the kernels read, in one upload.
        let st = if redraw {
            &mut self.redraw_staging
        } else {
            &mut self.sample_staging
        };
        st.clear();
        let mut mask_rows = vec![-1i32; rows];
        let (mut masks_at, mut n_masks) = (None, 0);
        for (i, spec) in specs.iter().enumerate() {
            if let Some(m) = spec.as_ref().and_then(|r| r.mask) {
                let at = st.push_with(words, |dst| fill_mask(dst, m))?;
                masks_at.get_or_insert(at);
                mask_rows[i] = n_masks;
                n_masks += 1;
            }
        }
        let mut bias_rows = vec![-1i32; rows];
        let mut bias = vec![0f32; rows];
        let (mut bias_at, mut n_bias) = (None, 0);
        for (i, spec) in specs.iter().enumerate() {
            if let Some((m, b)) = spec.as_ref().and_then(|r| r.bias) {
                let at = st.push_with(words, |dst| fill_mask(dst, m))?;
                bias_at.get_or_insert(at);
                bias_rows[i] = n_bias;
                bias[i] = b;
                n_bias += 1;
            }
        }
        let mut twins = vec![-1i32; rows];
        let (mut one_plus, mut weights) = (vec![0f32; rows], vec![0f32; rows]);
        for (i, spec) in specs.iter().enumerate() {
            if let Some((twin, w)) = spec.as_ref().and_then(|r| r.contrast) {
                if twin >= rows || specs[twin].is_some() {
                    return Err(RuntimeError::InvalidBatch(format!(
                        "row {i} contrasts with row {twin}, which is not an undrawn row of the step"
                    )));
                }
                (twins[i], one_plus[i], weights[i]) = (twin as i32, 1.0 + w, w);
            }
        }
        // The rows whose scores an option changes before the draw.
        let shaped: Vec<u32> = (0..rows)
            .filter(|&i| twins[i] >= 0 || mask_rows[i] >= 0 || bias_rows[i] >= 0)
            .map(|i| i as u32)
            .collect();
        let shaped_at = st.push(&shaped)?;
        let twins_at = st.push_i32(&twins)?;
        let one_plus_at = st.push_f32(&one_plus)?;
        let weights_at = st.push_f32(&weights)?;
        let mask_rows_at = st.push_i32(&mask_rows)?;
        let bias_rows_at = st.push_i32(&bias_rows)?;
        let bias_values_at = st.push_f32(&bias)?;
        let (mut p_rows, mut p_tokens, mut p_factors, mut p_adds) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, spec) in specs.iter_mut().enumerate() {
            let Some(spec) = spec else { continue };
            let start = p_rows.len();
            for p in spec.drawn.penalties.iter().filter(|p| (p.token as usize) < vocab) {
                p_rows.push(i as u32);
                p_tokens.push(p.token);
                p_factors.push(p.factor);
                p_adds.push(p.add);
            }
            spec.drawn.penalty_span = (start, p_rows.len() - start);
        }
        let penalties_at = [
            st.push(&p_rows)?,
            st.push(&p_tokens)?,
            st.push_f32(&p_factors)?,
            st.push_f32(&p_adds)?,
        ];
        let (mut seeded_rows, mut greedy_rows) = (Vec::new(), Vec::new());
        let (mut stat_rows, mut stat_n, mut conf_rows) = (Vec::new(), 0usize, Vec::new());
        for (i, spec) in specs.iter().enumerate() {
            let Some(spec) = spec else { continue };
            match spec.drawn.seeded {
                Some(_) => seeded_rows.push(i as u32),
                None => greedy_rows.push(i as u32),
            }
            if let Some(n) = spec.drawn.logprobs {
                stat_rows.push(i as u32);
                stat_n = stat_n.max(n);
            }
            if spec.drawn.confidence {
                conf_rows.push(i as u32);
            }
        }
        // Where a row's token lands in the output: argmaxes first (one per row), then the
        // seeded draws in order.
        let token_at = |picked: &[u32]| -> Vec<u32> {
            picked
                .iter()
                .map(
                    |&r| match specs[r as usize].as_ref().map(|x| x.drawn.seeded.is_some()) {
                        Some(true) => (rows + seeded_rows.iter().position(|&x| x == r).unwrap_or(0)) as u32,
                        _ => r,
                    },
                )
                .collect()
        };
        let (stat_token_at, conf_token_at) = (token_at(&stat_rows), token_at(&conf_rows));
        let seeded_rows_at = st.push(&seeded_rows)?;
        let greedy_rows_at = st.push(&greedy_rows)?;
        let stat_rows_at = st.push(&stat_rows)?;
        let token_at_at = st.push(&stat_token_at)?;
        let conf_rows_at = st.push(&conf_rows)?;
        let conf_token_at_at = st.push(&conf_token_at)?;
        st.align(2)?;
        let params_at = st.len_words();
        for spec in specs.iter().flatten() {
            if let Some(p) = &spec.drawn.seeded {
                st.push(&params_words(p))?;
            }
        }
        let base = st.send(s)?;
        let at = |offset: usize| Staging::addr(base, offset);

        // Scratch on the device: token ids, the penalties' saved values, logprob records, the
        // drawn tokens' values and the confidence records (probability, choices).
        let record = 1 + 2 * MAX_TOP;
        let out_len = rows + seeded_rows.len();
        let conf_base = out_len + p_rows.len() + stat_rows.len() * (record + 1);
        let scratch = s
            .alloc_zeros::<u32>((conf_base + 2 * conf_rows.len()).max(1))
            .map_err(device_err("sampling"))?;
        let out = self.ptr(&scratch);
        let word = |i: usize| out + (i * std::mem::size_of::<u32>()) as u64;
        let (saved, stats, values) = (
            word(out_len),
            word(out_len + p_rows.len()),
            word(out_len + p_rows.len() + stat_rows.len() * record),
        );

        let (v, w) = (vocab as i32, words as i32);
        let k = &self.kernels;
        if !shaped.is_empty() {
            // Each thread takes about eight of a row's tokens.
            let slices = (vocab as u32).div_ceil(THREADS * 8);
            let (masks, bias_masks) = (masks_at.map_or(0, at), bias_at.map_or(0, at));
            let kept = keep.unwrap_or(0);
            launch(
                s,
                &k.shape_scores,
                (shaped.len() as u32, slices),
                THREADS,
                &[
                    &logits,
                    &at(shaped_at),
                    &at(twins_at),
                    &at(one_plus_at),
                    &at(weights_at),
                    &masks,
                    &at(mask_rows_at),
                    &bias_masks,
                    &at(bias_rows_at),
                    &at(bias_values_at),
                    &v,
                    &w,
                    &kept,
                ],
            )?;
        }
        if !stat_rows.is_empty() {
            let n = stat_n as i32;
            let grid = (stat_rows.len() as u32, 1);
            launch(
                s,
                &k.logprob_stats,
                grid,
                1024,
                &[&logits, &at(stat_rows_at), &v, &n, &stats],
            )?;
        }
        let [pr, pt, pf, pa] = penalties_at.map(at);
        if !p_rows.is_empty() {
            let count = p_rows.len() as i32;
            launch_items(
                s,
                &k.apply_penalties,
                p_rows.len(),
                &[&logits, &v, &pr, &pt, &pf, &pa, &saved, &count],
            )?;
        }
        let penalties = PenaltyArrays {
            rows: pr,
            tokens: pt,
            saved,
        };
        if !greedy_rows.is_empty() {
            let grid = (greedy_rows.len() as u32, 1);
            launch(s, &k.argmax, grid, 1024, &[&logits, &at(greedy_rows_at), &v, &out])?;
        }
        if !seeded_rows.is_empty() {
            let grid = (seeded_rows.len() as u32, 1);
            let args: [&dyn super::Arg; 5] = [&logits, &at(seeded_rows_at), &v, &at(params_at), &word(rows)];
            launch(s, &k.sample_rows, grid, 1024, &args)?;
        }
        if !stat_rows.is_empty() {
            let count = stat_rows.len() as i32;
            launch_items(
                s,
                &k.chosen_values,
                stat_rows.len(),
                &[&logits, &v, &at(stat_rows_at), &at(token_at_at), &out, &values, &count],
            )?;
        }
        if !conf_rows.is_empty() {
            let grid = (conf_rows.len() as u32, 1);
            let records = word(conf_base);
            launch(
                s,
                &k.drawn_confidence,
                grid,
                1024,
                &[&logits, &v, &at(conf_rows_at), &at(conf_token_at_at), &out, &records],
            )?;
        }
        // Where each row's token lands: argmaxes at their row, seeded draws after them.
        let mut seeded = 0;
        let token_word = specs
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                let spec = spec.as_ref()?;
                Some(match spec.drawn.seeded.is_some() {
                    true => {
                        seeded += 1;
                        (rows + seeded - 1) as u32
                    }
                    false => i as u32,
                })
            })
            .collect();
        Ok(Queued {
            scratch,
            penalties,
            read: ReadPlan {
                token_word,
                p_tokens,
                stats_at: out_len + p_rows.len(),
                values_at: out_len + p_rows.len() + stat_rows.len() * record,
                record,
                conf_base,
            },
        })
    }
}

/// Draws queued on the device (`queue_draws`): the scratch their results go to, the
/// penalties' arrays (a redraw puts their saved values back), and where the results lie.
pub(super) struct Queued {
    pub(super) scratch: CudaSlice<u32>,
    pub(super) penalties: PenaltyArrays,
    pub(super) read: ReadPlan,
}

/// Where a draw's results lie in its scratch: tokens, then the values the penalties replaced,
/// the log-probability records, the drawn tokens' values, the confidence records.
pub(super) struct ReadPlan {
    /// Each drawn row's token's word.
    pub(super) token_word: Vec<Option<u32>>,
    p_tokens: Vec<u32>,
    stats_at: usize,
    values_at: usize,
    record: usize,
    conf_base: usize,
}

impl ReadPlan {
    /// Each row's draw, from the scratch read back (`back`), as `drawn` asked for it.
    pub(super) fn decided(&self, drawn: &[Option<&Drawn>], back: &[u32]) -> Vec<Option<RowDraw>> {
        let f = |i: usize| f32::from_bits(back[i]);
        let (mut stat, mut conf) = (0, 0);
        let mut decided = Vec::with_capacity(drawn.len());
        for (i, d) in drawn.iter().enumerate() {
            let (Some(d), Some(word)) = (d, self.token_word.get(i).copied().flatten()) else {
                decided.push(None);
                continue;
            };
            let token = back[word as usize];
            let logprobs = d.logprobs.map(|n| {
                let rec = self.stats_at + stat * self.record;
                let log_z = f(rec);
                // The value before penalties: the saved one where the token had a penalty.
                let (start, count) = d.penalty_span;
                let value = (start..start + count)
                    .find(|&j| self.p_tokens[j] == token)
                    .map_or(f(self.values_at + stat), |j| f(self.stats_at - self.p_tokens.len() + j));
                let top = (0..n)
                    .map(|j| (back[rec + 1 + 2 * j], f(rec + 2 + 2 * j) - log_z))
                    .collect();
                stat += 1;
                RowLogprobs {
                    logprob: value - log_z,
                    top,
                }
            });
            let confidence = d.confidence.then(|| {
                let at = self.conf_base + 2 * conf;
                conf += 1;
                TokenConfidence {
                    prob: f(at),
                    choices: back[at + 1],
                }
            });
            decided.push(Some(RowDraw {
                token,
                logprobs,
                confidence,
            }));
        }
        decided
    }
}

/// The runs of consecutive true entries, in order: rows copied together.
fn runs(flags: &[bool]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < flags.len() {
        if !flags[i] {
            i += 1;
            continue;
        }
        let start = i;
        while i < flags.len() && flags[i] {
            i += 1;
        }
        out.push(start..i);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_are_the_stretches_of_true_in_order() {
        assert_eq!(
            super::runs(&[true, true, false, true, false, false, true]),
            vec![0..2, 3..4, 6..7]
        );
        assert!(super::runs(&[false, false]).is_empty());
        assert_eq!(super::runs(&[true; 3]), vec![0..3]);
    }
}
