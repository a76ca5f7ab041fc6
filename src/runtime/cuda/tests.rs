//! Every kernel against a plain CPU reference, on shapes that hit the edges (one token, block
//! boundaries, a context of thousands, a vocabulary that is not a multiple of 32, rows with and
//! without masks). Skipped, with a message, where there is no GPU; failed there under
//! `QUARRY_TEST_DEVICE=cuda`.

use half::bf16;

use super::gemm::{GemmTile, OutType};
use super::*;
use cudarc::driver::CudaFunction;

struct Gpu {
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Kernels,
    gemm: Gemm,
}

fn gpu() -> Option<Gpu> {
    crate::runtime::device::cuda_for_test()?;
    let ctx = CudaContext::new(0).expect("context");
    // SAFETY: one stream.
    unsafe { ctx.disable_event_tracking() };
    // A stream of its own: the legacy default stream cannot be captured (`median_ms`).
    let stream = ctx.new_stream().expect("stream");
    let k = Kernels::load(&ctx).expect("kernels compile");
    let gemm = Gemm::new(stream.clone(), &k, false, 0).expect("cublas");
    Some(Gpu {
        _ctx: ctx,
        stream,
        k,
        gemm,
    })
}

impl Gpu {
    /// The device's streaming multiprocessors.
    fn sms(&self) -> usize {
        self.stream
            .context()
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap() as usize
    }
    /// The tensor-core GEMV kernel in blocks of one group of 16 columns (16 warps a block),
    /// whatever grid `Gemm::gemv_mma` would choose; queued, not waited for.
    fn gemv_mma_one_group(&self, x: u64, w: u64, y: u64, rows: usize, n: usize, k: usize) {
        let (r, n32, k32) = (rows as i32, n as i32, k as i32);
        let grid = (n.div_ceil(16) as u32, 1);
        launch(&self.stream, &self.k.gemv_mma, grid, 512, &[&x, &w, &y, &r, &n32, &k32]).unwrap();
    }
    fn f32s(&self, v: &[f32]) -> CudaSlice<f32> {
        self.stream.clone_htod(v).unwrap()
    }
    fn u32s(&self, v: &[u32]) -> CudaSlice<u32> {
        self.stream.clone_htod(v).unwrap()
    }
    fn i32s(&self, v: &[i32]) -> CudaSlice<i32> {
        self.stream.clone_htod(v).unwrap()
    }
    fn bf16s(&self, v: &[f32]) -> CudaSlice<u16> {
        let bits: Vec<u16> = v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        self.stream.clone_htod(&bits).unwrap()
    }
    fn zeros_f32(&self, n: usize) -> CudaSlice<f32> {
        self.stream.alloc_zeros(n).unwrap()
    }
    fn zeros_bf16(&self, n: usize) -> CudaSlice<u16> {
        self.stream.alloc_zeros(n).unwrap()
    }
    fn read_f32(&self, s: &CudaSlice<f32>) -> Vec<f32> {
        self.stream.clone_dtoh(s).unwrap()
    }
    fn read_bf16(&self, s: &CudaSlice<u16>) -> Vec<f32> {
        let bits: Vec<u16> = self.stream.clone_dtoh(s).unwrap();
        bits.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect()
    }
    fn p<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }
    fn run(&self, f: &CudaFunction, grid: (u32, u32), block: u32, args: &[&dyn Arg]) {
        launch(&self.stream, f, grid, block, args).unwrap();
        self.stream.synchronize().unwrap();
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Within one bf16 rounding of the reference (relative 2^-8), plus `abs`.
fn assert_close(what: &str, got: &[f32], want: &[f64], abs: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() - (w.abs() / 256.0 + abs);
        if err > worst.0 {
            worst = (err, i);
        }
    }
    assert!(
        worst.0 <= 0.0,
        "{what}: index {} got {} want {} (beyond tolerance by {})",
        worst.1,
        got[worst.1],
        want[worst.1],
        worst.0
    );
}

#[test]
fn rms_norm_with_residual_add_matches_the_reference() {
    let Some(g) = gpu() else { return };
    // Rows read once in 16-byte pieces, and (a width not a multiple of 4) twice a value at a time.
    for d in [576usize, 1000, 4096, 998] {
        let rows = 3;
        let (x0, y0, w) = (values(rows * d, 1), values(rows * d, 2), values(d, 3));
        let (x, y, wd, out) = (g.f32s(&x0), g.f32s(&y0), g.f32s(&w), g.zeros_bf16(rows * d));
        let (one, di, eps) = (1i32, d as i32, 1e-5f32);
        g.run(
            &g.k.add_rms_norm,
            (rows as u32, 1),
            ROW_THREADS,
            &[&g.p(&x), &g.p(&y), &0u64, &one, &g.p(&wd), &g.p(&out), &di, &eps],
        );
        let sum: Vec<f32> = x0.iter().zip(&y0).map(|(a, b)| a + b).collect();
        assert_eq!(g.read_f32(&x), sum, "the residual stream keeps x + y exactly");
        let mut want = Vec::new();
        for r in 0..rows {
            let row = &sum[r * d..][..d];
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
            let scale = 1.0 / (ms + eps as f64).sqrt();
            want.extend(row.iter().zip(&w).map(|(&v, &wi)| v as f64 * scale * wi as f64));
        }
        assert_close(&format!("norm d={d}"), &g.read_bf16(&out), &want, 1e-6);

        // Picked rows, x left alone: the last norm before the head.
        let picked = g.u32s(&[2, 0]);
        let out2 = g.zeros_bf16(2 * d);
        let zero = 0i32;
        g.run(
            &g.k.add_rms_norm,
            (2, 1),
            THREADS,
            &[
                &g.p(&x),
                &g.p(&y),
                &g.p(&picked),
                &zero,
                &g.p(&wd),
                &g.p(&out2),
                &di,
                &eps,
            ],
        );
        assert_eq!(g.read_f32(&x), sum, "x untouched without write-back");
        let mut want2 = Vec::new();
        for r in [2usize, 0] {
            let row: Vec<f32> = sum[r * d..][..d]
                .iter()
                .zip(&y0[r * d..][..d])
                .map(|(a, b)| a + b)
                .collect();
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
            let scale = 1.0 / (ms + eps as f64).sqrt();
            want2.extend(row.iter().zip(&w).map(|(&v, &wi)| v as f64 * scale * wi as f64));
        }
        assert_close(&format!("picked norm d={d}"), &g.read_bf16(&out2), &want2, 1e-6);
    }
}

#[test]
fn rope_and_cache_rotates_queries_and_keys_and_writes_the_cache() {
    let Some(g) = gpu() else { return };
    let (head_dim, heads, kv_heads, theta, max_pos) = (64usize, 5usize, 2usize, 10_000f32, 4096usize);
    let (q_size, kv_size) = (heads * head_dim, kv_heads * head_dim);
    let (cos, sin) = crate::runtime::cpu::rope_tables(head_dim, theta, max_pos);
    let (cos_d, sin_d) = (g.f32s(&cos), g.f32s(&sin));
    let width = q_size + 2 * kv_size;
    let positions = [0u32, 1, 15, 16, 4095];
    let slots = [7u32, 0, 3, 12, 5];
    let rows = values(positions.len() * width, 4);
    for halves in [0i32, 1] {
        let (qkv, pos, slots_d) = (g.f32s(&rows), g.u32s(&positions), g.u32s(&slots));
        let (q, kc, vc) = (
            g.zeros_bf16(positions.len() * q_size),
            g.zeros_bf16(16 * kv_size),
            g.zeros_bf16(16 * kv_size),
        );
        let (w, h, kvh, hd) = (width as i32, heads as i32, kv_heads as i32, head_dim as i32);
        g.run(
            &g.k.rope_and_cache,
            (positions.len() as u32, 1),
            ROW_THREADS,
            &[
                &g.p(&qkv),
                &w,
                &g.p(&pos),
                &g.p(&cos_d),
                &g.p(&sin_d),
                &h,
                &kvh,
                &hd,
                &halves,
                &g.p(&slots_d),
                &g.p(&q),
                &g.p(&kc),
                &g.p(&vc),
            ],
        );
        let (got_q, got_k, got_v) = (g.read_bf16(&q), g.read_bf16(&kc), g.read_bf16(&vc));
        for (t, &p) in positions.iter().enumerate() {
            let row = &rows[t * width..][..width];
            // Every q and k head rotated, as the CPU's tables say.
            let mut want: Vec<f64> = row[..q_size + kv_size].iter().map(|&v| v as f64).collect();
            for hi in 0..heads + kv_heads {
                let base = hi * head_dim;
                for j in 0..head_dim / 2 {
                    let angle = p as f64 * (theta as f64).powf(-2.0 * j as f64 / head_dim as f64);
                    let (a, b) = if halves == 1 {
                        (j, j + head_dim / 2)
                    } else {
                        (2 * j, 2 * j + 1)
                    };
                    let (x0, x1) = (row[base + a] as f64, row[base + b] as f64);
                    want[base + a] = x0 * angle.cos() - x1 * angle.sin();
                    want[base + b] = x0 * angle.sin() + x1 * angle.cos();
                }
            }
            // f32 angles at position 4095 carry ~1e-4 of error.
            let what = format!("halves={halves} position {p}");
            assert_close(
                &format!("q, {what}"),
                &got_q[t * q_size..][..q_size],
                &want[..q_size],
                2e-3,
            );
            let slot = slots[t] as usize;
            assert_close(
                &format!("k, {what}"),
                &got_k[slot * kv_size..][..kv_size],
                &want[q_size..],
                2e-3,
            );
            // v is copied, rounded to bf16, into the token's slot.
            assert_eq!(
                &got_v[slot * kv_size..][..kv_size],
                &rounded(&row[q_size + kv_size..])[..],
                "v of {what}"
            );
        }
    }
}

