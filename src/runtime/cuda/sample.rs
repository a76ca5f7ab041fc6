//! Sampling where the logits are: per row the grammar's mask, the copy bias and the penalties
//! are applied in place, then the argmax or a seeded draw (kernels/sampling.cu) picks the
//! token; only token ids come back, and the logits of the rows the engine keeps for itself.

use super::kernels::SampleParams;
use super::staging::Staging;
use super::timing::Phase;
use super::{device_err, launch, CudaBackend, THREADS};
use crate::runtime::batch::Logits;
use crate::runtime::error::{Result, RuntimeError};
use crate::runtime::{Draw, RowRequest, Sampled};

/// How a row of the last `sample` was drawn, kept for `redraw_within`.
#[derive(Clone, Copy)]
pub(super) enum Drawn {
    Argmax,
    Seeded(SampleParams),
}

impl Drawn {
    fn of(d: &Draw<'_>) -> Self {
        if d.temperature <= 0.0 {
            return Drawn::Argmax;
        }
        Drawn::Seeded(SampleParams {
            temperature: d.temperature,
            top_k: d.top_k.min(i32::MAX as usize) as i32,
            top_p: d.top_p,
            min_p: d.min_p,
            seed: d.seed,
            counter: d.counter,
        })
    }
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

impl CudaBackend {
    pub(super) fn sample_rows(&mut self, requests: &[RowRequest<'_>]) -> Result<Sampled> {
        let (vocab, rows) = (self.config.vocab_size, self.rows);
        if requests.len() != rows {
            return Err(RuntimeError::InvalidBatch(format!(
                "{} rows asked for, the last pass computed {rows}",
                requests.len()
            )));
        }
        let s = self.stream.clone();
        let started = std::time::Instant::now();
        self.mark(Phase::Sample);
        self.drawn = requests.iter().map(|r| r.draw.as_ref().map(Drawn::of)).collect();
        let words = vocab.div_ceil(32);
        let logits = self.ptr(&self.buffers.logits);

        // Everything the kernels read, in one upload.
        let st = &mut self.sample_staging;
        st.clear();
        let mut mask_rows = vec![-1i32; rows];
        let mut masks_at = None;
        let mut bias_rows = vec![-1i32; rows];
        let mut bias = vec![0f32; rows];
        let mut bias_at = None;
        let mut n_masks = 0;
        for (i, r) in requests.iter().enumerate() {
            if let (Some(_), Some(m)) = (&r.draw, r.mask) {
                let at = st.push_with(words, |dst| fill_mask(dst, m))?;
                masks_at.get_or_insert(at);
                mask_rows[i] = n_masks;
                n_masks += 1;
            }
        }
        let mut n_bias = 0;
        for (i, r) in requests.iter().enumerate() {
            if let Some((m, b)) = r.draw.as_ref().and_then(|d| d.bias) {
                let at = st.push_with(words, |dst| fill_mask(dst, m))?;
                bias_at.get_or_insert(at);
                bias_rows[i] = n_bias;
                bias[i] = b;
                n_bias += 1;
            }
        }
        let mask_rows_at = st.push_i32(&mask_rows)?;
        let bias_rows_at = st.push_i32(&bias_rows)?;
        let bias_values_at = st.push_f32(&bias)?;
        let (mut p_rows, mut p_tokens, mut p_factors, mut p_adds) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, r) in requests.iter().enumerate() {
            for p in r.draw.as_ref().map_or(&[][..], |d| d.penalties) {
                if p.token as usize >= vocab {
                    continue;
                }
                p_rows.push(i as u32);
                p_tokens.push(p.token);
                p_factors.push(p.factor);
                p_adds.push(p.add);
            }
        }
        let penalties_at = [
            st.push(&p_rows)?,
            st.push(&p_tokens)?,
            st.push_f32(&p_factors)?,
            st.push_f32(&p_adds)?,
        ];
        let mut seeded_rows = Vec::new();
        for (i, d) in self.drawn.iter().enumerate() {
            if let Some(Drawn::Seeded(_)) = d {
                seeded_rows.push(i as u32);
            }
        }
        let seeded_rows_at = st.push(&seeded_rows)?;
        st.align(2)?;
        let params_at = st.len_words();
        for d in &self.drawn {
            if let Some(Drawn::Seeded(p)) = d {
                st.push(&params_words(p))?;
            }
        }
        let base = st.send(&s)?;
        let at = |offset: usize| Staging::addr(base, offset);

        let (v, w) = (vocab as i32, words as i32);
        let cols = (vocab as u32).div_ceil(THREADS);
        let k = &self.kernels;
        if let Some(m) = masks_at {
            launch(
                &s,
                &k.apply_bitmask,
                (rows as u32, cols),
                THREADS,
                &[&logits, &at(m), &at(mask_rows_at), &v, &w],
            )?;
        }
        if let Some(b) = bias_at {
            launch(
                &s,
                &k.add_bias_where,
                (rows as u32, cols),
                THREADS,
                &[&logits, &at(b), &at(bias_rows_at), &at(bias_values_at), &v, &w],
            )?;
        }
        if !p_rows.is_empty() {
            let count = p_rows.len() as i32;
            let [pr, pt, pf, pa] = penalties_at.map(at);
            launch(
                &s,
                &k.apply_penalties,
                ((p_rows.len() as u32).div_ceil(THREADS), 1),
                THREADS,
                &[&logits, &v, &pr, &pt, &pf, &pa, &count],
            )?;
        }
        // Token ids: rows' argmaxes first, then the seeded draws.
        let out = s
            .alloc_zeros::<u32>(rows + seeded_rows.len())
            .map_err(device_err("sampling"))?;
        let out_ptr = self.ptr(&out);
        let any_argmax = self.drawn.iter().any(|d| matches!(d, Some(Drawn::Argmax)));
        if any_argmax {
            launch(&s, &k.argmax, (rows as u32, 1), 1024, &[&logits, &v, &out_ptr])?;
        }
        if !seeded_rows.is_empty() {
            let seeded_out = out_ptr + (rows * std::mem::size_of::<u32>()) as u64;
            launch(
                &s,
                &k.sample_rows,
                (seeded_rows.len() as u32, 1),
                1024,
                &[&logits, &at(seeded_rows_at), &v, &at(params_at), &seeded_out],
            )?;
        }

        // The rows left to the engine: their logits come back, one copy per run of rows.
        let mut data = Vec::new();
        let mut i = 0;
        while i < rows {
            if self.drawn[i].is_some() {
                i += 1;
                continue;
            }
            let start = i;
            while i < rows && self.drawn[i].is_none() {
                i += 1;
            }
            let part = s
                .clone_dtoh(&self.buffers.logits.slice(start * vocab..i * vocab))
                .map_err(device_err("copying logits"))?;
            data.extend_from_slice(&part);
        }
        let ids = if any_argmax || !seeded_rows.is_empty() {
            s.clone_dtoh(&out).map_err(device_err("copying sampled tokens"))?
        } else {
            Vec::new()
        };
        s.synchronize().map_err(device_err("sampling"))?;
        self.in_flight = false;
        let mut seeded = 0;
        let tokens = self
            .drawn
            .iter()
            .enumerate()
            .map(|(i, d)| match d {
                None => None,
                Some(Drawn::Argmax) => Some(ids[i]),
                Some(Drawn::Seeded(_)) => {
                    seeded += 1;
                    Some(ids[rows + seeded - 1])
                }
            })
            .collect();
        if let Some(timing) = &self.timing {
            timing.finish(&s, started, true, 0);
        }
        Ok(Sampled {
            tokens,
            logits: Logits {
                vocab_size: vocab,
                data,
            },
        })
    }

