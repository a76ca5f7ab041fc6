//! A projection `y = x W^T (+ b)` over quantized weights. Q4_1 and Q8_0 go through our SIMD
//! kernels; every other GGUF dtype through candle's `QMatMul`. Projections that read the same input
//! (q/k/v, gate/up) are stacked into one matrix so a decode step makes one parallel pass.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use super::pool::{parallel_for, SyncPtr};
use super::q4_1::{self, BlockQ4_1x4, BlockQ8_1, QK};
use super::q4_1_x16::{self, BlockQ4_1x16, OutRows};
use super::q4_1_x8::{self, BlockQ4_1x8};
use super::q8_0_x16::{self, BlockQ8_0x16};
use super::q8_0_x8::{self, BlockQ8_0x8};
use crate::runtime::error::{Result, RuntimeError};

/// Quantized activations of the current call, kept per thread between calls: a prefill chunk's
/// are megabytes, and fresh ones would be page faults on every projection.
#[derive(Default)]
struct Activations {
    q: Vec<BlockQ8_1>,
    scales: Vec<[f32; 2]>,
    shifted: Vec<[u8; QK]>,
}

thread_local! {
    static ACTIVATIONS: std::cell::RefCell<Activations> = std::cell::RefCell::new(Activations::default());
}

/// A grouped layout's kernel over Q8_1 activations: `(weight groups, blocks per row,
/// activation rows, their scales, where the results go)`, as `q4_1_x16::group_dot`,
/// `q4_1_x8::group_dot` and `q8_0_x8::group_dot`.
type GroupDot<W> = unsafe fn(&[W], usize, &[BlockQ8_1], &[[f32; 2]], OutRows);

pub struct Linear {
    out_features: usize,
    in_features: usize,
    weight: Weight,
    bias: Option<Vec<f32>>,
}

enum Weight {
    /// 16-row groups for the AVX-512 kernel (`q4_1_x16::interleave16`).
    Q4_1x16(Vec<BlockQ4_1x16>),
    /// 16-row groups for the AVX-512 kernel (`q8_0_x16::interleave16`).
    Q8_0x16(Vec<BlockQ8_0x16>),
    /// 8-row groups for the AVX2 kernel (`q4_1_x8::interleave8`), where AVX-512 is missing.
    Q4_1x8(Vec<BlockQ4_1x8>),
    /// 8-row groups for the AVX2 kernel (`q8_0_x8::interleave8`), where AVX-512 is missing.
    Q8_0x8(Vec<BlockQ8_0x8>),
    /// Row quads interleaved (`q4_1::interleave4`), where neither group kernel runs.
    Q4_1(Vec<BlockQ4_1x4>),
    Candle(QMatMul),
    /// Different dtypes that could not be concatenated: run one after the other.
    Stacked(Vec<Linear>),
}

impl Linear {
    pub fn from_qtensor(name: &str, t: QTensor, bias: Option<Vec<f32>>) -> Result<Self> {
        let bad = |reason: String| RuntimeError::BadTensor {
            name: name.into(),
            reason,
        };
        let (out_features, in_features) = t.shape().dims2().map_err(|e| bad(e.to_string()))?;
        if let Some(b) = &bias {
            if b.len() != out_features {
                return Err(bad(format!("bias has {} entries for {out_features} outputs", b.len())));
            }
        }
        let weight = if t.dtype() == GgmlDType::Q4_1 && in_features % QK == 0 && out_features % 4 == 0 {
            let bytes = t.data().map_err(|e| bad(e.to_string()))?;
            let blocks = q4_1::blocks_from_bytes(&bytes).ok_or_else(|| bad("ragged Q4_1 data".into()))?;
            if out_features % 16 == 0 && q4_1_x16::available() {
                Weight::Q4_1x16(q4_1_x16::interleave16(&blocks, out_features, in_features / QK))
            } else if out_features % 8 == 0 && q4_1_x8::available() {
                Weight::Q4_1x8(q4_1_x8::interleave8(&blocks, out_features, in_features / QK))
            } else {
                Weight::Q4_1(q4_1::interleave4(&blocks, out_features, in_features / QK))
            }
        } else if t.dtype() == GgmlDType::Q8_0
            && in_features % QK == 0
            && out_features % 16 == 0
            && q8_0_x16::available()
        {
            let bytes = t.data().map_err(|e| bad(e.to_string()))?;
            let groups = q8_0_x16::interleave16(&bytes, out_features, in_features / QK)
                .ok_or_else(|| bad("ragged Q8_0 data".into()))?;
            Weight::Q8_0x16(groups)
        } else if t.dtype() == GgmlDType::Q8_0 && in_features % QK == 0 && out_features % 8 == 0 && q8_0_x8::available()
        {
            let bytes = t.data().map_err(|e| bad(e.to_string()))?;
            let groups = q8_0_x8::interleave8(&bytes, out_features, in_features / QK)
                .ok_or_else(|| bad("ragged Q8_0 data".into()))?;
            Weight::Q8_0x8(groups)
        } else {
            Weight::Candle(QMatMul::from_qtensor(t).map_err(|e| bad(e.to_string()))?)
        };
        Ok(Linear {
            out_features,
            in_features,
            weight,
            bias,
        })
    }