/// A batch's metadata on the device as the backend stages it for attention: each token's
/// sequence, the positions, the block tables padded to the flash kernel's width, its items.
struct DeviceBatch {
    seqs: CudaSlice<u32>,
    positions: CudaSlice<u32>,
    tables: CudaSlice<u32>,
    items: CudaSlice<u32>,
    item_count: usize,
    /// Split attention's record bases, and the partitions the tokens reach in all.
    bases: CudaSlice<u32>,
    partitions: usize,
    max_blocks: usize,
    tokens: usize,
    num_seqs: usize,
    max_len: usize,
}

impl DeviceBatch {
    fn new(g: &Gpu, batch: &ForwardBatch, group: usize) -> Self {
        let max_blocks = attention::table_width(batch.block_tables.iter().map(Vec::len).max().unwrap());
        let mut flat = vec![0u32; batch.num_seqs() * max_blocks];
        let mut token_seq = Vec::new();
        for (s, t) in batch.block_tables.iter().enumerate() {
            flat[s * max_blocks..][..t.len()].copy_from_slice(t);
            token_seq.extend(std::iter::repeat_n(
                s as u32,
                (batch.query_start[s + 1] - batch.query_start[s]) as usize,
            ));
        }
        let items = attention::flash_items(batch, group);
        let mut bases = vec![0; batch.positions.len()];
        let partitions = attention::part_bases(&batch.positions, &mut bases);
        DeviceBatch {
            seqs: g.u32s(&token_seq),
            positions: g.u32s(&batch.positions),
            tables: g.u32s(&flat),
            items: g.u32s(&items),
            item_count: items.len() / 4,
            bases: g.u32s(&bases),
            partitions,
            max_blocks,
            tokens: batch.num_tokens(),
            num_seqs: batch.num_seqs(),
            max_len: *batch.context_lens.iter().max().unwrap() as usize,
        }
    }

    /// The backend's plan for this batch, `target_blocks` filling the GPU.
    fn plan(&self, g: &Gpu, head_dim: usize, heads: usize, kv_heads: usize, target_blocks: usize) -> attention::Plan {
        let (items, count) = (g.p(&self.items), self.item_count);
        let rule = attention::SplitRule {
            head_dim,
            heads,
            kv_heads,
            target_blocks,
        };
        let split = rule.split(count, self.num_seqs, self.max_len, self.partitions, false);
        attention::Plan::new(
            head_dim,
            heads,
            self.tokens,
            self.max_len,
            items,
            count,
            target_blocks,
            split.then(|| g.p(&self.bases)),
        )
    }

    /// One layer's attention arguments over this batch: bf16 queries `q` into `out`.
    #[allow(clippy::too_many_arguments)]
    fn args(
        &self,
        g: &Gpu,
        [q, out, k_cache, v_cache]: [u64; 4],
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> attention::AttentionArgs {
        attention::AttentionArgs {
            q,
            out,
            k_cache,
            v_cache,
            token_seq: g.p(&self.seqs),
            positions: g.p(&self.positions),
            tables: g.p(&self.tables),
            max_blocks: self.max_blocks as i32,
            block_size: BLOCK_SIZE as i32,
            heads: heads as i32,
            kv_heads: kv_heads as i32,
            head_dim: head_dim as i32,
            scale: 1.0 / (head_dim as f32).sqrt(),
        }
    }
}

/// A paged KV cache of several documents, their keys, values and queries drawn at random and
/// rounded to bf16, their blocks scattered over the pool; a batch picks (document, context
/// length, query tokens): the last tokens of that context, as a decode token, a prefill chunk
/// against its cached prefix or a speculative check would be.
struct KvFixture {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    tables: Vec<Vec<u32>>,
    /// Per slot, `[kv_heads * head_dim]`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Per document, `[len, heads * head_dim]`.
    q: Vec<Vec<f32>>,
    kc: CudaSlice<u16>,
    vc: CudaSlice<u16>,
}

/// How a test runs the attention of a batch.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// What the backend would choose (`Plan::new`).
    Chosen,
    /// The flash kernel with every partition its own block, then the merge.
    Split,
    /// The flash kernel, each block walking its partitions.
    Whole,
}

impl KvFixture {
    fn new(g: &Gpu, heads: usize, kv_heads: usize, head_dim: usize, lens: &[usize], seed: u64) -> Self {
        let block = BLOCK_SIZE;
        let kv_size = kv_heads * head_dim;
        let total_blocks: usize = lens.iter().map(|l| l.div_ceil(block)).sum::<usize>() + 5;
        let mut pool: Vec<u32> = (0..total_blocks as u32).collect();
        let mut state = seed;
        for i in (1..pool.len()).rev() {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
            pool.swap(i, (state >> 33) as usize % (i + 1));
        }
        let mut tables = Vec::new();
        let mut next = 0;
        for &len in lens {
            tables.push(pool[next..next + len.div_ceil(block)].to_vec());
            next += len.div_ceil(block);
        }
        // Slots no document uses hold NaN: a kernel that reads past a sequence shows it.
        let slots = total_blocks * block;
        let mut k = vec![f32::NAN; slots * kv_size];
        let mut v = vec![f32::NAN; slots * kv_size];
        let mut q = Vec::new();
        for (d, &len) in lens.iter().enumerate() {
            let (kd, vd) = (
                rounded(&values(len * kv_size, seed + 100 + d as u64)),
                rounded(&values(len * kv_size, seed + 200 + d as u64)),
            );
            for p in 0..len {
                let slot = tables[d][p / block] as usize * block + p % block;
                k[slot * kv_size..][..kv_size].copy_from_slice(&kd[p * kv_size..][..kv_size]);
                v[slot * kv_size..][..kv_size].copy_from_slice(&vd[p * kv_size..][..kv_size]);
            }
            q.push(rounded(&values(len * heads * head_dim, seed + 300 + d as u64)));
        }
        let (kc, vc) = (g.bf16s(&k), g.bf16s(&v));
        KvFixture {
            heads,
            kv_heads,
            head_dim,
            tables,
            k,
            v,
            q,
            kc,
            vc,
        }
    }

    fn batch(&self, picks: &[(usize, usize, usize)]) -> ForwardBatch {
        let mut batch = ForwardBatch::default();
        for &(doc, ctx, n) in picks {
            batch.push_sequence(&vec![0; n], ctx - n, &self.tables[doc], BLOCK_SIZE);
        }
        batch
    }

    /// The attention output of every query row of `picks`, as bf16 bits.
    fn run(&self, g: &Gpu, picks: &[(usize, usize, usize)], mode: Mode) -> Vec<u16> {
        self.run_with(g, &g.k, picks, mode)
    }

    /// `run` on the kernels `k`.
    fn run_with(&self, g: &Gpu, k: &Kernels, picks: &[(usize, usize, usize)], mode: Mode) -> Vec<u16> {
        let batch = self.batch(picks);
        let q_size = self.heads * self.head_dim;
        let mut q = Vec::new();
        for &(doc, ctx, n) in picks {
            q.extend_from_slice(&self.q[doc][(ctx - n) * q_size..ctx * q_size]);
        }
        let d = DeviceBatch::new(g, &batch, self.heads / self.kv_heads);
        let chosen = d.plan(g, self.head_dim, self.heads, self.kv_heads, 528);
        let parts = attention::partitions_within(d.max_len);
        let plan = match (mode, chosen) {
            (Mode::Chosen, plan) => plan,
            (Mode::Split, attention::Plan::Flash { items, count, .. }) => attention::Plan::Flash {
                items,
                count,
                split: (parts > 1).then(|| attention::Split {
                    parts,
                    bases: g.p(&d.bases),
                }),
            },
            (Mode::Whole, attention::Plan::Flash { items, count, .. }) => attention::Plan::Flash {
                items,
                count,
                split: None,
            },
            (mode, plan) => panic!("{mode:?} asked of {plan:?}"),
        };
        let q_d = g.bf16s(&q);
        let out: CudaSlice<u16> = g.stream.clone_htod(&vec![0xffffu16; d.tokens * q_size]).unwrap(); // NaN
        let partials = g.zeros_f32(attention::SCRATCH_FLOATS);
        let buffers = [g.p(&q_d), g.p(&out), g.p(&self.kc), g.p(&self.vc)];
        let args = d.args(g, buffers, self.heads, self.kv_heads, self.head_dim);
        let (tokens, max_len) = (d.tokens, d.max_len);
        attention::launch(&g.stream, k, &args, plan, tokens, max_len, g.p(&partials)).unwrap();
        g.stream.synchronize().unwrap();
        g.stream.clone_dtoh(&out).unwrap()
    }

