//! The CUDA backend against llama.cpp (the goldens of tests/reference.rs) and against the CPU
//! backend, on the default model. Skipped, with a message, where there is no GPU.

mod common;

use quarry::runtime::{Backend, DeviceChoice, ForwardBatch, LoadOptions, TokenConfidence};

use common::gpu_tolerance::{DECISIVE_MARGIN, MAX_LOGPROB_TOLERANCE, MEAN_LOGPROB_TOLERANCE};

fn gpu_backend(kv_cache_tokens: usize) -> Option<Box<dyn Backend>> {
    gpu_backend_with(kv_cache_tokens, false)
}

fn gpu_backend_with(kv_cache_tokens: usize, enforce_eager: bool) -> Option<Box<dyn Backend>> {
    let path = common::model_path()?;
    quarry::runtime::device::cuda_for_test()?;
    let options = LoadOptions {
        kv_cache_tokens: Some(kv_cache_tokens),
        max_num_batched_tokens: 512,
        max_num_seqs: 64,
        enforce_eager,
        ..Default::default()
    };
    Some(quarry::runtime::load(DeviceChoice::Cuda(0), &path, options).expect("load on the GPU"))
}

/// Decode steps, speculative checks and known tokens replayed from CUDA graphs give the logits
/// of the same steps run kernel by kernel, bit for bit: batches padded up the ladder (3
/// sequences run as 4, 5 as 8), sequences padded to the step's most tokens, checks of 2 to 4
/// tokens a sequence, only last rows wanted, contexts across a partition boundary, block tables
/// scattered. Over eight rows the batches' sizes are on the ladder, so cuBLAS sees the same
/// shapes in both; up to eight, the GEMV gives a row the same bits for any count.
#[test]
fn graph_replay_gives_the_bits_of_eager_steps() {
    let golden = common::golden();
    let Some(mut eager) = gpu_backend_with(8192, true) else {
        return;
    };
    let mut graphs = gpu_backend_with(8192, false).expect("the second backend");
    let block = eager.kv_layout().block_size;
    let n = 8;
    let mut seqs: Vec<Vec<u32>> = (0..n)
        .map(|s| {
            let p = &golden.prompts[s % golden.prompts.len()].prompt_tokens;
            // Sequence 7 starts past the first attention partition (512 keys).
            let repeat = if s == 7 { 520 / p.len() + 1 } else { 1 };
            p.iter().copied().cycle().take(p.len() * repeat - s % 3).collect()
        })
        .collect();
    // Sequence s owns blocks s, s + 8, s + 16, ...
    let tables: Vec<Vec<u32>> = (0..n as u32)
        .map(|s| (0..50).map(|i| s + n as u32 * i).collect())
        .collect();
    let mut prefill = ForwardBatch::default();
    for s in 0..n {
        prefill.push_sequence(&seqs[s][..seqs[s].len() - 1], 0, &tables[s], block);
    }
    eager.forward(&prefill).expect("prefill");
    graphs.forward(&prefill).expect("prefill");
    assert_eq!(graphs.graph_steps(), 0, "a prefill has no captured shape");
    // Each step: the tokens each of its sequences feeds (its last, then made-up drafts or known
    // tokens after it), and whether every row's logits are wanted or only each sequence's last.
    let uniform = |count: usize, q: usize| (vec![q; count], true);
    let steps = [
        uniform(1, 1),
        uniform(3, 1),
        uniform(5, 1),
        uniform(8, 1),
        uniform(2, 1),
        uniform(4, 3),
        uniform(2, 4),
        uniform(8, 2),
        uniform(7, 1),
        uniform(1, 2),
        // Checks of different lengths, and known tokens with only the last row wanted: padded
        // inside each sequence, up to eight rows (the GEMV's) both ways.
        (vec![1, 3], true),
        (vec![2, 1, 2], false),
        (vec![1, 4], false),
        (vec![3, 1], false),
    ];
    for (i, (per_seq, every_row)) in steps.iter().enumerate() {
        let order: Vec<usize> = (0..per_seq.len()).map(|k| (k * 3 + i) % n).collect();
        let mut batch = ForwardBatch::default();
        let mut first_rows = Vec::new();
        for (&s, &q) in order.iter().zip(per_seq) {
            let len = seqs[s].len();
            let mut tokens = vec![seqs[s][len - 1]];
            tokens.extend((1..q as u32).map(|d| 100 * d + s as u32));
            first_rows.push(batch.num_tokens());
            batch.push_sequence(&tokens, len - 1, &tables[s], block);
            if !every_row {
                batch.logits_rows.push(batch.num_tokens() as u32 - 1);
            }
        }
        if *every_row {
            batch.logits_rows = (0..batch.num_tokens() as u32).collect();
        }
        let a = eager.forward(&batch).expect("eager step");
        // A shape not captured at start runs eagerly until it recurs: the step is run again
        // (writing the same keys to the same slots) until it replays its graph.
        let replayed = graphs.graph_steps();
        let mut b = graphs.forward(&batch).expect("graph step");
        for _ in 0..4 {
            if graphs.graph_steps() > replayed {
                break;
            }
            b = graphs.forward(&batch).expect("graph step");
        }
        assert_eq!(
            graphs.graph_steps(),
            replayed + 1,
            "step {i} ({per_seq:?}) replays a graph"
        );
        for row in 0..batch.logits_rows.len() {
            let same = a
                .row(row)
                .iter()
                .zip(b.row(row))
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "step {i} ({per_seq:?}) row {row}: graph and eager logits differ");
        }
        // Every sequence goes on with its first token's greedy choice where that row is there,
        // else with its last row's.
        for (k, &s) in order.iter().enumerate() {
            let row = match every_row {
                true => first_rows[k],
                false => k,
            };
            seqs[s].push(quarry::sampling::argmax(a.row(row)));
        }
    }
    assert_eq!(
        graphs.graph_steps(),
        steps.len() as u64,
        "every step above has few tokens a sequence"
    );
    assert_eq!(eager.graph_steps(), 0, "--enforce-eager replays nothing");
    println!("{} steps replayed from graphs, the same bits as eager", steps.len());
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let log_z = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    row.iter().map(|&v| v as f64 - log_z).collect()
}

