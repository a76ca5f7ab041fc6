//! Every kernel against a plain CPU reference, on shapes that hit the edges (one token, block
//! boundaries, a context of thousands, a vocabulary that is not a multiple of 32, rows with and
//! without masks). Skipped, with a message, where there is no GPU.

use half::bf16;

use super::*;

struct Gpu {
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: Kernels,
    gemm: Gemm,
}

fn gpu() -> Option<Gpu> {
    if let Err(why) = crate::runtime::device::cuda_devices() {
        eprintln!("skipping: {why}");
        return None;
    }
    let ctx = CudaContext::new(0).expect("context");
    // SAFETY: one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.default_stream();
    let k = Kernels::load(&ctx).expect("kernels compile");
    let gemm = Gemm::new(stream.clone(), k.gemv_bf16.clone()).expect("cublas");
    Some(Gpu {
        _ctx: ctx,
        stream,
        k,
        gemm,
    })
}

impl Gpu {
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
    for d in [576usize, 1000, 4096] {
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
fn rope_rotates_adjacent_pairs_and_halves() {
    let Some(g) = gpu() else { return };
    let (head_dim, heads, theta, max_pos) = (64usize, 5usize, 10_000f32, 4096usize);
    let (cos, sin) = crate::runtime::cpu::rope_tables(head_dim, theta, max_pos);
    let (cos_d, sin_d) = (g.f32s(&cos), g.f32s(&sin));
    let width = heads * head_dim + 7; // trailing columns (v) must not move
    let positions = [0u32, 1, 15, 16, 4095];
    let rows = values(positions.len() * width, 4);
    for halves in [0i32, 1] {
        let qkv = g.f32s(&rows);
        let pos = g.u32s(&positions);
        let (w, h, hd) = (width as i32, heads as i32, head_dim as i32);
        g.run(
            &g.k.rope,
            (positions.len() as u32, 1),
            ROW_THREADS,
            &[&g.p(&qkv), &g.p(&pos), &g.p(&cos_d), &g.p(&sin_d), &w, &h, &hd, &halves],
        );
        let got = g.read_f32(&qkv);
        let mut want: Vec<f64> = rows.iter().map(|&v| v as f64).collect();
        for (t, &p) in positions.iter().enumerate() {
            for hi in 0..heads {
                let base = t * width + hi * head_dim;
                for j in 0..head_dim / 2 {
                    let angle = p as f64 * (theta as f64).powf(-2.0 * j as f64 / head_dim as f64);
                    let (a, b) = if halves == 1 {
                        (j, j + head_dim / 2)
                    } else {
                        (2 * j, 2 * j + 1)
                    };
                    let (x0, x1) = (rows[base + a] as f64, rows[base + b] as f64);
                    want[base + a] = x0 * angle.cos() - x1 * angle.sin();
                    want[base + b] = x0 * angle.sin() + x1 * angle.cos();
                }
            }
        }
        // f32 angles at position 4095 carry ~1e-4 of error; the rest is exact arithmetic.
        let err = got
            .iter()
            .zip(&want)
            .map(|(&a, &b)| (a as f64 - b).abs())
            .fold(0.0, f64::max);
        assert!(err < 2e-3, "rope (halves={halves}): max error {err}");
        for t in 0..positions.len() {
            for c in heads * head_dim..width {
                assert_eq!(got[t * width + c], rows[t * width + c], "column {c} is not rotated");
            }
        }
    }
}

/// A batch of three sequences in one flattened pass: a decode token at the end of a 3,000-token
/// context, a prefill chunk that crosses a block boundary, and a lone first token; block tables
/// scattered over the pool. Keys and values reach the cache through the cache-write kernel.
#[test]
fn paged_attention_matches_the_reference_over_a_mixed_batch() {
    let Some(g) = gpu() else { return };
    // 36: a head that is not a multiple of 8 takes the scalar path.
    for (heads, kv_heads, head_dim) in [(9usize, 3usize, 64usize), (8, 8, 128), (28, 4, 128), (4, 2, 36)] {
        let q_size = heads * head_dim;
        let kv_size = kv_heads * head_dim;
        let width = q_size + 2 * kv_size;
        let block = BLOCK_SIZE;
        let contexts = [3000usize, 28, 1];
        let queries = [1usize, 18, 1]; // the last `queries[s]` positions of each context
                                       // Block tables: sequences take blocks from a shuffled pool.
        let total_blocks: usize = contexts.iter().map(|c| c.div_ceil(block)).sum::<usize>() + 5;
        let mut pool: Vec<u32> = (0..total_blocks as u32).collect();
        let mut seed = 7u64;
        for i in (1..pool.len()).rev() {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            pool.swap(i, (seed >> 33) as usize % (i + 1));
        }
        let mut tables = Vec::new();
        let mut next = 0;
        for &c in &contexts {
            tables.push(pool[next..next + c.div_ceil(block)].to_vec());
            next += c.div_ceil(block);
        }
        // Write every position's k and v (one row per position of every sequence).
        let all_rows: usize = contexts.iter().sum();
        let qkv_all = values(all_rows * width, 11);
        let mut slots = Vec::new();
        for (s, &c) in contexts.iter().enumerate() {
            for p in 0..c {
                slots.push(tables[s][p / block] * block as u32 + (p % block) as u32);
            }
        }
        let num_slots = total_blocks * block;
        let (kc, vc) = (g.zeros_bf16(num_slots * kv_size), g.zeros_bf16(num_slots * kv_size));
        let (qkv_d, slots_d) = (g.f32s(&qkv_all), g.u32s(&slots));
        let (w, qs, vo, ks) = (width as i32, q_size as i32, (q_size + kv_size) as i32, kv_size as i32);
        g.run(
            &g.k.reshape_and_cache,
            (all_rows as u32, 1),
            ROW_THREADS,
            &[&g.p(&qkv_d), &w, &qs, &vo, &ks, &g.p(&slots_d), &g.p(&kc), &g.p(&vc)],
        );
        // The cache holds each row's k and v, rounded to bf16, at its slot.
        let k_cache = g.read_bf16(&kc);
        for (r, &slot) in slots.iter().enumerate().step_by(97) {
            let want = rounded(&qkv_all[r * width + q_size..][..kv_size]);
            assert_eq!(
                &k_cache[slot as usize * kv_size..][..kv_size],
                &want[..],
                "k of row {r}"
            );
        }

        // The queries: rows of the positions asked for.
        let mut q_rows = Vec::new();
        let (mut token_seq, mut positions) = (Vec::new(), Vec::new());
        let mut row_start = 0;
        for (s, (&c, &n)) in contexts.iter().zip(&queries).enumerate() {
            for p in c - n..c {
                q_rows.extend_from_slice(&qkv_all[(row_start + p) * width..][..width]);
                token_seq.push(s as u32);
                positions.push(p as u32);
            }
            row_start += c;
        }
        let tokens = positions.len();
        let max_blocks = tables.iter().map(Vec::len).max().unwrap();
        let mut flat = vec![0u32; tables.len() * max_blocks];
        for (s, t) in tables.iter().enumerate() {
            flat[s * max_blocks..][..t.len()].copy_from_slice(t);
        }
        let (q_d, seq_d, pos_d, tab_d) = (g.f32s(&q_rows), g.u32s(&token_seq), g.u32s(&positions), g.u32s(&flat));
        let scale = 1.0 / (head_dim as f32).sqrt();
        let max_len = *contexts.iter().max().unwrap();
        // Whole (one partition), split as the backend would for these tokens, and in small
        // partitions that leave most of the short sequences' blocks empty.
        let splits = [
            max_len.next_multiple_of(32),
            attention::partition_keys(tokens, heads, max_len, 528),
            64,
        ];
        let outs: Vec<Vec<f32>> = splits
            .iter()
            .map(|&part_keys| {
                let out = g.zeros_bf16(tokens * q_size);
                let parts = max_len.div_ceil(part_keys);
                let partials = g.zeros_f32(tokens * heads * parts * (head_dim + 2));
                let args = attention::AttentionArgs {
                    qkv: g.p(&q_d),
                    width: w,
                    out: g.p(&out),
                    k_cache: g.p(&kc),
                    v_cache: g.p(&vc),
                    token_seq: g.p(&seq_d),
                    positions: g.p(&pos_d),
                    tables: g.p(&tab_d),
                    max_blocks: max_blocks as i32,
                    block_size: block as i32,
                    heads: heads as i32,
                    kv_heads: kv_heads as i32,
                    head_dim: head_dim as i32,
                    scale,
                };
                attention::launch(&g.stream, &g.k, &args, tokens, max_len, part_keys, g.p(&partials)).unwrap();
                g.stream.synchronize().unwrap();
                g.read_bf16(&out)
            })
            .collect();

        let mut want = vec![0f64; tokens * q_size];
        let mut starts = vec![0usize];
        for &c in &contexts {
            starts.push(starts.last().unwrap() + c);
        }
        for t in 0..tokens {
            let (s, p) = (token_seq[t] as usize, positions[t] as usize);
            for hi in 0..heads {
                let kvh = hi / (heads / kv_heads);
                let q = &q_rows[t * width + hi * head_dim..][..head_dim];
                let key = |j: usize, off: usize| -> Vec<f64> {
                    rounded(&qkv_all[(starts[s] + j) * width + off + kvh * head_dim..][..head_dim])
                        .into_iter()
                        .map(f64::from)
                        .collect()
                };
                let scores: Vec<f64> = (0..=p)
                    .map(|j| key(j, q_size).iter().zip(q).map(|(k, &qv)| k * qv as f64).sum::<f64>() * scale as f64)
                    .collect();
                let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                let total: f64 = weights.iter().sum();
                for (j, wj) in weights.iter().enumerate() {
                    let v = key(j, q_size + kv_size);
                    for dd in 0..head_dim {
                        want[t * q_size + hi * head_dim + dd] += wj / total * v[dd];
                    }
                }
            }
        }
        for (got, keys) in outs.iter().zip(splits) {
            assert_close(
                &format!("attention {heads}/{kv_heads}x{head_dim}, {keys} keys per partition"),
                got,
                &want,
                2e-3,
            );
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

    let (rows, inter) = (3usize, 1536usize);
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
    assert_close("silu_mul", &g.read_bf16(&act), &want, 1e-6);
}

#[test]
fn gemm_is_x_times_w_transposed() {
    let Some(g) = gpu() else { return };
    // Up to 8 rows, small weights and k a multiple of 8: the GEMV kernel; the others: cuBLAS.
    for (rows, n, k) in [
        (1usize, 300usize, 576usize),
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

#[test]
fn bitmask_clears_exactly_the_refused_tokens_and_argmax_picks_the_first_best() {
    let Some(g) = gpu() else { return };
    let vocab = 49155usize; // not a multiple of 32: the last word is partial
    let words = vocab.div_ceil(32);
    let rows = 3;
    let mut logits = values(rows * vocab, 12);
    // Ties: row 1's best value at two places; the lower index must win.
    logits[vocab + 40000] = 5.0;
    logits[vocab + 30000] = 5.0;
    let masks: Vec<u32> = values(2 * words, 13)
        .iter()
        .map(|v| v.to_bits() ^ 0x5555_5555)
        .collect();
    let mask_rows = [1i32, -1, 0];
    let (ld, md, rd) = (g.f32s(&logits), g.u32s(&masks), g.i32s(&mask_rows));
    let (v, wds) = (vocab as i32, words as i32);
    g.run(
        &g.k.apply_bitmask,
        (rows as u32, (vocab as u32).div_ceil(THREADS)),
        THREADS,
        &[&g.p(&ld), &g.p(&md), &g.p(&rd), &v, &wds],
    );
    let got = g.read_f32(&ld);
    for r in 0..rows {
        for t in 0..vocab {
            let allowed = match mask_rows[r] {
                -1 => true,
                m => masks[m as usize * words + t / 32] >> (t % 32) & 1 == 1,
            };
            let want = if allowed {
                logits[r * vocab + t]
            } else {
                f32::NEG_INFINITY
            };
            assert_eq!(got[r * vocab + t], want, "row {r} token {t}");
        }
    }
    let out = g.u32s(&[0; 3]);
    g.run(&g.k.argmax, (rows as u32, 1), 1024, &[&g.p(&ld), &v, &g.p(&out)]);
    let ids: Vec<u32> = g.stream.clone_dtoh(&out).unwrap();
    for r in 0..rows {
        let row = &got[r * vocab..][..vocab];
        assert_eq!(ids[r], crate::sampling::argmax(row), "row {r}");
    }
    assert_eq!(ids[1], 30000, "ties go to the lowest index");
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

/// Not a test: the GEMV kernel's time against cuBLAS's on the projections of the models we run,
/// for 1 to 8 rows (`test-quarry gemv_against_cublas --ignored --nocapture`). Decides where
/// `Gemm::matmul` takes the GEMV kernel.
#[test]
#[ignore]
fn gemv_against_cublas() {
    let Some(g) = gpu() else { return };
    let shapes = [
        ("8B qkv", 6144usize, 4096usize),
        ("8B o", 4096, 4096),
        ("8B gate_up", 28672, 4096),
        ("8B down", 4096, 14336),
        ("8B head", 128256, 4096),
        ("135M qkv", 960, 576),
        ("135M gate_up", 3072, 576),
        ("135M down", 576, 1536),
        ("135M head", 49152, 576),
    ];
    let ctx = g.stream.context().clone();
    let time = |f: &dyn Fn()| -> f64 {
        f();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (a, b) = (ctx.new_event(flags).unwrap(), ctx.new_event(flags).unwrap());
        a.record(&g.stream).unwrap();
        for _ in 0..20 {
            f();
        }
        b.record(&g.stream).unwrap();
        g.stream.synchronize().unwrap();
        a.elapsed_ms(&b).unwrap() as f64 / 20.0 * 1000.0
    };
    println!(
        "{:<14}{:>5}{:>12}{:>12}{:>10}{:>12}",
        "shape", "rows", "gemv us", "cublas us", "ratio", "gemv GB/s"
    );
    for (name, n, k) in shapes {
        let w: CudaSlice<u16> = g.stream.alloc_zeros(n * k).unwrap();
        let x: CudaSlice<u16> = g.stream.alloc_zeros(8 * k).unwrap();
        let y: CudaSlice<f32> = g.stream.alloc_zeros(8 * n).unwrap();
        for rows in [1usize, 2, 4, 8] {
            let (xp, wp, yp) = (g.p(&x), g.p(&w), g.p(&y));
            let gemv = time(&|| g.gemm.gemv(xp, wp, yp, rows, n, k).unwrap());
            let cublas = time(&|| g.gemm.cublas(xp, wp, yp, OutType::F32, rows, n, k).unwrap());
            let gbs = (n * k * 2) as f64 / gemv / 1e3;
            println!(
                "{name:<14}{rows:>5}{gemv:>12.1}{cublas:>12.1}{:>10.2}{gbs:>12.0}",
                gemv / cublas
            );
        }
    }
}