    /// Softmax attention in f64 over the same bf16 values.
    fn reference(&self, picks: &[(usize, usize, usize)]) -> Vec<f64> {
        let (hd, q_size, kv_size) = (self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut want = Vec::new();
        for &(doc, ctx, n) in picks {
            let slot = |p: usize| self.tables[doc][p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE;
            for p in ctx - n..ctx {
                for h in 0..self.heads {
                    let kvh = h / (self.heads / self.kv_heads);
                    let q = &self.q[doc][p * q_size + h * hd..][..hd];
                    let scores: Vec<f64> = (0..=p)
                        .map(|j| {
                            let k = &self.k[slot(j) * kv_size + kvh * hd..][..hd];
                            k.iter().zip(q).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale
                        })
                        .collect();
                    let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    let mut out = vec![0f64; hd];
                    for (j, w) in weights.iter().enumerate() {
                        let v = &self.v[slot(j) * kv_size + kvh * hd..][..hd];
                        for d in 0..hd {
                            out[d] += w / total * v[d] as f64;
                        }
                    }
                    want.extend(out);
                }
            }
        }
        want
    }
}

fn bf16_bits_to_f32(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect()
}

/// Every GQA ratio of the models we run (1, 3, 4, 7, 8) at heads of 64 and 128, and a head of
/// 36 (the general kernel), over a batch of a decode token at the end of 3,000 keys, a prefill
/// chunk against its cached prefix across a partition boundary, a lone first token, a prefill
/// from position 0, and a speculative check of 9 rows across a partition boundary.
#[test]
fn attention_matches_the_reference_for_every_gqa_ratio_and_head_size() {
    let Some(g) = gpu() else { return };
    // The chunk and the check straddle the partition boundary at 512 keys.
    let lens = [3000usize, 540, 1, 64, 517];
    let picks = [
        (0usize, 3000usize, 1usize),
        (1, 540, 37),
        (2, 1, 1),
        (3, 64, 64),
        (4, 517, 9),
    ];
    for (heads, kv_heads, head_dim) in [
        (8usize, 8usize, 64usize),
        (9, 3, 64),
        (32, 8, 128),
        (28, 4, 128),
        (64, 8, 128),
        (16, 2, 64),
        (7, 1, 128),
        (4, 2, 36),
    ] {
        let f = KvFixture::new(&g, heads, kv_heads, head_dim, &lens, head_dim as u64 + heads as u64);
        let want = f.reference(&picks);
        let what = format!("{heads} heads / {kv_heads} kv heads x {head_dim}");
        if !attention::flash_head(head_dim) {
            let got = bf16_bits_to_f32(&f.run(&g, &picks, Mode::Chosen));
            assert_close(&format!("general kernel, {what}"), &got, &want, 2e-3);
            continue;
        }
        let (split, whole) = (f.run(&g, &picks, Mode::Split), f.run(&g, &picks, Mode::Whole));
        // bf16 probabilities times values in [-1, 1]: at most 2^-9 of error before the output's
        // own rounding.
        assert_close(&format!("flash, split, {what}"), &bf16_bits_to_f32(&split), &want, 2e-3);
        assert_close(&format!("flash, whole, {what}"), &bf16_bits_to_f32(&whole), &want, 2e-3);
        let differ = split.iter().zip(&whole).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ, 0,
            "{what}: split and whole partitions differ in {differ} values"
        );
    }
}

/// A request's attention output is a function of the request alone: the same bits alone, in
/// batches of 2 to 64 beside other requests (which move it in the batch and change how the
/// keys are split across blocks), and, for a prefill, whatever its chunks.
#[test]
fn attention_is_bitwise_the_same_alone_in_any_batch_and_in_any_chunking() {
    let Some(g) = gpu() else { return };
    for (heads, kv_heads, head_dim) in [(32usize, 8usize, 128usize), (9, 3, 64), (28, 4, 128)] {
        let mut lens = vec![2100usize, 700, 300];
        lens.extend((0..64).map(|i| 17 + 61 * i));
        let f = KvFixture::new(&g, heads, kv_heads, head_dim, &lens, 5);
        let q_size = heads * head_dim;
        let what = format!("{heads}/{kv_heads}x{head_dim}");
        // A decode token, a prefill chunk against a cached prefix, a speculative check.
        let targets = [(0usize, 2100usize, 1usize), (1, 700, 200), (2, 300, 9)];
        for target in targets {
            let alone = f.run(&g, &[target], Mode::Chosen);
            for others in [1usize, 7, 31, 63] {
                let mut picks: Vec<(usize, usize, usize)> = (0..others)
                    .map(|i| {
                        let doc = 3 + i;
                        let len = lens[doc];
                        (doc, len, if i % 3 == 0 { len.min(40) } else { 1 })
                    })
                    .collect();
                let at = others / 2;
                picks.insert(at, target);
                let batch = f.run(&g, &picks, Mode::Chosen);
                let offset: usize = picks[..at].iter().map(|p| p.2).sum::<usize>() * q_size;
                assert!(
                    batch[offset..][..alone.len()] == alone[..],
                    "{what}: request {target:?} differs between alone and a batch of {}",
                    others + 1
                );
            }
        }
        // One prefill of 700 tokens against chunks of 100, 250 and 350 tokens.
        let whole = f.run(&g, &[(1, 700, 700)], Mode::Chosen);
        let mut chunked = Vec::new();
        for (ctx, n) in [(100usize, 100usize), (350, 250), (700, 350)] {
            chunked.extend(f.run(&g, &[(1, ctx, n)], Mode::Chosen));
        }
        assert!(whole == chunked, "{what}: a prefill differs from its chunks");
        // The prefill's last token equals the decode of that token.
        let decode = f.run(&g, &[(1, 700, 1)], Mode::Chosen);
        assert!(
            whole[699 * q_size..] == decode[..],
            "{what}: a prefill's last row differs from its decode"
        );
    }
}

/// On compute capability 9.0 the flash kernel is compiled for sm_90a and multiplies on wgmma;
/// compiled for sm_90 it takes its mma.sync path. Both give the same bits for every kind of row
/// (decode tokens, prefill chunks against a prefix, speculative checks, a mixed batch), whole and
/// split.
#[test]
fn flash_attention_on_wgmma_gives_the_bits_of_its_mma_sync_path() {
    let Some(g) = gpu() else { return };
    let (major, minor) = g._ctx.compute_capability().unwrap();
    if (major, minor) != (9, 0) {
        // Elsewhere there is one path, compiled as it always was.
        assert_eq!(kernels::nvrtc_arch(major, minor), format!("{major}{minor}"));
        return;
    }
    assert!(kernels::ptx_of("flash_attention.cu", "90a")
        .unwrap()
        .contains("wgmma.mma_async"));
    assert!(!kernels::ptx_of("flash_attention.cu", "90").unwrap().contains("wgmma"));
    let sync = Kernels::load_for(&g._ctx, "90").expect("the kernels for sm_90");
    for (heads, kv_heads, head_dim) in [(32usize, 8usize, 128usize), (9, 3, 64), (28, 4, 128)] {
        let lens = [2100usize, 700, 300, 45, 1];
        let f = KvFixture::new(&g, heads, kv_heads, head_dim, &lens, 11);
        let what = format!("{heads}/{kv_heads}x{head_dim}");
        let batches: [&[(usize, usize, usize)]; 5] = [
            &[(0, 2100, 1)],
            &[(1, 700, 700)],
            &[(1, 700, 200)],
            &[(2, 300, 9)],
            &[(0, 2100, 1), (1, 650, 130), (2, 300, 5), (3, 45, 45), (4, 1, 1)],
        ];
        for picks in batches {
            for mode in [Mode::Whole, Mode::Split] {
                let hopper = f.run_with(&g, &g.k, picks, mode);
                let other = f.run_with(&g, &sync, picks, mode);
                assert!(hopper == other, "{what}: {picks:?} {mode:?}: wgmma and mma.sync differ");
            }
        }
    }
}

#[test]
fn embedding_and_silu_mul_match_the_reference() {
    let Some(g) = gpu() else { return };
    let (vocab, d) = (100usize, 576usize);
    let table = rounded(&values(vocab * d, 5));
    let ids = [0u32, 99, 42, 42];
    let (tab, ids_d, out) = (g.bf16s(&table), g.u32s(&ids), g.zeros_f32(ids.len() * d));
    let di = d as i32;
    g.run(
        &g.k.embedding,
        (ids.len() as u32, 1),
        THREADS,
        &[&g.p(&ids_d), &g.p(&tab), &g.p(&out), &di],
    );
    let got = g.read_f32(&out);
    for (t, &id) in ids.iter().enumerate() {
        assert_eq!(&got[t * d..][..d], &table[id as usize * d..][..d], "embedding row {id}");
    }

    // Widths of four values a piece (silu_mul4) and not (silu_mul).
    for (rows, inter) in [(3usize, 1536usize), (3, 1534)] {
        let gu = values(rows * 2 * inter, 6).iter().map(|v| v * 6.0).collect::<Vec<_>>();
        let (gu_d, act) = (g.f32s(&gu), g.zeros_bf16(rows * inter));
        silu_mul(&g.stream, &g.k, g.p(&gu_d), g.p(&act), rows, inter).unwrap();
        g.stream.synchronize().unwrap();
        let mut want = Vec::new();
        for r in 0..rows {
            for i in 0..inter {
                let (x, u) = (gu[r * 2 * inter + i] as f64, gu[r * 2 * inter + inter + i] as f64);
                want.push(x / (1.0 + (-x).exp()) * u);
            }
        }
        assert_close(&format!("silu_mul {inter}"), &g.read_bf16(&act), &want, 1e-6);
    }
}

#[test]
fn gemm_is_x_times_w_transposed() {
    let Some(g) = gpu() else { return };
    // Up to 8 rows and k a multiple of 32: the tensor-core GEMV; of 8, with small weights: the
    // CUDA-core GEMV; the others: cuBLAS.
    for (rows, n, k) in [
        (1usize, 300usize, 576usize),
        (3, 17, 4096),
        (8, 6144, 4096),
        (2, 33, 14336),
        (37, 1000, 64),
        (5, 49155, 576),
        (8, 250, 14344),
        (8, 1000, 14344),
        (1, 300, 577),
        (9, 300, 576),
    ] {
        let (x, w) = (rounded(&values(rows * k, 8)), rounded(&values(n * k, 9)));
        let (xd, wd, y) = (g.bf16s(&x), g.bf16s(&w), g.zeros_f32(rows * n));
        g.gemm
            .matmul(g.p(&xd), g.p(&wd), g.p(&y), OutType::F32, rows, n, k)
            .unwrap();
        let got = g.read_f32(&y);
        let mut want = Vec::with_capacity(rows * n);
        for r in 0..rows {
            for c in 0..n {
                want.push((0..k).map(|i| x[r * k + i] as f64 * w[c * k + i] as f64).sum::<f64>());
            }
        }
        // f32 accumulation of k products of size <= 1.
        assert_close(&format!("gemm {rows}x{n}x{k}"), &got, &want, 1e-4 * (k as f64).sqrt());
    }
}

/// cuBLASLt's algorithm is chosen once per shape and pointer alignment, then reused (the same
/// bits each time); x starting one element into its buffer (2-byte alignment) still gets a kernel
/// that reads it right.
#[test]
fn cublas_chooses_once_per_shape_and_reads_unaligned_rows() {
    let Some(g) = gpu() else { return };
    let (n, k) = (512usize, 256usize);
    let (x, w) = (rounded(&values(26 * k, 31)), rounded(&values(n * k, 32)));
    let (xd, wd) = (g.bf16s(&x), g.bf16s(&w));
    let run = |rows: usize, skip: usize| -> Vec<f32> {
        let y = g.zeros_f32(rows * n);
        let xp = g.p(&xd) + 2 * skip as u64;
        g.gemm.cublas(xp, g.p(&wd), g.p(&y), OutType::F32, rows, n, k).unwrap();
        g.read_f32(&y)
    };
    let start = g.gemm.shapes_planned();
    let first = run(24, 0);
    assert_eq!(g.gemm.shapes_planned(), start + 1);
    let again = run(24, 0);
    assert_eq!(g.gemm.shapes_planned(), start + 1, "the same shape was planned twice");
    assert!(first.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()));
    run(25, 0);
    assert_eq!(g.gemm.shapes_planned(), start + 2);
    let shifted = run(24, 1);
    assert_eq!(g.gemm.shapes_planned(), start + 3, "a 2-byte aligned x is its own plan");
    let mut want = Vec::with_capacity(24 * n);
    for r in 0..24 {
        for c in 0..n {
            want.push(
                (0..k)
                    .map(|i| x[1 + r * k + i] as f64 * w[c * k + i] as f64)
                    .sum::<f64>(),
            );
        }
    }
    assert_close("cublas, x one element in", &shifted, &want, 1e-4 * (k as f64).sqrt());
}

