use std::collections::HashMap;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::params::SamplingParams;
pub use crate::runtime::{DrawParams, Penalty, TokenConfidence};

/// A draw made where the logits are (`Sampler::device_draw`).
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceDraw {
    pub params: DrawParams,
    pub penalties: Vec<Penalty>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopLogprob {
    pub token: u32,
    pub logprob: f32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token: u32,
    /// Log-probability of `token` under the model's raw distribution, when logprobs were asked
    /// for (the normalizer costs a pass of `exp` over the whole vocabulary, so only then).
    pub logprob: Option<f32>,
    /// The most likely tokens, best first, when logprobs were asked for.
    pub top: Vec<TopLogprob>,
    /// Decided by the grammar alone and appended without running the model for it
    /// (jump-forward): `logprob` is 0 when asked for (certain under the constraint) and `top` is
    /// empty.
    pub forced: bool,
    /// How sure the draw was, when `SamplingParams::confidence` asked (on the host or on a
    /// device that draws).
    pub confidence: Option<TokenConfidence>,
}

/// A sampler's state at one point of its output, to come back to after tokens that were only
/// proposed (speculative decoding records drafts to penalise what follows them, then keeps
/// only the accepted ones).
#[derive(Clone)]
pub struct Checkpoint {
    rng: ChaCha8Rng,
    recorded: u64,
    output_counts: HashMap<u32, u32>,
    seen: HashMap<u32, ()>,
    output: Vec<u32>,
}

/// One request's sampling state: its random stream and the token counts penalties need.
pub struct Sampler {
    params: SamplingParams,
    /// The seed of `rng`, and of draws made on a device (which have their own generator).
    seed: u64,
    rng: ChaCha8Rng,
    /// Tokens recorded so far: the counter of the next device draw.
    recorded: u64,
    /// Occurrences in the output so far (frequency and presence penalties).
    output_counts: HashMap<u32, u32>,
    /// Tokens seen in prompt or output (repetition penalty).
    seen: HashMap<u32, ()>,
    /// The output so far, kept for DRY.
    output: Vec<u32>,
    /// Per token id, whether it holds a DRY sequence breaker.
    breakers: Option<Arc<[bool]>>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        let seen = if params.repetition_penalty != 1.0 {
            prompt.iter().map(|&t| (t, ())).collect()
        } else {
            HashMap::new()
        };
        Sampler {
            params,
            seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
            recorded: 0,
            output_counts: HashMap::new(),
            seen,
            output: Vec::new(),
            breakers: None,
        }
    }

    /// The tokens that hold one of DRY's sequence breakers (by token id).
    pub fn set_breakers(&mut self, breakers: Arc<[bool]>) {
        self.breakers = Some(breakers);
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Draws a token and counts it for the penalties.
    pub fn sample(&mut self, logits: &[f32]) -> SampledToken {
        let sampled = self.draw(logits);
        self.record(sampled.token);
        sampled
    }

    /// Draws a token without counting it: the caller may still refuse it (a token after
    /// which a constrained output no longer fits its budget) and draw again, then `record`s
    /// the one it keeps.
    pub fn draw(&mut self, logits: &[f32]) -> SampledToken {
        let mut scores = logits.to_vec();
        self.apply_penalties(&mut scores);
        // Stochastic draws rescale and cut the scores in place: the confidence is taken from
        // them as they were.
        let kept = (self.params.confidence && self.params.temperature != 0.0).then(|| scores.clone());
        let token = if self.params.temperature == 0.0 {
            argmax(&scores)
        } else {
            self.sample_stochastic(&mut scores)
        };
        let confidence = self
            .params
            .confidence
            .then(|| TokenConfidence::of(kept.as_deref().unwrap_or(&scores), token));
        let (logprob, top) = match self.params.logprobs {
            Some(n) => {
                let (lp, top) = logprobs(logits, token, n);
                (Some(lp), top)
            }
            None => (None, Vec::new()),
        };
        SampledToken {
            token,
            logprob,
            top,
            forced: false,
            confidence,
        }
    }

    /// A token drawn elsewhere (by a backend, where the logits are), with its log-probability
    /// and the most likely tokens, and its confidence, where they were asked for: counted like
    /// a drawn one.
    pub fn take(
        &mut self,
        token: u32,
        logprobs: Option<(f32, Vec<TopLogprob>)>,
        confidence: Option<TokenConfidence>,
    ) -> SampledToken {
        self.record(token);
        let (logprob, top) = match logprobs {
            Some((lp, top)) => (Some(lp), top),
            None => (None, Vec::new()),
        };
        SampledToken {
            token,
            logprob,
            top,
            forced: false,
            confidence,
        }
    }

    /// A token the grammar forced: it counts for penalties like any output token.
    pub fn forced(&mut self, token: u32) -> SampledToken {
        self.record(token);
        SampledToken {
            token,
            logprob: self.params.logprobs.map(|_| 0.0),
            top: Vec::new(),
            forced: true,
            confidence: self.params.confidence.then_some(TokenConfidence::SOLE),
        }
    }

    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            rng: self.rng.clone(),
            recorded: self.recorded,
            output_counts: self.output_counts.clone(),
            seen: self.seen.clone(),
            output: self.output.clone(),
        }
    }

    /// Back to `checkpoint`: draws and recorded tokens since are forgotten.
    pub fn rewind(&mut self, checkpoint: Checkpoint) {
        self.rng = checkpoint.rng;
        self.recorded = checkpoint.recorded;
        self.output_counts = checkpoint.output_counts;
        self.seen = checkpoint.seen;
        self.output = checkpoint.output;
    }

    /// Counts an output token for the penalties.
    pub fn record(&mut self, token: u32) {
        self.recorded += 1;
        *self.output_counts.entry(token).or_default() += 1;
        if self.params.dry.is_some() {
            self.output.push(token);
        }
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token, ());
        }
    }

    /// The next token's draw for a backend that draws where the logits are: the parameters,
    /// the seed and the draw's counter, the penalties as per-token edits (`apply_penalties`'s
    /// effect) and the log-probabilities asked for.
    pub fn device_draw(&self) -> DeviceDraw {
        let p = &self.params;
        DeviceDraw {
            params: DrawParams {
                temperature: p.temperature,
                top_k: p.top_k,
                top_p: p.top_p,
                min_p: p.min_p,
                seed: self.seed,
                counter: self.recorded,
                logprobs: p.logprobs,
                confidence: p.confidence,
            },
            penalties: self.penalties(),
        }
    }

    /// `apply_penalties` as one edit per token it changes.
    fn penalties(&self) -> Vec<Penalty> {
        let p = &self.params;
        let mut edits: HashMap<u32, (f32, f32)> = HashMap::new();
        if p.repetition_penalty != 1.0 {
            for &t in self.seen.keys() {
                edits.entry(t).or_insert((1.0, 0.0)).0 = p.repetition_penalty;
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &n) in &self.output_counts {
                edits.entry(t).or_insert((1.0, 0.0)).1 -= p.frequency_penalty * n as f32 + p.presence_penalty;
            }
        }
        if let Some(dry) = &p.dry {
            let is_breaker = |t: u32| self.breakers.as_ref().is_some_and(|b| b.get(t as usize) == Some(&true));
            for (t, run) in dry_runs(&self.output, dry.allowed_length, is_breaker) {
                let over = (run - dry.allowed_length).min(30) as i32;
                edits.entry(t).or_insert((1.0, 0.0)).1 -= dry.multiplier * dry.base.powi(over);
            }
        }
        // In token order: the same state gives the same list.
        let mut edits: Vec<Penalty> = edits
            .into_iter()
            .map(|(token, (factor, add))| Penalty { token, factor, add })
            .collect();
        edits.sort_unstable_by_key(|e| e.token);
        edits
    }

    fn apply_penalties(&self, scores: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in self.seen.keys() {
                let s = &mut scores[t as usize];
                *s = if *s > 0.0 {
                    *s / p.repetition_penalty
                } else {
                    *s * p.repetition_penalty
                };
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &n) in &self.output_counts {
                scores[t as usize] -= p.frequency_penalty * n as f32 + p.presence_penalty;
            }
        }
        if let Some(dry) = &p.dry {
            let is_breaker = |t: u32| self.breakers.as_ref().is_some_and(|b| b.get(t as usize) == Some(&true));
            for (t, run) in dry_runs(&self.output, dry.allowed_length, is_breaker) {
                // Capped: past ~30 doublings the token is out of the running anyway.
                let over = (run - dry.allowed_length).min(30) as i32;
                scores[t as usize] -= dry.multiplier * dry.base.powi(over);
            }
        }
    }

    /// Temperature, then min-p, top-k and top-p cuts, then a draw from what is left.
    fn sample_stochastic(&mut self, scores: &mut [f32]) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        // Unnormalised probabilities; the max token has weight 1.
        let mut cands: Vec<(u32, f32)> = scores
            .iter()
            .enumerate()
            .map(|(i, &s)| (i as u32, ((s - max) * inv_t).exp()))
            .filter(|&(_, w)| w > 0.0 && w >= p.min_p)
            .collect();
        if p.top_k > 0 && p.top_k < cands.len() {
            cands.select_nth_unstable_by(p.top_k - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            cands.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            cands.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let total: f32 = cands.iter().map(|c| c.1).sum();
            let mut cum = 0.0;
            let keep = cands
                .iter()
                .position(|c| {
                    cum += c.1;
                    cum >= p.top_p * total
                })
                .map_or(cands.len(), |i| i + 1);
            cands.truncate(keep);
        }
        let total: f32 = cands.iter().map(|c| c.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for &(t, w) in &cands {
            if r < w {
                return t;
            }
            r -= w;
        }
        cands.last().map_or_else(|| argmax(scores), |c| c.0)
    }
}