    /// Stacks projections of the same input along the output dimension.
    pub fn stack(parts: Vec<Linear>) -> Result<Self> {
        let in_features = parts.first().map(|p| p.in_features).unwrap_or(0);
        if parts.iter().any(|p| p.in_features != in_features) {
            return Err(RuntimeError::BadTensor {
                name: "stacked projection".into(),
                reason: "input sizes differ".into(),
            });
        }
        let out_features = parts.iter().map(|p| p.out_features).sum();
        let bias = if parts.iter().any(|p| p.bias.is_some()) {
            Some(
                parts
                    .iter()
                    .flat_map(|p| p.bias.clone().unwrap_or_else(|| vec![0.0; p.out_features]))
                    .collect(),
            )
        } else {
            None
        };
        let weight = if let Some(blocks) = concat(&parts, |w| match w {
            Weight::Q4_1x16(b) => Some(b),
            _ => None,
        }) {
            Weight::Q4_1x16(blocks)
        } else if let Some(blocks) = concat(&parts, |w| match w {
            Weight::Q4_1x8(b) => Some(b),
            _ => None,
        }) {
            Weight::Q4_1x8(blocks)
        } else if let Some(blocks) = concat(&parts, |w| match w {
            Weight::Q4_1(b) => Some(b),
            _ => None,
        }) {
            Weight::Q4_1(blocks)
        } else {
            Weight::Stacked(parts.into_iter().map(|p| Linear { bias: None, ..p }).collect())
        };
        Ok(Linear {
            out_features,
            in_features,
            weight,
            bias,
        })
    }

