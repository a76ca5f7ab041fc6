use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::params::SamplingParams;

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
}

/// One request's sampling state: its random stream and the token counts penalties need.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Occurrences in the output so far (frequency and presence penalties).
    output_counts: HashMap<u32, u32>,
    /// Tokens seen in prompt or output (repetition penalty).
    seen: HashMap<u32, ()>,
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
            rng: ChaCha8Rng::seed_from_u64(seed),
            output_counts: HashMap::new(),
            seen,
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn sample(&mut self, logits: &[f32]) -> SampledToken {
        let mut scores = logits.to_vec();
        self.apply_penalties(&mut scores);
        let token = if self.params.temperature == 0.0 {
            argmax(&scores)
        } else {
            self.sample_stochastic(&mut scores)
        };
        self.record(token);
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
        }
    }

    fn record(&mut self, token: u32) {
        *self.output_counts.entry(token).or_default() += 1;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token, ());
        }
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