#[test]
fn gpu_logprobs_and_decisive_choices_match_llama_cpp() {
    let Some(mut backend) = gpu_backend(4096) else { return };
    common::check_against_llama_cpp(backend.as_mut());
}

/// Three sequences through prefill chunks and decode steps in mixed batches (a chunk crossing
/// block boundaries beside decode tokens), on both backends, block tables scattered: every
/// sampled row's log-probabilities agree within the tolerances above.
#[test]
fn gpu_and_cpu_agree_on_mixed_chunked_batches() {
    let golden = common::golden();
    let Some(mut gpu) = gpu_backend(4096) else { return };
    let (mut cpu, _) = common::load(4096).unwrap();
    let prompts: Vec<Vec<u32>> = golden.prompts.iter().take(3).map(|p| p.prompt_tokens.clone()).collect();
    let block = cpu.kv_layout().block_size;
    assert_eq!(block, gpu.kv_layout().block_size);
    // Sequence s owns blocks s, s + 3, s + 6, ...: interleaved, never contiguous.
    let tables: Vec<Vec<u32>> = (0..3u32).map(|s| (0..40).map(|i| s + 3 * i).collect()).collect();
    let mut seqs: Vec<Vec<u32>> = prompts.clone();
    let mut done = [0usize; 3]; // tokens already in each sequence's KV
    let (mut sum, mut n, mut max, mut flips) = (0.0f64, 0.0f64, 0.0f64, 0usize);
    for step in 0..24 {
        let mut batch = ForwardBatch::default();
        let mut sampled = Vec::new();
        for s in 0..3 {
            // Sequence 0 prefills in chunks of 7, the others whole; then all decode.
            let chunk = if s == 0 { 7 } else { seqs[s].len() };
            let end = (done[s] + chunk).min(seqs[s].len());
            batch.push_sequence(&seqs[s][done[s]..end], done[s], &tables[s], block);
            done[s] = end;
            if end == seqs[s].len() {
                batch.logits_rows.push(batch.num_tokens() as u32 - 1);
                sampled.push(s);
            }
        }
        let a = cpu.forward(&batch).expect("cpu forward");
        let b = gpu.forward(&batch).expect("gpu forward");
        for (row, &s) in sampled.iter().enumerate() {
            let (x, y) = (log_softmax(a.row(row)), log_softmax(b.row(row)));
            let cpu_best = quarry::sampling::argmax(a.row(row)) as usize;
            let gpu_best = quarry::sampling::argmax(b.row(row)) as usize;
            let mut order: Vec<usize> = (0..x.len()).collect();
            order.sort_by(|&i, &j| x[j].total_cmp(&x[i]));
            for &t in &order[..5] {
                let d = (x[t] - y[t]).abs();
                max = max.max(d);
                sum += d;
                n += 1.0;
            }
            if cpu_best != gpu_best {
                flips += 1;
                let margin = x[order[0]] - x[order[1]];
                assert!(
                    margin < DECISIVE_MARGIN,
                    "step {step} seq {s}: cpu {cpu_best}, gpu {gpu_best}, margin {margin:.3}"
                );
            }
            // Both continue with the CPU's choice, so the sequences stay the same.
            seqs[s].push(cpu_best as u32);
        }
    }
    println!(
        "gpu vs cpu over mixed batches: mean deviation {:.3}, max {max:.3}, {flips} near-tie flips",
        sum / n
    );
    assert!(sum / n <= MEAN_LOGPROB_TOLERANCE && max <= MAX_LOGPROB_TOLERANCE);
}