/// A row's product is the same bits whether it is computed alone or with up to 7 others, on
/// both GEMV kernels (one order of summation over k whatever the number of rows), and the same
/// from the o projection's form of the tensor-core GEMV.
#[test]
fn gemv_rows_are_bitwise_the_same_for_one_to_eight_rows() {
    let Some(g) = gpu() else { return };
    for (n, k) in [(6144usize, 4096usize), (960, 576), (100, 14344)] {
        let (x, w) = (rounded(&values(8 * k, 21)), rounded(&values(n * k, 22)));
        let (xd, wd) = (g.bf16s(&x), g.bf16s(&w));
        let run = |rows: usize, mma: bool| -> Vec<u32> {
            let y = g.zeros_f32(rows * n);
            if mma {
                g.gemm.gemv_mma(g.p(&xd), g.p(&wd), g.p(&y), rows, n, k).unwrap();
            } else {
                g.gemm.gemv(g.p(&xd), g.p(&wd), g.p(&y), rows, n, k).unwrap();
            }
            g.read_f32(&y).iter().map(|v| v.to_bits()).collect()
        };
        for mma in [true, false] {
            if mma && k % 32 != 0 {
                continue;
            }
            let all = run(8, mma);
            for rows in 1..8 {
                assert!(
                    run(rows, mma)[..] == all[..rows * n],
                    "{n}x{k}, mma {mma}: {rows} rows differ from the same rows among 8"
                );
            }
        }
    }

    // Grids of two or three waves of 16-column blocks (o and down on the 8B shape; q|k|v) run
    // in blocks of two or three groups: gemv_mma's bits. One and a half (two and a half) blocks
    // an SM with a last group cut short, so the last block has a group past n; exactly two an
    // SM at down's k; exactly three at a k whose segments are an odd number of rounds of 4
    // k-blocks and a tail (14 k-blocks a warp).
    let sms = g.sms();
    let grids = [
        (16 * (sms + sms / 2 + 1) - 8, 4096),
        (32 * sms, 14336),
        (16 * (2 * sms + sms / 2 + 1) - 8, 4096),
        (48 * sms, 7168),
    ];
    for (n, k) in grids {
        let (xd, wd) = (
            g.bf16s(&rounded(&values(8 * k, 23))),
            g.bf16s(&rounded(&values(n * k, 24))),
        );
        for rows in 1..=8 {
            let (a, b) = (g.zeros_f32(rows * n), g.zeros_f32(rows * n));
            g.gemv_mma_one_group(g.p(&xd), g.p(&wd), g.p(&a), rows, n, k);
            g.gemm.gemv_mma(g.p(&xd), g.p(&wd), g.p(&b), rows, n, k).unwrap();
            let bits = |y: &CudaSlice<f32>| -> Vec<u32> { g.read_f32(y).iter().map(|v| v.to_bits()).collect() };
            assert!(
                bits(&a) == bits(&b),
                "{n}x{k}, {rows} rows: blocks of several groups differ"
            );
        }
    }
}