    /// `Backend::redraw_within`: the row's logits already carry its mask, bias and penalties;
    /// the narrower mask leaves a subset of what its mask allowed.
    pub(super) fn redraw(&mut self, row: usize, mask: &[u32]) -> Result<u32> {
        let Some(Some(drawn)) = self.drawn.get(row).copied() else {
            return Err(RuntimeError::InvalidBatch(format!(
                "row {row} was not drawn on the device in the last step"
            )));
        };
        let (vocab, words) = (self.config.vocab_size, self.config.vocab_size.div_ceil(32));
        let s = self.stream.clone();
        let st = &mut self.sample_staging;
        st.clear();
        let mask_at = st.push_with(words, |dst| fill_mask(dst, mask))?;
        let zero_at = st.push_i32(&[0])?;
        let row_at = st.push(&[row as u32])?;
        st.align(2)?;
        let params_at = st.len_words();
        if let Drawn::Seeded(p) = drawn {
            st.push(&params_words(&p))?;
        }
        let base = st.send(&s)?;
        let at = |offset: usize| Staging::addr(base, offset);
        let logits = self.ptr(&self.buffers.logits) + (row * vocab * std::mem::size_of::<f32>()) as u64;
        let (v, w) = (vocab as i32, words as i32);
        let k = &self.kernels;
        launch(
            &s,
            &k.apply_bitmask,
            (1, (vocab as u32).div_ceil(THREADS)),
            THREADS,
            &[&logits, &at(mask_at), &at(zero_at), &v, &w],
        )?;
        let out = s.alloc_zeros::<u32>(1).map_err(device_err("sampling"))?;
        let out_ptr = self.ptr(&out);
        match drawn {
            Drawn::Argmax => launch(&s, &k.argmax, (1, 1), 1024, &[&logits, &v, &out_ptr])?,
            Drawn::Seeded(_) => {
                let all = self.ptr(&self.buffers.logits);
                launch(
                    &s,
                    &k.sample_rows,
                    (1, 1),
                    1024,
                    &[&all, &at(row_at), &v, &at(params_at), &out_ptr],
                )?
            }
        }
        let id = s.clone_dtoh(&out).map_err(device_err("copying sampled tokens"))?;
        s.synchronize().map_err(device_err("sampling"))?;
        Ok(id[0])
    }
}