/// Draws on the device against the same steps on the host, on the same logits: the grammar's
/// mask, the copy bias and the penalties applied where the logits are give the host's argmax
/// exactly; a redraw under a narrower mask stays inside it; a seeded draw depends on its seed and
/// counter, not on its row in the batch.
#[test]
fn device_draws_match_the_host_on_the_same_logits() {
    use quarry::runtime::{Draw, DrawParams, Penalty, RowRequest};
    let golden = common::golden();
    let Some(mut gpu) = gpu_backend(4096) else { return };
    let block = gpu.kv_layout().block_size;
    let prompts: Vec<Vec<u32>> = golden.prompts.iter().take(3).map(|p| p.prompt_tokens.clone()).collect();
    let tables: Vec<Vec<u32>> = (0..3u32).map(|s| (0..40).map(|i| s + 3 * i).collect()).collect();
    // Prefill all but the last token of each prompt; the batches compared decode the last one.
    let mut prefill = ForwardBatch::default();
    for s in 0..3 {
        let p = &prompts[s];
        prefill.push_sequence(&p[..p.len() - 1], 0, &tables[s], block);
    }
    gpu.forward(&prefill).expect("prefill");
    let decode = |order: &[usize]| {
        let mut b = ForwardBatch::default();
        for &s in order {
            let p = &prompts[s];
            b.push_sequence(&p[p.len() - 1..], p.len() - 1, &tables[s], block);
            b.logits_rows.push(b.num_tokens() as u32 - 1);
        }
        b
    };
    let batch = decode(&[0, 1, 2]);
    let logits = gpu.forward(&batch).expect("decode");
    let vocab = logits.vocab_size;
    let words = vocab.div_ceil(32);
    let bits = |f: &dyn Fn(usize) -> bool| -> Vec<u32> {
        let mut m = vec![0u32; words];
        for t in (0..vocab).filter(|&t| f(t)) {
            m[t / 32] |= 1 << (t % 32);
        }
        m
    };
    let allowed = |m: &[u32], t: usize| m[t / 32] >> (t % 32) & 1 == 1;
    // Row 0: a scattered mask, a copy bias and penalties on its three best tokens; row 1: no
    // mask, a penalty that pushes its best token down; row 2: a mask of every third token.
    let best: Vec<Vec<u32>> = (0..3)
        .map(|r| {
            let row = logits.row(r);
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
            order[..3].to_vec()
        })
        .collect();
    let mask0 = bits(&|t| (t * 2654435761) % 7 < 4 || best[0].contains(&(t as u32)));
    let mask2 = bits(&|t| t % 3 == 0);
    let copy0 = bits(&|t| t % 5 == 0);
    let pen0: Vec<Penalty> = best[0]
        .iter()
        .map(|&token| Penalty {
            token,
            factor: 1.3,
            add: -0.7,
        })
        .collect();
    let pen1 = vec![Penalty {
        token: best[1][0],
        factor: 1.0,
        add: -5.0,
    }];
    let masks = [Some(&mask0[..]), None, Some(&mask2[..])];
    let biases = [Some((&copy0[..], 1.5f32)), None, None];
    let pens: [&[Penalty]; 3] = [&pen0, &pen1, &[]];
    // The final scores the draw sees, from row r's logits (or `base`, contrasted): mask, bias,
    // penalties.
    let scores_from = |base: &[f32], r: usize, narrower: Option<&[u32]>| -> Vec<f32> {
        let mut scores: Vec<f32> = base.to_vec();
        for (t, x) in scores.iter_mut().enumerate() {
            let open = masks[r].is_none_or(|m| allowed(m, t)) && narrower.is_none_or(|m| allowed(m, t));
            if !open {
                *x = f32::NEG_INFINITY;
            } else if let Some((c, b)) = biases[r] {
                if allowed(c, t) {
                    *x += b;
                }
            }
        }
        for p in pens[r] {
            let x = &mut scores[p.token as usize];
            if p.factor != 1.0 {
                *x = if *x > 0.0 { *x / p.factor } else { *x * p.factor };
            }
            *x += p.add;
        }
        scores
    };
    let host_scores = |r: usize, narrower: Option<&[u32]>| scores_from(logits.row(r), r, narrower);
    let host = |r: usize, narrower: Option<&[u32]>| -> u32 { quarry::sampling::argmax(&host_scores(r, narrower)) };
    // The confidence as the host sampler computes it, from the same final scores.
    let check_confidence =
        |what: &str, got: Option<TokenConfidence>, r: usize, narrower: Option<&[u32]>, token: u32| {
            let want = TokenConfidence::of(&host_scores(r, narrower), token);
            let got = got.unwrap_or_else(|| panic!("{what}: no confidence"));
            assert_eq!(got.choices, want.choices, "{what}: choices");
            assert!(
                (got.prob - want.prob).abs() <= 1e-4 * want.prob.max(1e-3),
                "{what}: probability {} vs {}",
                got.prob,
                want.prob
            );
        };
    let draw = |r: usize, temperature: f32, counter: u64| Draw {
        params: DrawParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1234 + r as u64,
            counter,
            logprobs: Some(5),
            confidence: true,
        },
        bias: biases[r],
        penalties: pens[r],
        contrast: None,
    };
    // Log-probabilities as the host sampler reports them: of the logits after the mask and the
    // bias, before penalties.
    let host_logprobs = |r: usize, narrower: Option<&[u32]>, token: u32| -> (f32, Vec<(u32, f32)>) {
        let scores: Vec<f32> = logits
            .row(r)
            .iter()
            .enumerate()
            .map(|(t, &x)| {
                let open = masks[r].is_none_or(|m| allowed(m, t)) && narrower.is_none_or(|m| allowed(m, t));
                match biases[r] {
                    _ if !open => f32::NEG_INFINITY,
                    Some((c, b)) if allowed(c, t) => x + b,
                    _ => x,
                }
            })
            .collect();
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let log_z = max + scores.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        let mut order: Vec<u32> = (0..vocab as u32).collect();
        order.sort_by(|&a, &b| scores[b as usize].total_cmp(&scores[a as usize]).then(a.cmp(&b)));
        let top = order[..5]
            .iter()
            .map(|&t| (t, (scores[t as usize] as f64 - log_z) as f32))
            .collect();
        ((scores[token as usize] as f64 - log_z) as f32, top)
    };
    let check_logprobs = |what: &str, got: &quarry::runtime::RowLogprobs, want: (f32, Vec<(u32, f32)>)| {
        assert!(
            (got.logprob - want.0).abs() < 1e-3,
            "{what}: logprob {} vs {}",
            got.logprob,
            want.0
        );
        let ids = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(ids(&got.top), ids(&want.1), "{what}: top tokens");
        for (g, w) in got.top.iter().zip(&want.1) {
            assert!((g.1 - w.1).abs() < 1e-3, "{what}: top logprob {} vs {}", g.1, w.1);
        }
    };
    let greedy: Vec<RowRequest> = (0..3)
        .map(|r| RowRequest {
            mask: masks[r],
            draw: Some(draw(r, 0.0, 0)),
            logits_back: true,
        })
        .collect();
    gpu.run(&batch).unwrap();
    let out = gpu.sample(&greedy).unwrap();
    for r in 0..3 {
        assert_eq!(out.tokens[r], Some(host(r, None)), "row {r}");
        let lp = out.logprobs[r].as_ref().expect("asked for");
        check_logprobs(&format!("row {r}"), lp, host_logprobs(r, None, host(r, None)));
        check_confidence(&format!("row {r}"), out.confidence[r], r, None, host(r, None));
    }
    assert_ne!(
        out.tokens[1],
        Some(best[1][0]),
        "the penalty moved row 1 off its best token"
    );
    // A narrower mask for row 0: tokens 100..200 only.
    let narrow = bits(&|t| (100..200).contains(&t));
    let redrawn = gpu.redraw_within(0, &narrow).unwrap();
    let again = redrawn.token;
    assert_eq!(again, host(0, Some(&narrow)));
    assert!((100..200).contains(&(again as usize)));
    check_logprobs(
        "redrawn row 0",
        &redrawn.logprobs.unwrap(),
        host_logprobs(0, Some(&narrow), again),
    );
    check_confidence("redrawn row 0", redrawn.confidence, 0, Some(&narrow), again);
    // Pipelined: the next pass (its rows reversed, so that row 0's logits are another
    // sequence's) is queued before the draw is read; the redraw reads row 0's scores as the
    // draw kept them, and row 1, without a mask, kept none.
    gpu.run(&batch).unwrap();
    gpu.launch_sample(&greedy).unwrap();
    gpu.run(&decode(&[2, 1, 0])).unwrap();
    let out = gpu.collect().unwrap();
    assert_eq!(out.tokens[0], Some(host(0, None)), "pipelined row 0");
    let redrawn = gpu.redraw_within(0, &narrow).unwrap();
    assert_eq!(redrawn.token, again, "pipelined redraw of row 0");
    check_logprobs(
        "pipelined redraw of row 0",
        &redrawn.logprobs.unwrap(),
        host_logprobs(0, Some(&narrow), again),
    );
    assert!(gpu.redraw_within(1, &narrow).is_err(), "row 1 had no mask to keep");

    // Seeded draws: in order, then with the rows reversed, the same token per sequence.
    let seeded = |order: &[usize], gpu: &mut Box<dyn Backend>| -> Vec<u32> {
        gpu.run(&decode(order)).unwrap();
        let requests: Vec<RowRequest> = order
            .iter()
            .map(|&r| RowRequest {
                mask: masks[r],
                draw: Some(draw(r, 1.0, 5)),
                logits_back: true,
            })
            .collect();
        let got = gpu.sample(&requests).unwrap();
        let mut by_seq = vec![0u32; 3];
        for (i, &r) in order.iter().enumerate() {
            by_seq[r] = got.tokens[i].expect("drawn on the device");
            // At temperature 1 the confidence is still that of the final scores.
            check_confidence(&format!("seeded row {r}"), got.confidence[i], r, None, by_seq[r]);
        }
        by_seq
    };
    let forward = seeded(&[0, 1, 2], &mut gpu);
    let reversed = seeded(&[2, 1, 0], &mut gpu);
    assert_eq!(forward, reversed);
    for r in [0, 2] {
        assert!(
            allowed(masks[r].unwrap(), forward[r] as usize),
            "row {r} drew a masked token"
        );
    }
    // Rows without a draw come back as logits, in row order.
    gpu.run(&batch).unwrap();
    let mixed = [greedy[0], RowRequest::LOGITS, greedy[2]];
    let out = gpu.sample(&mixed).unwrap();
    assert_eq!(out.tokens[1], None);
    assert_eq!(out.host_row(1).unwrap(), logits.row(1));
    assert_eq!(
        (out.tokens[0], out.tokens[2]),
        (Some(host(0, None)), Some(host(2, None)))
    );
    // Context-aware decoding on the device: row 0 contrasted with row 2 (its twin, whose logits
    // stay there), then masked, biased and penalized as before; the same token and confidence
    // as the engine's host path, which contrasts the two rows' logits with `contrast`.
    // The weight: the first that moves row 0's token, so that ignoring it could not pass.
    let contrasted_scores = |w: f32| {
        let base = quarry::engine::contrast::contrast(logits.row(0), logits.row(2), w);
        scores_from(&base, 0, None)
    };
    let weight = [0.5f32, 1.0, 2.0, 4.0, 8.0]
        .into_iter()
        .find(|&w| quarry::sampling::argmax(&contrasted_scores(w)) != host(0, None))
        .expect("some weight of contrast moves row 0's token");
    gpu.run(&batch).unwrap();
    let contrasted = RowRequest {
        mask: masks[0],
        draw: Some(Draw {
            contrast: Some((2, weight)),
            ..draw(0, 0.0, 0)
        }),
        logits_back: true,
    };
    let twin = RowRequest {
        logits_back: false,
        ..RowRequest::LOGITS
    };
    let out = gpu.sample(&[contrasted, greedy[1], twin]).unwrap();
    let scores = contrasted_scores(weight);
    let want = quarry::sampling::argmax(&scores);
    assert_eq!(out.tokens[0], Some(want), "the contrasted row, weight {weight}");
    let conf = out.confidence[0].expect("asked for");
    assert_eq!(conf.choices, TokenConfidence::of(&scores, want).choices);
    assert_eq!(out.tokens[1], Some(host(1, None)));
    assert_eq!(
        (out.tokens[2], out.host_row(2)),
        (None, None),
        "the twin's logits stay on the device"
    );
    assert_eq!(out.logits.rows(), 0);
}