/// For each token that would extend a repeat at the end of `out`, the longest such repeat
/// (at least `allowed` tokens): token `out[j]` followed an earlier run equal to the run that
/// ends `out` now. The run at the end stops at the last breaker; breakers are never
/// penalised themselves. Linear in the output: the Z-function of the output reversed gives, for
/// every earlier position, how far its run matches the end's.
fn dry_runs(out: &[u32], allowed: usize, is_breaker: impl Fn(u32) -> bool) -> Vec<(u32, usize)> {
    let n = out.len();
    if n < allowed + 1 {
        return Vec::new();
    }
    let reach = out.iter().rev().take_while(|&&t| !is_breaker(t)).count();
    if reach < allowed {
        return Vec::new();
    }
    let rev: Vec<u32> = out.iter().rev().copied().collect();
    let z = z_function(&rev);
    let mut best: HashMap<u32, usize> = HashMap::new();
    for j in 1..n {
        // The run ending just before position j matches the end's run over z[n - j] tokens.
        let run = z[n - j].min(reach).min(j);
        let t = out[j];
        if run >= allowed && !is_breaker(t) {
            let b = best.entry(t).or_default();
            *b = (*b).max(run);
        }
    }
    best.into_iter().collect()
}

/// `z[i]`: the length of the longest common prefix of `s` and `s[i..]` (`z[0]` is `s.len()`).
fn z_function(s: &[u32]) -> Vec<usize> {
    let n = s.len();
    let mut z = vec![0; n];
    if n == 0 {
        return z;
    }
    z[0] = n;
    let (mut l, mut r) = (0, 0);
    for i in 1..n {
        if i < r {
            z[i] = (r - i).min(z[i - l]);
        }
        while i + z[i] < n && s[z[i]] == s[i + z[i]] {
            z[i] += 1;
        }
        if i + z[i] > r {
            l = i;
            r = i + z[i];
        }
    }
    z
}