/// The batch-invariant product: every row of `gemm_mma` (any number of rows, cut into tiles of
/// 64 or 128 rows and 128 columns) has the bits that row gets from the tensor-core GEMV alone, for k
/// split evenly and unevenly into the GEMV's 16 segments (4096: 8 k-blocks each; 576: 18
/// k-blocks; 64 and 96: two and three, most segments empty; 800: 25, an odd count that leaves
/// the last stage half full); a Gemm built invariant takes it for more than 8
/// rows, and the CUDA-core GEMV 8 rows at a time where k is not a multiple of 32. The products
/// are checked against an f64 reference too, so that two equally wrong kernels cannot pass.
#[test]
fn batch_invariant_products_give_every_row_the_bits_it_gets_alone() {
    let Some(g) = gpu() else { return };
    let invariant = Gemm::new(g.stream.clone(), &g.k, true, 1 << 25).expect("gemm");
    let bits = |y: &CudaSlice<f32>| -> Vec<u32> { g.read_f32(y).iter().map(|v| v.to_bits()).collect() };
    for (n, k, rows) in [
        (6144usize, 4096usize, 300usize),
        (960, 576, 131),
        (200, 64, 70),
        (100, 96, 70),
        (130, 800, 17),
        (130, 14336, 17),
        (49155, 576, 9),
        (300, 584, 20),
    ] {
        let (x, w) = (rounded(&values(rows * k, 51)), rounded(&values(n * k, 52)));
        let (xd, wd) = (g.bf16s(&x), g.bf16s(&w));
        let mma = k % 32 == 0;
        // Each row alone: the GEMV of one row, reading x from that row on.
        let alone: Vec<u32> = (0..rows)
            .flat_map(|r| {
                let y = g.zeros_f32(n);
                let xr = g.p(&xd) + (r * k * 2) as u64;
                match mma {
                    true => g.gemm.gemv_mma(xr, g.p(&wd), g.p(&y), 1, n, k).unwrap(),
                    false => g.gemm.gemv(xr, g.p(&wd), g.p(&y), 1, n, k).unwrap(),
                }
                bits(&y)
            })
            .collect();
        let what = format!("{rows}x{n}x{k}");
        for some in [rows, rows - 1, 9, 8, 3] {
            let y = g.zeros_f32(some * n);
            invariant
                .matmul(g.p(&xd), g.p(&wd), g.p(&y), OutType::F32, some, n, k)
                .unwrap();
            let got = bits(&y);
            if let Some(i) = (0..some * n).find(|&i| got[i] != alone[i]) {
                panic!(
                    "{what}: row {} column {} of {some} rows differs from the row alone: {} vs {}",
                    i / n,
                    i % n,
                    f32::from_bits(got[i]),
                    f32::from_bits(alone[i])
                );
            }
        }
        if mma {
            for &tile in GemmTile::available(&g.k) {
                for permuted in [false, true].into_iter().filter(|&p| !p || tile.permutes()) {
                    let y = g.zeros_f32(rows * n);
                    invariant
                        .gemm_mma_tiled(tile, permuted, g.p(&xd), g.p(&wd), g.p(&y), rows, n, k)
                        .unwrap();
                    assert!(
                        bits(&y) == alone,
                        "{what}: gemm_mma in {tile:?} blocks (x permuted first: {permuted}) differs from the rows alone"
                    );
                }
            }
        }
        let checked = rows.min(12);
        let want: Vec<f64> = (0..checked)
            .flat_map(|r| {
                let (x, w) = (&x, &w);
                (0..n).map(move |c| (0..k).map(|i| x[r * k + i] as f64 * w[c * k + i] as f64).sum::<f64>())
            })
            .collect();
        let got: Vec<f32> = alone[..checked * n].iter().map(|&b| f32::from_bits(b)).collect();
        assert_close(
            &format!("invariant product {what}"),
            &got,
            &want,
            1e-4 * (k as f64).sqrt(),
        );
    }
}

/// What the fused q|k|v tests rotate and cache with: the rope tables of a head width, eight
/// rows' positions and KV slots.
struct RopeInputs {
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    positions: CudaSlice<u32>,
    slots: CudaSlice<u32>,
}

impl RopeInputs {
    fn new(g: &Gpu, head_dim: usize) -> Self {
        let (cos, sin) = crate::runtime::cpu::rope_tables(head_dim, 10_000.0, 64);
        RopeInputs {
            cos: g.f32s(&cos),
            sin: g.f32s(&sin),
            positions: g.u32s(&[0, 1, 17, 63, 5, 9, 2, 40]),
            slots: g.u32s(&[3, 0, 15, 7, 8, 1, 12, 4]),
        }
    }

    /// `(heads, kv_heads, head_dim)`, the rope style, a bias address (0: none) and the outputs:
    /// q, the k cache and the v cache.
    fn args(
        &self,
        g: &Gpu,
        (heads, kv_heads, head_dim): (usize, usize, usize),
        halves: i32,
        bias: u64,
        [q, k_cache, v_cache]: [&CudaSlice<u16>; 3],
    ) -> gemm::RopeArgs {
        gemm::RopeArgs {
            bias,
            positions: g.p(&self.positions),
            cos: g.p(&self.cos),
            sin: g.p(&self.sin),
            heads: heads as i32,
            kv_heads: kv_heads as i32,
            head_dim: head_dim as i32,
            halves,
            slots: g.p(&self.slots),
            q: g.p(q),
            k_cache: g.p(k_cache),
            v_cache: g.p(v_cache),
        }
    }
}

/// The GEMV with its epilogue fused (SiLU on gate|up; bias, rope and the cache write on q|k|v)
/// gives the bits of the product followed by the separate kernels, for 1 to 8 rows, both rope
/// styles, with and without a bias; the rope outputs are checked against the CPU reference by
/// `rope_and_cache_rotates_queries_and_keys_and_writes_the_cache`.
#[test]
fn fused_gemv_epilogues_give_the_bits_of_the_separate_kernels() {
    let Some(g) = gpu() else { return };
    let bits = |s: &CudaSlice<u16>| -> Vec<u16> { g.stream.clone_dtoh(s).unwrap() };
    // A q|k|v whose rope grid is three waves of 8-pair groups with the last block of three cut
    // short: (heads + 2) x 4 groups of one kv head of 64, past two an SM and not a multiple of 3.
    let sms = g.sms();
    let mut wide_heads = (2 * sms + 1).div_ceil(4) - 2;
    if (wide_heads + 2) * 4 % 3 == 0 {
        wide_heads += 1;
    }
    // (hidden, heads, kv_heads, head_dim, intermediate, bias)
    for (d, heads, kv_heads, head_dim, inter, bias) in [
        (576usize, 9usize, 3usize, 64usize, 1536usize, false),
        (4096, 32, 8, 128, 14336, false),
        (896, 14, 2, 64, 4864, true),
        (576, wide_heads, 1, 64, 1536, true),
    ] {
        let (q_size, kv_size) = (heads * head_dim, kv_heads * head_dim);
        let width = q_size + 2 * kv_size;
        let x = rounded(&values(8 * d, 41));
        let (w_qkv, w_gu) = (rounded(&values(width * d, 42)), rounded(&values(2 * inter * d, 43)));
        let (xd, qkv_d, gu_d) = (g.bf16s(&x), g.bf16s(&w_qkv), g.bf16s(&w_gu));
        let bias_d = g.f32s(&values(width, 44));
        let rope = RopeInputs::new(&g, head_dim);
        for rows in 1..=8usize {
            let tag = format!("d={d} heads={heads}/{kv_heads}x{head_dim} bias={bias} rows={rows}");
            // SiLU(gate) * up.
            let (fused, gate_up, apart) = (
                g.zeros_bf16(rows * inter),
                g.zeros_f32(rows * 2 * inter),
                g.zeros_bf16(rows * inter),
            );
            g.gemm
                .gemv_silu(g.p(&xd), g.p(&gu_d), g.p(&fused), rows, inter, d)
                .unwrap();
            g.gemm
                .gemv_mma(g.p(&xd), g.p(&gu_d), g.p(&gate_up), rows, 2 * inter, d)
                .unwrap();
            silu_mul(&g.stream, &g.k, g.p(&gate_up), g.p(&apart), rows, inter).unwrap();
            assert!(bits(&fused) == bits(&apart), "gate|up with SiLU, {tag}");
            // q|k|v, rotated and cached.
            for halves in [0i32, 1] {
                let outputs = || {
                    (
                        g.zeros_bf16(rows * q_size),
                        g.zeros_bf16(16 * kv_size),
                        g.zeros_bf16(16 * kv_size),
                    )
                };
                let bias_p = if bias { g.p(&bias_d) } else { 0 };
                let shape = (heads, kv_heads, head_dim);
                let args = |q: &CudaSlice<u16>, kc: &CudaSlice<u16>, vc: &CudaSlice<u16>| {
                    rope.args(&g, shape, halves, bias_p, [q, kc, vc])
                };
                let (q1, k1, v1) = outputs();
                g.gemm
                    .gemv_rope(g.p(&xd), g.p(&qkv_d), rows, d, &args(&q1, &k1, &v1), None)
                    .unwrap();
                let (q2, k2, v2) = outputs();
                let a = args(&q2, &k2, &v2);
                let qkv = g.zeros_f32(rows * width);
                g.gemm
                    .gemv_mma(g.p(&xd), g.p(&qkv_d), g.p(&qkv), rows, width, d)
                    .unwrap();
                let w32 = width as i32;
                if bias {
                    g.run(
                        &g.k.add_bias,
                        (rows as u32, 1),
                        ROW_THREADS,
                        &[&g.p(&qkv), &a.bias, &w32],
                    );
                }
                let qkv_p = g.p(&qkv);
                let mut rope_args: Vec<&dyn Arg> = vec![&qkv_p, &w32];
                rope_args.extend(a.kernel_args());
                g.run(&g.k.rope_and_cache, (rows as u32, 1), ROW_THREADS, &rope_args);
                for (what, got, want) in [("q", &q1, &q2), ("k cache", &k1, &k2), ("v cache", &v1, &v2)] {
                    assert!(
                        bits(got) == bits(want),
                        "q|k|v with rope, {what}, halves={halves}, {tag}"
                    );
                }
                assert!(bits(&k1).iter().any(|&b| b != 0), "the cache was written, {tag}");
            }
        }
    }
}