    /// `x` is `[m, in]`, `out` is `[m, out]`, both row-major.
    pub fn forward(&self, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
        debug_assert_eq!(x.len(), m * self.in_features);
        debug_assert_eq!(out.len(), m * self.out_features);
        match &self.weight {
            Weight::Q4_1x16(w) => self.forward_q4_1x16(w, x, m, out),
            Weight::Q4_1x8(w) => self.forward_q4_1x8(w, x, m, out),
            Weight::Q8_0x16(w) => self.forward_q8_0x16(w, x, m, out),
            Weight::Q8_0x8(w) => self.forward_groups(w, 8, 4, q8_0_x8::group_dot, x, m, out),
            Weight::Q4_1(w) => self.forward_q4_1(w, x, m, out),
            Weight::Candle(mm) => {
                let xt = Tensor::from_slice(x, (m, self.in_features), &Device::Cpu)?;
                let y = mm.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?;
                out.copy_from_slice(&y);
            }
            Weight::Stacked(parts) => {
                let mut col = 0;
                for p in parts {
                    let mut part = vec![0f32; m * p.out_features];
                    p.forward(x, m, &mut part)?;
                    for r in 0..m {
                        out[r * self.out_features + col..][..p.out_features]
                            .copy_from_slice(&part[r * p.out_features..][..p.out_features]);
                    }
                    col += p.out_features;
                }
            }
        }
        if let Some(b) = &self.bias {
            for row in out.chunks_exact_mut(self.out_features) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        Ok(())
    }

    /// Quantizes the activations once per call (Q8_1, as llama.cpp does) into `acts`, with
    /// each block's scales as f32 and, for the Q8_0 kernel, the bytes offset to unsigned.
    fn quantize(&self, x: &[f32], m: usize, shifted: bool, acts: &mut Activations) {
        let kb = self.in_features / QK;
        acts.q.resize(m * kb, BlockQ8_1::ZERO);
        acts.scales.resize(m * kb, [0.0; 2]);
        acts.shifted.resize(if shifted { m * kb } else { 0 }, [0; QK]);
        let (q, sc, sh) = (
            SyncPtr(acts.q.as_mut_ptr()),
            SyncPtr(acts.scales.as_mut_ptr()),
            SyncPtr(acts.shifted.as_mut_ptr()),
        );
        parallel_for(m, |rows| {
            for r in rows {
                // SAFETY: each row of the three buffers is handed to exactly one call, and
                // `shifted` has rows only when asked for.
                let (q, sc) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(q.at(r * kb), kb),
                        std::slice::from_raw_parts_mut(sc.at(r * kb), kb),
                    )
                };
                q4_1::quantize_row_q8_1(&x[r * self.in_features..][..self.in_features], q);
                q4_1_x16::scales_into(q, sc);
                if shifted {
                    let sh = unsafe { std::slice::from_raw_parts_mut(sh.at(r * kb), kb) };
                    q8_0_x16::shift_into(q, sh);
                }
            }
        });
    }

    fn forward_q4_1x16(&self, w: &[BlockQ4_1x16], x: &[f32], m: usize, out: &mut [f32]) {
        // Two groups a work item: the pair kernel loads each activation byte once for both.
        self.forward_groups(w, 16, 2, q4_1_x16::group_dot, x, m, out)
    }

    fn forward_q4_1x8(&self, w: &[BlockQ4_1x8], x: &[f32], m: usize, out: &mut [f32]) {
        self.forward_groups(w, 8, 4, q4_1_x8::group_dot, x, m, out)
    }

    /// Weights regrouped `group_rows` rows at a time, through that layout's `group_dot`,
    /// `span` groups a work item.
    #[allow(clippy::too_many_arguments)]
    fn forward_groups<W: Sync>(
        &self,
        w: &[W],
        group_rows: usize,
        span: usize,
        group_dot: GroupDot<W>,
        x: &[f32],
        m: usize,
        out: &mut [f32],
    ) {
        let kb = self.in_features / QK;
        ACTIVATIONS.with_borrow_mut(|acts| {
            self.quantize(x, m, false, acts);
            let (xq, sc) = (&acts.q, &acts.scales);
            self.tiled(m, group_rows, span, out, |groups, rows, dst| {
                let (x, s) = (&xq[rows.start * kb..rows.end * kb], &sc[rows.start * kb..rows.end * kb]);
                // SAFETY: `tiled` hands each (rows, groups) block of the output to one call;
                // the weights are in the layout `group_dot` reads.
                unsafe { group_dot(&w[groups.start * kb..groups.end * kb], kb, x, s, dst) };
            });
        });
    }

    fn forward_q8_0x16(&self, w: &[BlockQ8_0x16], x: &[f32], m: usize, out: &mut [f32]) {
        let kb = self.in_features / QK;
        ACTIVATIONS.with_borrow_mut(|acts| {
            self.quantize(x, m, true, acts);
            let (sh, sc) = (&acts.shifted, &acts.scales);
            self.tiled(m, 16, 1, out, |groups, rows, dst| {
                let (x, s) = (&sh[rows.start * kb..rows.end * kb], &sc[rows.start * kb..rows.end * kb]);
                // SAFETY: `tiled` hands each (rows, groups) block of the output to one call.
                unsafe { q8_0_x16::group_dot(&w[groups.start * kb..groups.end * kb], x, s, dst) };
            });
        });
    }

    /// Runs `dot(groups, activation rows, where their results go)` over every run of `span`
    /// weight groups of `group_rows` rows (one at the end where they do not divide) and every tile of
    /// activation rows. Work items are (block of rows, groups): small enough that the threads
    /// finish together, and within one the groups' weights stay in L1 and the rows in L2.
    fn tiled(
        &self,
        m: usize,
        group_rows: usize,
        span: usize,
        out: &mut [f32],
        dot: impl Fn(std::ops::Range<usize>, std::ops::Range<usize>, OutRows) + Sync,
    ) {
        const TILE: usize = q4_1_x16::TILE;
        // 128 rows of activations are 80-220 KiB of Q8_1 blocks for this model's widths;
        // blocks of 128 were 5-15% faster than whole columns of a 2,048-row prefill chunk.
        const ROW_BLOCK: usize = 128;
        let n = self.out_features;
        debug_assert_eq!(out.len(), m * n);
        let groups = n / group_rows;
        let spans = groups.div_ceil(span);
        let dst = SyncPtr(out.as_mut_ptr());
        parallel_for(m.div_ceil(ROW_BLOCK) * spans, |items| {
            for item in items {
                let (block, s) = (item / spans, item % spans);
                let gs = s * span..groups.min((s + 1) * span);
                for r0 in (block * ROW_BLOCK..m.min((block + 1) * ROW_BLOCK)).step_by(TILE) {
                    let rows = TILE.min(m - r0);
                    // SAFETY: rows r0.. and columns group_rows * gs.start.. of the output, inside it.
                    let ptr = unsafe { dst.at(r0 * n + gs.start * group_rows) };
                    dot(gs.clone(), r0..r0 + rows, OutRows { ptr, stride: n });
                }
            }
        });
    }

    fn forward_q4_1(&self, w: &[BlockQ4_1x4], x: &[f32], m: usize, out: &mut [f32]) {
        let (n, kb) = (self.out_features, self.in_features / QK);
        ACTIVATIONS.with_borrow_mut(|acts| {
            self.quantize(x, m, false, acts);
            Self::quads(w, &acts.q, n, kb, m, out)
        });
    }

    fn quads(w: &[BlockQ4_1x4], xq: &[BlockQ8_1], n: usize, kb: usize, m: usize, out: &mut [f32]) {
        let kernel = q4_1::quad_kernel();
        let dst = SyncPtr(out.as_mut_ptr());
        // Quad-major: each weight quad streams in once and meets every activation row while it
        // is in L1; the activations (a few hundred KiB at most) stay in L2.
        parallel_for(n / 4, |quads| {
            let mut res = [[0f32; 4]; q4_1::MAX_ROWS];
            for quad in quads {
                let wq = &w[quad * kb..(quad + 1) * kb];
                for r0 in (0..m).step_by(q4_1::MAX_ROWS) {
                    let rows = q4_1::MAX_ROWS.min(m - r0);
                    let mut xs: [&[BlockQ8_1]; q4_1::MAX_ROWS] = [&[]; q4_1::MAX_ROWS];
                    for (i, slot) in xs.iter_mut().take(rows).enumerate() {
                        *slot = &xq[(r0 + i) * kb..(r0 + i + 1) * kb];
                    }
                    kernel(wq, &xs[..rows], &mut res[..rows]);
                    for (i, r) in res.iter().take(rows).enumerate() {
                        // SAFETY: each (row, quad) is written by exactly one work item.
                        unsafe { std::ptr::copy_nonoverlapping(r.as_ptr(), dst.at((r0 + i) * n + quad * 4), 4) };
                    }
                }
            }
        });
    }
}

/// Every part's blocks, one after the other, when every part holds the layout `pick` finds:
/// each part has whole groups of rows, so its groups simply follow the previous part's.
fn concat<T: Clone>(parts: &[Linear], pick: impl Fn(&Weight) -> Option<&Vec<T>>) -> Option<Vec<T>> {
    let mut blocks = Vec::new();
    for p in parts {
        blocks.extend_from_slice(pick(&p.weight)?);
    }
    Some(blocks)
}