/// Index of the largest score; the lowest id wins a tie, as in llama.cpp and transformers.
pub fn argmax(scores: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &s) in scores.iter().enumerate() {
        if s > scores[best] {
            best = i;
        }
    }
    best as u32
}

/// Log-softmax of `logits` at `token`, and the `n` most likely tokens.
fn logprobs(logits: &[f32], token: u32, n: usize) -> (f32, Vec<TopLogprob>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let log_z = max + logits.iter().map(|&v| (v - max).exp()).sum::<f32>().ln();
    let mut top = Vec::new();
    if n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let n = n.min(idx.len());
        let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
        idx.select_nth_unstable_by(n - 1, by_logit);
        idx.truncate(n);
        idx.sort_unstable_by(by_logit);
        top = idx
            .into_iter()
            .map(|t| TopLogprob {
                token: t,
                logprob: logits[t as usize] - log_z,
            })
            .collect();
    }
    (logits[token as usize] - log_z, top)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    #[test]
    fn greedy_takes_the_argmax_and_reports_logprobs() {
        let mut s = Sampler::new(params(|p| p.logprobs = Some(2)), &[]);
        let out = s.sample(&[0.0, 2.0, 1.0, 2.0]);
        assert_eq!(out.token, 1, "ties go to the lowest id");
        let z = (1.0f32 + 2.0 * 2f32.exp() + 1f32.exp()).ln();
        assert!((out.logprob.unwrap() - (2.0 - z)).abs() < 1e-5);
        assert_eq!(out.top.iter().map(|t| t.token).collect::<Vec<_>>(), vec![1, 3]);
    }

    #[test]
    fn same_seed_same_stream_different_seed_differs() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(
                params(|p| {
                    p.temperature = 1.0;
                    p.seed = Some(seed);
                }),
                &[],
            );
            (0..50).map(|_| s.sample(&logits).token).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn top_k_and_top_p_and_min_p_restrict_the_support() {
        let logits = [5.0, 4.0, 3.0, 0.0, -1.0];
        let draws = |f: fn(&mut SamplingParams)| {
            let mut s = Sampler::new(
                params(|p| {
                    p.temperature = 1.0;
                    p.seed = Some(3);
                    f(p)
                }),
                &[],
            );
            let mut seen: Vec<u32> = (0..400).map(|_| s.sample(&logits).token).collect();
            seen.sort();
            seen.dedup();
            seen
        };
        assert_eq!(draws(|p| p.top_k = 2), vec![0, 1]);
        // p(0) ~ 0.66, p(0)+p(1) ~ 0.91: top_p 0.8 keeps two tokens.
        assert_eq!(draws(|p| p.top_p = 0.8), vec![0, 1]);
        // min_p 0.3 of the top probability keeps tokens within ln(1/0.3) ~ 1.2 of the best logit.
        assert_eq!(draws(|p| p.min_p = 0.3), vec![0, 1]);
        assert_eq!(draws(|_| {}), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn dry_finds_the_longest_repeat_each_token_would_extend() {
        let none = |_: u32| false;
        // 1 2 3 9 1 2 3: after "1 2 3", 9 continues a 3-token repeat.
        assert_eq!(dry_runs(&[1, 2, 3, 9, 1, 2, 3], 2, none), vec![(9, 3)]);
        // Too short a repeat: "3" alone.
        assert!(dry_runs(&[3, 9, 3], 2, none).is_empty());
        // A loop "5 6 5 6 5 6": 5 would extend the repeat of "5 6 5 6" (4 tokens).
        let mut found = dry_runs(&[5, 6, 5, 6, 5, 6], 2, none);
        found.sort();
        assert_eq!(found, vec![(5, 4)]);
        // A breaker (7) at the end's run cuts it: only "1 2" repeats after the 7.
        let seven = |t: u32| t == 7;
        assert_eq!(dry_runs(&[0, 1, 2, 4, 3, 7, 1, 2], 2, seven), vec![(4, 2)]);
        assert!(
            dry_runs(&[1, 2, 7, 1, 2, 7], 2, seven).is_empty(),
            "nothing after a breaker"
        );
        assert!(
            dry_runs(&[1, 2, 7, 1, 2], 2, seven).is_empty(),
            "breakers are never penalised"
        );
    }

    #[test]
    fn dry_lowers_the_token_that_continues_a_loop() {
        use crate::sampling::DryParams;
        let mut s = Sampler::new(params(|p| p.dry = Some(DryParams::default())), &[]);
        // The output loops "1 2 1 2 1 2"; token 1 leads by a little, and continues a repeat
        // of 4 tokens: 0.8 * 1.75^2 = 2.45 off its logit.
        for t in [1, 2, 1, 2, 1, 2] {
            s.record(t);
        }
        assert_eq!(s.sample(&[0.0, 2.0, 0.0, 1.0]).token, 3);
        let mut plain = Sampler::new(params(|_| {}), &[]);
        for t in [1, 2, 1, 2, 1, 2] {
            plain.record(t);
        }
        assert_eq!(plain.sample(&[0.0, 2.0, 0.0, 1.0]).token, 1);
    }

    /// The edits a device applies (factor, then the addition; as kernels/sampling.cu's
    /// apply_penalties does) change the logits as the CPU sampler's penalties do.
    #[test]
    fn device_penalty_edits_are_the_samplers_penalties() {
        use crate::sampling::DryParams;
        let vocab = 40usize;
        let logits: Vec<f32> = (0..vocab).map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.37).collect();
        let mut s = Sampler::new(
            params(|p| {
                p.repetition_penalty = 1.3;
                p.frequency_penalty = 0.4;
                p.presence_penalty = 0.2;
                p.dry = Some(DryParams::default());
                p.seed = Some(9);
            }),
            &[3, 4, 5, 30],
        );
        for t in [1, 2, 3, 1, 2, 3, 1, 2, 7, 7, 1, 2] {
            s.record(t);
        }
        let mut want = logits.clone();
        s.apply_penalties(&mut want);
        let draw = s.device_draw();
        assert_eq!((draw.params.seed, draw.params.counter), (9, 12));
        let mut got = logits.clone();
        for e in &draw.penalties {
            let x = &mut got[e.token as usize];
            if e.factor != 1.0 {
                *x = if *x > 0.0 { *x / e.factor } else { *x * e.factor };
            }
            *x += e.add;
        }
        // The additions are summed before they are added: equal up to rounding.
        for (t, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "token {t}: {g} vs {w}");
        }
        assert_ne!(got, logits);
        // DRY is in there: 3 continues the repeat of "1 2".
        assert!(draw.penalties.iter().any(|e| e.token == 3 && e.add < -0.9));
        let asks = Sampler::new(params(|p| p.logprobs = Some(3)), &[]).device_draw();
        assert_eq!(asks.params.logprobs, Some(3));
    }

    #[test]
    fn a_rewound_sampler_draws_and_penalises_as_if_nothing_had_happened() {
        use crate::sampling::DryParams;
        let logits: Vec<f32> = (0..30).map(|i| ((i * 7 % 11) as f32) * 0.4).collect();
        let make = || {
            let mut s = Sampler::new(
                params(|p| {
                    p.temperature = 0.9;
                    p.seed = Some(4);
                    p.repetition_penalty = 1.2;
                    p.presence_penalty = 0.3;
                    p.dry = Some(DryParams::default());
                }),
                &[1, 2],
            );
            for t in [3, 4, 3, 4] {
                s.record(t);
            }
            s
        };
        let (mut a, mut b) = (make(), make());
        let mark = a.checkpoint();
        // Drafts recorded, a draw made, then all of it undone.
        for t in [3, 4, 5] {
            a.record(t);
        }
        a.sample(&logits);
        a.rewind(mark);
        assert_eq!(a.device_draw(), b.device_draw());
        let after: Vec<u32> = (0..20).map(|_| a.sample(&logits).token).collect();
        let plain: Vec<u32> = (0..20).map(|_| b.sample(&logits).token).collect();
        assert_eq!(after, plain);
    }

    #[test]
    fn penalties_push_repeated_tokens_down() {
        let logits = [1.0, 0.9, -1.0];
        let mut s = Sampler::new(params(|p| p.presence_penalty = 0.5), &[]);
        assert_eq!(s.sample(&logits).token, 0);
        assert_eq!(s.sample(&logits).token, 1, "presence penalty moves off token 0");
        let mut s = Sampler::new(params(|p| p.repetition_penalty = 1.5), &[0]);
        assert_eq!(
            s.sample(&logits).token,
            1,
            "prompt token 0 is penalised: 1.0 / 1.5 < 0.9"
        );
        let mut s = Sampler::new(params(|p| p.frequency_penalty = 0.06), &[]);
        assert_eq!(s.sample(&logits).token, 0);
        assert_eq!(s.sample(&logits).token, 0, "0.94 still beats 0.9");
        assert_eq!(s.sample(&logits).token, 1, "0.88 no longer does");
    }
}