/// The GEMV adding its product into y (the down projection into the residual stream) gives the
/// bits of the product written apart and then added, in each of its forms: one group a block,
/// two, and three walked in turn (grids of one, two and three waves).
#[test]
fn gemv_adding_into_y_gives_the_bits_of_the_product_then_the_sum() {
    let Some(g) = gpu() else { return };
    let sms = g.sms();
    let k = 576usize;
    for n in [200usize, 16 * (2 * sms) - 8, 16 * (3 * sms) - 8] {
        let x = rounded(&values(8 * k, 61));
        let (xd, wd) = (g.bf16s(&x), g.bf16s(&rounded(&values(n * k, 62))));
        for rows in 1..=8usize {
            let y0 = values(rows * n, 63);
            let (apart, sum) = (g.zeros_f32(rows * n), g.f32s(&y0));
            g.gemm.gemv_mma(g.p(&xd), g.p(&wd), g.p(&apart), rows, n, k).unwrap();
            g.gemm.gemv_mma_add(g.p(&xd), g.p(&wd), g.p(&sum), rows, n, k).unwrap();
            let want: Vec<u32> = g
                .read_f32(&apart)
                .iter()
                .zip(&y0)
                .map(|(p, y)| (y + p).to_bits())
                .collect();
            let got: Vec<u32> = g.read_f32(&sum).iter().map(|v| v.to_bits()).collect();
            assert!(got == want, "n={n} rows={rows}");
        }
    }
}

/// A product adding its branch into the stream, then q|k|v making its x as the stream's RMS
/// norm in shared memory (the step's down projection and the next block's attention norm on one
/// GPU), give the bits of the branch written apart, `add_rms_norm` (which adds it and writes the
/// stream back), and the q|k|v product reading the norm's output: for 1 to 8 rows, in blocks of
/// one group and of three, where the given x (zeros) is never read.
#[test]
fn qkv_making_the_streams_norm_gives_the_bits_of_the_norm_kernel() {
    let Some(g) = gpu() else { return };
    let bits = |s: &CudaSlice<u16>| -> Vec<u16> { g.stream.clone_dtoh(s).unwrap() };
    let eps = 1e-5f32;
    // (hidden, heads, kv_heads, head_dim): q|k|v in blocks of one group, three, and one.
    for (d, heads, kv_heads, head_dim) in [
        (576usize, 9usize, 3usize, 64usize),
        (4096, 32, 8, 128),
        (896, 14, 2, 64),
    ] {
        let (q_size, kv_size) = (heads * head_dim, kv_heads * head_dim);
        let width = q_size + 2 * kv_size;
        // The branch's product (the down projection's part), here of q_size inputs.
        let h = g.bf16s(&rounded(&values(8 * q_size, 71)));
        let w_down = g.bf16s(&rounded(&values(d * q_size, 72)));
        let stream0 = values(8 * d, 73);
        let norm_w = g.f32s(&values(d, 74));
        let w_qkv = g.bf16s(&rounded(&values(width * d, 75)));
        let rope = RopeInputs::new(&g, head_dim);
        let unread = g.zeros_bf16(8 * d);
        for rows in 1..=8usize {
            let tag = format!("d={d} rows={rows}");
            let (x_apart, branch, normed) = (
                g.f32s(&stream0[..rows * d]),
                g.zeros_f32(rows * d),
                g.zeros_bf16(rows * d),
            );
            g.gemm
                .gemv_mma(g.p(&h), g.p(&w_down), g.p(&branch), rows, d, q_size)
                .unwrap();
            let (one, di) = (1i32, d as i32);
            g.run(
                &g.k.add_rms_norm,
                (rows as u32, 1),
                ROW_THREADS,
                &[
                    &g.p(&x_apart),
                    &g.p(&branch),
                    &0u64,
                    &one,
                    &g.p(&norm_w),
                    &g.p(&normed),
                    &di,
                    &eps,
                ],
            );
            let x_fused = g.f32s(&stream0[..rows * d]);
            g.gemm
                .gemv_mma_add(g.p(&h), g.p(&w_down), g.p(&x_fused), rows, d, q_size)
                .unwrap();
            let f32_bits = |s: &CudaSlice<f32>| -> Vec<u32> { g.read_f32(s).iter().map(|v| v.to_bits()).collect() };
            assert!(f32_bits(&x_fused) == f32_bits(&x_apart), "the stream, {tag}");
            let norm = gemm::StreamNorm {
                stream: g.p(&x_fused),
                weight: g.p(&norm_w),
                eps,
            };

            let outputs = || {
                (
                    g.zeros_bf16(rows * q_size),
                    g.zeros_bf16(16 * kv_size),
                    g.zeros_bf16(16 * kv_size),
                )
            };
            let shape = (heads, kv_heads, head_dim);
            let args =
                |q: &CudaSlice<u16>, kc: &CudaSlice<u16>, vc: &CudaSlice<u16>| rope.args(&g, shape, 1, 0, [q, kc, vc]);
            let ((q1, k1, v1), (q2, k2, v2)) = (outputs(), outputs());
            g.gemm
                .gemv_rope(g.p(&unread), g.p(&w_qkv), rows, d, &args(&q1, &k1, &v1), Some(&norm))
                .unwrap();
            g.gemm
                .gemv_rope(g.p(&normed), g.p(&w_qkv), rows, d, &args(&q2, &k2, &v2), None)
                .unwrap();
            for (what, got, want) in [("q", &q1, &q2), ("k cache", &k1, &k2), ("v cache", &v1, &v2)] {
                assert!(bits(got) == bits(want), "q|k|v with rope, {what}, {tag}");
            }
            assert!(bits(&q1).iter().any(|&b| b != 0), "q was written, {tag}");
        }
    }
}

#[test]
fn shaping_contrasts_masks_and_biases_the_listed_rows_and_argmax_picks_the_first_best() {
    let Some(g) = gpu() else { return };
    let vocab = 49155usize; // not a multiple of 32: the last word is partial
    let words = vocab.div_ceil(32);
    let rows = 4;
    let mut logits = values(rows * vocab, 12);
    // Ties: row 1's best value at two places; the lower index must win.
    logits[vocab + 40000] = 5.0;
    logits[vocab + 30000] = 5.0;
    let bits_of =
        |seed: u64, flip: u32| -> Vec<u32> { values(2 * words, seed).iter().map(|v| v.to_bits() ^ flip).collect() };
    let (masks, bias_masks) = (bits_of(13, 0x5555_5555), bits_of(14, 0x3333_3333));
    // Row 0: a mask and the copy bias; row 1: nothing (not listed); row 2: a mask, contrasted
    // with row 3, its twin.
    let listed = [0u32, 2];
    let twins = [-1i32, -1, 3, -1];
    let (one_plus, weight) = ([0f32, 0.0, 1.5, 0.0], [0f32, 0.0, 0.5, 0.0]);
    let (mask_rows, bias_rows) = ([1i32, -1, 0, -1], [0i32, -1, -1, -1]);
    let bias = [0.75f32, 0.0, 0.0, 0.0];
    let ld = g.f32s(&logits);
    let (v, wds) = (vocab as i32, words as i32);
    let (lr, tw, op, wt) = (g.u32s(&listed), g.i32s(&twins), g.f32s(&one_plus), g.f32s(&weight));
    let (md, mr, bd, br, bv) = (
        g.u32s(&masks),
        g.i32s(&mask_rows),
        g.u32s(&bias_masks),
        g.i32s(&bias_rows),
        g.f32s(&bias),
    );
    // The masked rows' shaped scores are kept aside as well, for a pipelined draw's redraw.
    let kept = g.zeros_f32(rows * vocab);
    g.run(
        &g.k.shape_scores,
        (listed.len() as u32, (vocab as u32).div_ceil(THREADS * 8)),
        THREADS,
        &[
            &g.p(&ld),
            &g.p(&lr),
            &g.p(&tw),
            &g.p(&op),
            &g.p(&wt),
            &g.p(&md),
            &g.p(&mr),
            &g.p(&bd),
            &g.p(&br),
            &g.p(&bv),
            &v,
            &wds,
            &g.p(&kept),
        ],
    );
    let got = g.read_f32(&ld);
    let kept = g.read_f32(&kept);
    for r in 0..rows {
        let (row, aside) = (&got[r * vocab..][..vocab], &kept[r * vocab..][..vocab]);
        match mask_rows[r] >= 0 {
            true => assert!(
                row.iter().zip(aside).all(|(a, b)| a.to_bits() == b.to_bits()),
                "row {r}'s shaped scores kept"
            ),
            false => assert!(aside.iter().all(|&x| x == 0.0), "row {r} has no mask: nothing kept"),
        }
    }
    let allows = |m: &[u32], row: i32, t: usize| m[row as usize * words + t / 32] >> (t % 32) & 1 == 1;
    for r in 0..rows {
        let mut want = logits[r * vocab..][..vocab].to_vec();
        if twins[r] >= 0 {
            let twin = &logits[twins[r] as usize * vocab..][..vocab];
            want = crate::engine::contrast::contrast(&want, twin, weight[r]);
        }
        for (t, x) in want.iter_mut().enumerate() {
            if mask_rows[r] >= 0 && !allows(&masks, mask_rows[r], t) {
                *x = f32::NEG_INFINITY;
            } else if bias_rows[r] >= 0 && allows(&bias_masks, bias_rows[r], t) {
                *x += bias[r];
            }
        }
        for t in 0..vocab {
            assert_eq!(got[r * vocab + t].to_bits(), want[t].to_bits(), "row {r} token {t}");
        }
    }
    assert!(
        got[..vocab].iter().any(|x| x.is_infinite()),
        "row 0's mask refuses some tokens"
    );
    // Greedy draws for rows 0 to 2; row 3's slot is left alone.
    let out = g.u32s(&[7; 4]);
    let greedy = g.u32s(&[0, 1, 2]);
    g.run(&g.k.argmax, (3, 1), 1024, &[&g.p(&ld), &g.p(&greedy), &v, &g.p(&out)]);
    let ids: Vec<u32> = g.stream.clone_dtoh(&out).unwrap();
    for r in 0..3 {
        let row = &got[r * vocab..][..vocab];
        assert_eq!(ids[r], crate::sampling::argmax(row), "row {r}");
    }
    assert_eq!(ids[1], 30000, "ties go to the lowest index");
    assert_eq!(ids[3], 7, "an unlisted row's slot is not written");
}

#[test]
fn dummy_weights_are_deterministic_and_bounded() {
    let Some(g) = gpu() else { return };
    let n = 100_003u64;
    let fill = |seed: u64| {
        let out = g.zeros_bf16(n as usize);
        let scale = 0.5f32;
        g.run(
            &g.k.fill_uniform_bf16,
            (64, 1),
            THREADS,
            &[&g.p(&out), &n, &seed, &scale],
        );
        g.read_bf16(&out)
    };
    let (a, b, c) = (fill(1), fill(1), fill(2));
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert!(a.iter().all(|v| v.abs() <= 0.5));
    let mean = a.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
    assert!(mean.abs() < 0.01, "mean {mean}");
}

#[test]
fn philox_matches_the_random123_known_answers() {
    let Some(g) = gpu() else { return };
    // Random123's kat_vectors for philox4x32_10: counter and key all zeros, and all ones.
    for (input, want) in [
        ([0u32; 6], [0x6627e8d5u32, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]),
        ([u32::MAX; 6], [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]),
    ] {
        let (inp, out) = (g.u32s(&input), g.u32s(&[0; 4]));
        g.run(&g.k.philox_raw, (1, 1), 1, &[&g.p(&inp), &g.p(&out)]);
        let got: Vec<u32> = g.stream.clone_dtoh(&out).unwrap();
        assert_eq!(got, want);
    }
}

/// The CPU sampler's filters (temperature, min-p, top-k, top-p over tokens sorted by weight),
/// as normalized probabilities: what the kernel's draws must follow.
fn reference_distribution(logits: &[f32], p: &kernels::SampleParams) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut cands: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &s)| (i, (((s - max) / p.temperature) as f64).exp()))
        .filter(|&(_, w)| w > 0.0 && w >= p.min_p as f64)
        .collect();
    cands.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        cands.truncate(p.top_k as usize);
    }
    if p.top_p < 1.0 {
        let total: f64 = cands.iter().map(|c| c.1).sum();
        let mut cum = 0.0;
        let keep = cands
            .iter()
            .position(|c| {
                cum += c.1;
                cum >= p.top_p as f64 * total
            })
            .map_or(cands.len(), |i| i + 1);
        cands.truncate(keep);
    }
    let total: f64 = cands.iter().map(|c| c.1).sum();
    let mut dist = vec![0.0; logits.len()];
    for (i, w) in cands {
        dist[i] = w / total;
    }
    dist
}

#[test]
fn seeded_sampling_follows_the_filtered_distribution_and_depends_only_on_seed_and_counter() {
    let Some(g) = gpu() else { return };
    let vocab = 100usize;
    let mut logits: Vec<f32> = values(vocab, 21).iter().map(|v| v * 3.0).collect();
    for t in [3, 50, 77] {
        logits[t] = f32::NEG_INFINITY; // masked
    }
    let draws = 20_000usize;
    let cases = [
        (0.7f32, 0i32, 1.0f32, 0.0f32),
        (1.0, 10, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (1.3, 20, 0.9, 0.05),
    ];
    for (temperature, top_k, top_p, min_p) in cases {
        let params: Vec<kernels::SampleParams> = (0..draws as u64)
            .map(|counter| kernels::SampleParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: 42,
                counter,
            })
            .collect();
        let rows: Vec<f32> = (0..draws).flat_map(|_| logits.iter().cloned()).collect();
        let (ld, pd, out) = (
            g.f32s(&rows),
            g.stream.clone_htod(&params).unwrap(),
            g.u32s(&vec![0; draws]),
        );
        let v = vocab as i32;
        g.run(
            &g.k.sample_rows,
            (draws as u32, 1),
            1024,
            &[&g.p(&ld), &0u64, &v, &g.p(&pd), &g.p(&out)],
        );
        let tokens: Vec<u32> = g.stream.clone_dtoh(&out).unwrap();
        let want = reference_distribution(&logits, &params[0]);
        let mut seen = vec![0usize; vocab];
        for &t in &tokens {
            seen[t as usize] += 1;
        }
        for t in 0..vocab {
            let (freq, p) = (seen[t] as f64 / draws as f64, want[t]);
            if p == 0.0 {
                assert_eq!(
                    seen[t], 0,
                    "token {t} is filtered out but was drawn ({temperature}, {top_k}, {top_p}, {min_p})"
                );
            } else {
                let sigma = (p * (1.0 - p) / draws as f64).sqrt();
                assert!(
                    (freq - p).abs() <= 5.0 * sigma + 1e-3,
                    "token {t}: drawn {freq:.4}, expected {p:.4} ({temperature}, {top_k}, {top_p}, {min_p})"
                );
            }
        }

        // The same (seed, counter) draws the same token wherever its row sits in the batch.
        let reversed: Vec<kernels::SampleParams> = params.iter().rev().cloned().collect();
        let (pd2, out2) = (g.stream.clone_htod(&reversed).unwrap(), g.u32s(&vec![0; draws]));
        g.run(
            &g.k.sample_rows,
            (draws as u32, 1),
            1024,
            &[&g.p(&ld), &0u64, &v, &g.p(&pd2), &g.p(&out2)],
        );
        let mut again: Vec<u32> = g.stream.clone_dtoh(&out2).unwrap();
        again.reverse();
        assert_eq!(again, tokens);
    }
}

/// Random bf16 values in [-1, 1) on the device (no zeros: they run faster than real data).
fn random_bf16(g: &Gpu, n: usize, seed: u64) -> CudaSlice<u16> {
    let out: CudaSlice<u16> = g.stream.alloc_zeros(n).unwrap();
    let (n64, scale) = (n as u64, 1.0f32);
    g.run(
        &g.k.fill_uniform_bf16,
        (1024, 1),
        THREADS,
        &[&g.p(&out), &n64, &seed, &scale],
    );
    out
}

/// Milliseconds of one call of `f`: the median over `reps` timings (CUDA events) of 10 calls
/// back to back, after two warm-ups; `f` gets the call's index (to rotate its inputs). The 10
/// calls are captured once as a graph and each timing replays it, as a step's kernels run
/// (METHOD.md: many small launches are timed by a graph's replays, which shrink the launch gaps);
/// `QUARRY_BENCH_LAUNCH=stream` queues them as separate launches instead, the way this table was
/// timed before. Each timing starts behind a fill of 256 MB, so that the calls are queued before
/// the first starts: the time is the GPU's, without the host's latency to launch the first call.
fn median_ms(g: &Gpu, reps: usize, f: &dyn Fn(usize)) -> f64 {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    const CALLS: usize = 10;
    let ctx = g.stream.context().clone();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let gate: CudaSlice<u16> = g.stream.alloc_zeros(128 << 20).unwrap();
    let (gate_n, seed, scale) = (128u64 << 20, 1u64, 1.0f32);
    f(0);
    f(1);
    let graph = (std::env::var("QUARRY_BENCH_LAUNCH").as_deref() != Ok("stream")).then(|| {
        g.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        for c in 0..CALLS {
            f(c);
        }
        let graph = g
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("a graph");
        graph.upload().unwrap();
        graph.launch().unwrap();
        graph
    });
    let mut times: Vec<f64> = (0..reps)
        .map(|i| {
            let (a, b) = (ctx.new_event(flags).unwrap(), ctx.new_event(flags).unwrap());
            let gate_args: [&dyn Arg; 4] = [&g.p(&gate), &gate_n, &seed, &scale];
            launch(&g.stream, &g.k.fill_uniform_bf16, (1024, 1), THREADS, &gate_args).unwrap();
            a.record(&g.stream).unwrap();
            match &graph {
                Some(graph) => graph.launch().unwrap(),
                None => (0..CALLS).for_each(|c| f(i * CALLS + c)),
            }
            b.record(&g.stream).unwrap();
            g.stream.synchronize().unwrap();
            a.elapsed_ms(&b).unwrap() as f64 / CALLS as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

/// Not a test: the kernels' speed on the Llama-3.1-8B shape against the card's limits, printed
/// as a table (`test-quarry kernel_speeds --ignored --nocapture`; scripts/bench-gpu runs it).
/// QUARRY_BENCH_BANDWIDTH (GB/s) and QUARRY_BENCH_MATMUL (TFLOP/s), measured in the same call,
/// give the percentages. Random data throughout; weights rotate among copies larger than L2.
#[test]
#[ignore]
fn kernel_speeds() {
    let Some(g) = gpu() else { return };
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<f64>().ok());
    let (bw, mm) = (env("QUARRY_BENCH_BANDWIDTH"), env("QUARRY_BENCH_MATMUL"));
    let pct = |v: f64, of: Option<f64>| of.map_or("-".to_string(), |o| format!("{:.0}%", 100.0 * v / o));
    println!("{:<44}{:>10}{:>12}{:>10}", "kernel", "ms", "rate", "of limit");

    // Attention, 8B shape: 32 heads, 8 KV heads of 128.
    let (heads, kv_heads, hd) = (32usize, 8usize, 128usize);
    let (q_size, kv_size) = (heads * hd, kv_heads * hd);
    let attn = |name: &str, picks: Vec<(usize, usize)>, flops: bool| {
        // picks: (context length, query tokens), each its own sequence.
        let blocks: usize = picks.iter().map(|p| p.0.div_ceil(BLOCK_SIZE)).sum();
        let (kc, vc) = (
            random_bf16(&g, blocks * BLOCK_SIZE * kv_size, 1),
            random_bf16(&g, blocks * BLOCK_SIZE * kv_size, 2),
        );
        let mut batch = ForwardBatch::default();
        let mut next = 0u32;
        for &(ctx, n) in &picks {
            let table: Vec<u32> = (next..next + ctx.div_ceil(BLOCK_SIZE) as u32).collect();
            next += table.len() as u32;
            batch.push_sequence(&vec![0; n], ctx - n, &table, BLOCK_SIZE);
        }
        let d = DeviceBatch::new(&g, &batch, heads / kv_heads);
        let (tokens, max_len) = (d.tokens, d.max_len);
        let q = random_bf16(&g, tokens * q_size, 3);
        let out = g.zeros_bf16(tokens * q_size);
        let partials = g.zeros_f32(attention::SCRATCH_FLOATS);
        let plan = d.plan(&g, hd, heads, kv_heads, 4 * g.sms());
        let args = d.args(&g, [g.p(&q), g.p(&out), g.p(&kc), g.p(&vc)], heads, kv_heads, hd);
        let ms = median_ms(&g, 10, &|_| {
            attention::launch(&g.stream, &g.k, &args, plan, tokens, max_len, g.p(&partials)).unwrap()
        });
        let mode = match plan {
            attention::Plan::Flash { split: Some(s), .. } => format!("split {}", s.parts),
            attention::Plan::Flash { .. } => "whole".into(),
            _ => "general".into(),
        };
        if flops {
            // The causal half: each query row against the keys up to its position.
            let pairs: f64 = picks
                .iter()
                .map(|&(ctx, n)| (ctx - n..ctx).map(|p| (p + 1) as f64).sum::<f64>())
                .sum();
            let tf = 4.0 * pairs * heads as f64 * hd as f64 / ms / 1e9;
            println!(
                "{:<44}{ms:>10.3}{:>12}{:>10}",
                format!("{name} ({mode})"),
                format!("{tf:.0} TF/s"),
                pct(tf, mm)
            );
        } else {
            let bytes: f64 = picks.iter().map(|p| (p.0 * kv_size * 4) as f64).sum();
            let gbs = bytes / ms / 1e6;
            println!(
                "{:<44}{ms:>10.3}{:>12}{:>10}",
                format!("{name} ({mode})"),
                format!("{gbs:.0} GB/s"),
                pct(gbs, bw)
            );
        }
    };
    attn("attention decode, 64 x 2k context", vec![(2048, 1); 64], false);
    attn("attention decode, 1 x 16k context", vec![(16384, 1)], false);
    attn("attention decode, 1 x 576 context", vec![(576, 1)], false);
    attn("attention prefill, 1 x 4k", vec![(4096, 4096)], true);
    attn(
        "attention prefill, 16k chunk of 2k at the end",
        vec![(16384, 2048)],
        true,
    );
    attn("attention prefill, 8 x 512", vec![(512, 512); 8], true);

    // Projections of the 8B shape, 1 to 8 rows: the GEMV kernel and cuBLAS.
    let shapes = [
        ("qkv", 6144usize, 4096usize),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
        ("head", 128256, 4096),
    ];
    for (name, n, k) in shapes {
        // Enough copies that each run reads weights L2 does not hold.
        let copies = (256usize << 20).div_ceil(n * k * 2).clamp(1, 8);
        let ws: Vec<CudaSlice<u16>> = (0..copies).map(|i| random_bf16(&g, n * k, 10 + i as u64)).collect();
        let x = random_bf16(&g, 8 * k, 4);
        let y = g.zeros_f32(8 * n);
        for rows in [1usize, 2, 4, 8] {
            let (xp, yp) = (g.p(&x), g.p(&y));
            let bytes = (n * k * 2) as f64;
            // o and down take blocks of two groups, q|k|v of three; the row of one group a block
            // beside them.
            let several = matches!(name, "o" | "down" | "qkv").then_some("gemv_mma one group a block");
            for path in ["gemv_mma", "gemv", "cublas"].into_iter().chain(several) {
                let ms = median_ms(&g, 20, &|i| {
                    let wp = g.p(&ws[i % copies]);
                    match path {
                        "gemv_mma" => g.gemm.gemv_mma(xp, wp, yp, rows, n, k).unwrap(),
                        "gemv" => g.gemm.gemv(xp, wp, yp, rows, n, k).unwrap(),
                        "gemv_mma one group a block" => g.gemv_mma_one_group(xp, wp, yp, rows, n, k),
                        _ => g.gemm.cublas(xp, wp, yp, OutType::F32, rows, n, k).unwrap(),
                    }
                });
                let gbs = bytes / ms / 1e6;
                println!(
                    "{:<44}{ms:>10.4}{:>12}{:>10}",
                    format!("{path} 8B {name} {n}x{k}, {rows} rows"),
                    format!("{gbs:.0} GB/s"),
                    pct(gbs, bw)
                );
            }
        }
    }

    // What a GEMV launch costs besides its weights: o's grid (256 groups of 16 columns, one wave
    // of blocks of two) over one k-block of 32, back to back as above. The gap between o's time
    // and its weights at the copy rate is about this, whatever the kernel does with them.
    let (n, k) = (4096usize, 32usize);
    let (w, x, y) = (
        random_bf16(&g, n * k, 30),
        random_bf16(&g, 8 * k, 31),
        g.zeros_f32(8 * n),
    );
    for rows in [1usize, 8] {
        let ms = median_ms(&g, 20, &|_| {
            g.gemm.gemv_mma(g.p(&x), g.p(&w), g.p(&y), rows, n, k).unwrap()
        });
        println!(
            "{:<44}{ms:>10.4}",
            format!("gemv_mma o's grid over k = 32, {rows} rows")
        );
    }

    // Products of many rows: cuBLAS against the batch-invariant product in both tiles.
    let invariant = Gemm::new(g.stream.clone(), &g.k, true, 1 << 25).expect("gemm");
    for (name, n, k) in &shapes[..4] {
        let (n, k) = (*n, *k);
        let w = random_bf16(&g, n * k, 10);
        for rows in [16usize, 64, 256, 2048] {
            let x = random_bf16(&g, rows * k, 4);
            let y = g.zeros_f32(rows * n);
            let (xp, wp, yp) = (g.p(&x), g.p(&w), g.p(&y));
            let flops = 2.0 * (rows * n * k) as f64;
            // cuBLAS (None), each tile (x as it is, then permuted first where the tile can), then
            // the tile `gemm_mma` chooses.
            let tiles = GemmTile::available(&g.k)
                .iter()
                .flat_map(|&t| [(t, false), (t, true)])
                .filter(|&(t, p)| !p || t.permutes())
                .map(Some);
            for path in std::iter::once(None).chain(tiles.map(Some)).chain([Some(None)]) {
                let ms = median_ms(&g, 10, &|_| match path {
                    None => g.gemm.cublas(xp, wp, yp, OutType::F32, rows, n, k).unwrap(),
                    Some(Some((tile, p))) => invariant.gemm_mma_tiled(tile, p, xp, wp, yp, rows, n, k).unwrap(),
                    Some(None) => invariant.gemm_mma(xp, wp, yp, rows, n, k).unwrap(),
                });
                let path = match path {
                    None => "cublas".to_string(),
                    Some(Some((tile, false))) => format!("gemm {tile:?}"),
                    Some(Some((tile, true))) => format!("gemm {tile:?} permuted"),
                    Some(None) => "gemm chosen".to_string(),
                };
                let tfs = flops / ms / 1e9;
                println!(
                    "{:<44}{ms:>10.4}{:>12}{:>10}",
                    format!("{path} 8B {name}, {rows} rows"),
                    format!("{tfs:.0} TF/s"),
                    pct(tfs, mm)
                );
            }
        }
    }
}
