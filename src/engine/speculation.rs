//! When speculation pays. A draft costs a share of the step it rides in (one more token, one
//! more row of logits to mask and draw), paid by every request in the batch, and gains only
//! where the model agrees with it and with every draft before it. So the k-th draft of a
//! request is worth checking when the chance of keeping it (its acceptance rate to the k-th
//! power) exceeds what it costs the batch: the share of the step one more row takes, times the
//! requests that wait for the step. At batch 1 on a memory-bound device that cost is small; in
//! a full, compute-bound batch it is close to the whole row, and nobody speculates.

/// Speculative decoding: which proposers guess a request's next tokens, and how many.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    /// Draft tokens per request and step, at most.
    pub tokens: usize,
    /// Prompt lookup: what followed the output's last tokens where they occur earlier.
    pub ngram: bool,
    /// The constraint's forced tokens. Under jump-forward they are appended without the
    /// model anyway; this adds them where they follow a draft, and guesses them where
    /// jump-forward is off.
    pub grammar: bool,
    /// Draft only as many tokens as pay for themselves, judged from each request's recent
    /// acceptance and the measured cost of a row in a step as large as the batch
    /// (`speculation::drafts_worth`), and where steps may be pipelined, pipeline those in
    /// which drafting would gain less (`speculation_pays`); otherwise always up to `tokens`,
    /// in steps never pipelined.
    pub adaptive: bool,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        SpeculativeConfig {
            tokens: 8,
            ngram: true,
            grammar: true,
            adaptive: true,
        }
    }
}

/// Who guessed a draft token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proposer {
    /// Prompt lookup (`NgramProposer`).
    Ngram,
    /// The constraint's forced tokens.
    Grammar,
    /// A draft model (`DraftModel`).
    Model,
}

/// Draft tokens the model checked, and those it agreed with, per proposer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftCounts {
    pub ngram_proposed: usize,
    pub ngram_accepted: usize,
    pub grammar_proposed: usize,
    pub grammar_accepted: usize,
    pub model_proposed: usize,
    pub model_accepted: usize,
    /// Steps that checked at least one draft of a request.
    pub checks: usize,
}

impl DraftCounts {
    pub(crate) fn count(&mut self, by: Proposer, accepted: bool) {
        let (proposed, kept) = match by {
            Proposer::Ngram => (&mut self.ngram_proposed, &mut self.ngram_accepted),
            Proposer::Grammar => (&mut self.grammar_proposed, &mut self.grammar_accepted),
            Proposer::Model => (&mut self.model_proposed, &mut self.model_accepted),
        };
        *proposed += 1;
        *kept += accepted as usize;
    }

    pub fn proposed(&self) -> usize {
        self.ngram_proposed + self.grammar_proposed + self.model_proposed
    }

    pub fn accepted(&self) -> usize {
        self.ngram_accepted + self.grammar_accepted + self.model_accepted
    }

    pub fn add(&mut self, other: &DraftCounts) {
        self.ngram_proposed += other.ngram_proposed;
        self.ngram_accepted += other.ngram_accepted;
        self.grammar_proposed += other.grammar_proposed;
        self.grammar_accepted += other.grammar_accepted;
        self.model_proposed += other.model_proposed;
        self.model_accepted += other.model_accepted;
        self.checks += other.checks;
    }
}

/// Decoding step time against the rows of logits the step samples, `a + b * rows`, fitted by
/// least squares over recent steps (older ones weigh less), so the model, the device and the
/// batch shapes of this run decide it.
#[derive(Debug, Clone, Default)]
pub struct StepCost {
    weight: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

/// Each step's weight in the fit falls by this factor per later step.
const DECAY: f64 = 0.98;
/// Before the fit can tell (too few steps, or all of one size): one more row costs this share
/// of a step of one row.
const PRIOR_SHARE: f64 = 0.25;

impl StepCost {
    pub fn record(&mut self, rows: usize, seconds: f64) {
        let (x, y) = (rows as f64, seconds);
        self.weight = self.weight * DECAY + 1.0;
        self.x = self.x * DECAY + x;
        self.y = self.y * DECAY + y;
        self.xx = self.xx * DECAY + x * x;
        self.xy = self.xy * DECAY + x * y;
    }

    /// `(a, b)`, where the steps seen vary enough in size to fit them.
    fn fit(&self) -> Option<(f64, f64)> {
        let spread = self.weight * self.xx - self.x * self.x;
        if self.weight < 4.0 || spread <= 1e-9 * self.weight * self.weight {
            return None;
        }
        let b = (self.weight * self.xy - self.x * self.y) / spread;
        let a = (self.y - b * self.x) / self.weight;
        (a > 0.0 && b >= 0.0).then_some((a, b))
    }

    /// What a step of `rows` rows takes, in seconds, once any step has run.
    pub fn step_seconds(&self, rows: usize) -> Option<f64> {
        match self.fit() {
            Some((a, b)) => Some(a + b * rows as f64),
            None => (self.weight > 0.0).then(|| self.y / self.weight),
        }
    }

    /// What one more row adds to a step of `rows` rows, as a share of that step.
    pub fn marginal_share(&self, rows: usize) -> f64 {
        let rows = rows.max(1) as f64;
        match self.fit() {
            Some((a, b)) => b / (a + b * rows),
            None => PRIOR_SHARE / (1.0 + PRIOR_SHARE * (rows - 1.0)),
        }
    }
}

/// How often a request's drafts are kept, per draft checked, over its recent checks (a draft
/// is checked when every one before it was kept), starting from even odds.
#[derive(Debug, Clone, Default)]
pub struct Acceptance {
    kept: f64,
    checked: f64,
}

/// Each check's weight falls by this factor per later check, so a request that moves from
/// copying to writing on its own (or back) is followed within a few steps.
const ACCEPTANCE_DECAY: f64 = 0.8;
/// The same per step without drafts: a request that stopped drafting tries again after some
/// tens of steps.
const FORGET_DECAY: f64 = 0.97;

impl Acceptance {
    pub fn rate(&self) -> f64 {
        (self.kept + 1.0) / (self.checked + 2.0)
    }

    /// `proposed` drafts went into a step and the first `kept` were kept.
    pub fn record(&mut self, proposed: usize, kept: usize) {
        self.kept = self.kept * ACCEPTANCE_DECAY + kept as f64;
        self.checked = self.checked * ACCEPTANCE_DECAY + (kept + 1).min(proposed) as f64;
    }

    /// A step without drafts: the evidence ages, so a request once judged not worth drafting
    /// for is tried again later: slowly, since every try costs the whole batch a little.
    pub fn forget(&mut self) {
        self.kept *= FORGET_DECAY;
        self.checked *= FORGET_DECAY;
    }
}

/// How often a request that wants drafts gets any (prompt lookup finds its last tokens
/// earlier; the grammar forces text after them), over its recent tries, from even odds once
/// tried. Drafts that never come are never kept: `speculation_pays` weighs a request's expected
/// kept drafts by it, since in a large batch most requests wanting drafts find none in a step.
#[derive(Debug, Clone, Default)]
pub struct Availability {
    got: f64,
    tried: f64,
}

impl Availability {
    /// A request never tried counts as getting drafts: one try tells, and one judged by the
    /// prior alone might never be tried (three requests copying from their documents, after a
    /// batch of 32 had taught the engine to pipeline, never drafted).
    pub fn rate(&self) -> f64 {
        if self.tried == 0.0 {
            return 1.0;
        }
        (self.got + 1.0) / (self.tried + 2.0)
    }

    /// The proposers were asked for the request's drafts; `got`: they gave at least one.
    pub fn record(&mut self, got: bool) {
        self.got = self.got * ACCEPTANCE_DECAY + f64::from(u8::from(got));
        self.tried = self.tried * ACCEPTANCE_DECAY + 1.0;
    }

    /// A step in which nobody asked: the evidence ages, so that a request judged to find no
    /// drafts is tried again later, as `Acceptance::forget` does.
    pub fn forget(&mut self) {
        self.got *= FORGET_DECAY;
        self.tried *= FORGET_DECAY;
    }
}

/// How many drafts a request should have checked: the largest `k` (at most `max`) whose
/// chance of being kept, `rate^k`, exceeds its cost: `share` of a step for each of the
/// `waiting` requests the step serves, and `per_draft` of a step more to make each guess (a
/// draft model's pass, as a share of the step; 0 for guesses that cost nothing to make).
pub fn drafts_worth(rate: f64, waiting: usize, share: f64, per_draft: f64, max: usize) -> usize {
    let cost = share * waiting.max(1) as f64 + per_draft;
    let mut kept = 1.0;
    for k in 1..=max {
        kept *= rate;
        if kept <= cost {
            return k - 1;
        }
    }
    max
}

/// An exponential average of recent measurements (the latest weighs `1 - HOST_DECAY`).
#[derive(Debug, Clone, Copy, Default)]
struct Recent(Option<f64>);

/// Each host-time measurement's weight falls by this factor per later one.
const HOST_DECAY: f64 = 0.9;

impl Recent {
    fn record(&mut self, x: f64) {
        self.0 = Some(self.0.map_or(x, |v| v * HOST_DECAY + x * (1.0 - HOST_DECAY)));
    }
}

/// The host's share of an unpipelined decoding step, measured as steps run: the work the
/// device waits for, which a pipelined step does while the device runs (planning the step;
/// preparing the batch before its pass is queued and committing the tokens after they are
/// read, both within `StepCost`'s time), and what proposing drafts takes, which a pipelined
/// step does not do at all. And what pipelining loses: the share of a pipelined step's rows
/// that the step before made moot (forced tokens after its token, a request that ended), each
/// computed again a step later.
#[derive(Debug, Clone, Default)]
pub struct HostTime {
    scheduling: Recent,
    exposed: Recent,
    proposing: Recent,
    dropped: Recent,
}

impl HostTime {
    pub fn record(&mut self, scheduling: f64, exposed: f64, proposing: f64) {
        self.scheduling.record(scheduling);
        self.exposed.record(exposed);
        self.proposing.record(proposing);
    }

    /// A pipelined step planned `rows` sampled rows, of which `dropped` no longer stood.
    pub fn record_pipelined(&mut self, rows: usize, dropped: usize) {
        if rows > 0 {
            self.dropped.record(dropped as f64 / rows as f64);
        }
    }
}

/// Whether the coming step should speculate rather than be pipelined, for `n` decoding
/// requests that want `drafts` drafts in all, of which `kept` are expected to be kept
/// (the sum over requests of their acceptance rate to the k-th power, `expected_kept`,
/// weighed by how often each gets drafts, `Availability`). Drafting
/// makes `n + kept` tokens in a step of `n + drafts` rows, after proposing; a pipelined step
/// makes `n` tokens, less the rows it drops, in the time pipelined steps of `n` rows were
/// measured to take (`pipelined`), or before any was, in the unpipelined step without the
/// host's exposed work (or in that work where the host is the slower). With no drafts wanted
/// the step is pipelined, and before any step is measured the drafts are tried.
pub fn speculation_pays(
    n: usize,
    drafts: usize,
    kept: f64,
    cost: &StepCost,
    pipelined: &StepCost,
    host: &HostTime,
) -> bool {
    if drafts == 0 || n == 0 {
        return false;
    }
    let (Some(plain), Some(checked), Some(exposed)) =
        (cost.step_seconds(n), cost.step_seconds(n + drafts), host.exposed.0)
    else {
        return true;
    };
    let scheduling = host.scheduling.0.unwrap_or(0.0);
    let drafting = host.proposing.0.unwrap_or(0.0) + scheduling + checked;
    let pipelined = pipelined
        .step_seconds(n)
        .unwrap_or((plain - exposed).max(scheduling + exposed));
    let made = n as f64 * (1.0 - host.dropped.0.unwrap_or(0.0));
    (n as f64 + kept) * pipelined > made * drafting
}

/// The drafts a request with acceptance `rate` is expected to have kept out of `k` checked:
/// the chance of keeping the first, the first two, and so on.
pub fn expected_kept(rate: f64, k: usize) -> f64 {
    (1..=k as i32).map(|j| rate.powi(j)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_a_linear_step_cost() {
        let mut cost = StepCost::default();
        assert!(
            (cost.marginal_share(1) - PRIOR_SHARE).abs() < 1e-9,
            "the prior before any step"
        );
        for i in 0..50 {
            let rows = 1 + i % 9;
            cost.record(rows, 0.004 + 0.001 * rows as f64);
        }
        // a = 4 ms, b = 1 ms: one more row on a 1-row step is 1/5 of it, on 31 rows 1/35.
        assert!(
            (cost.marginal_share(1) - 0.2).abs() < 1e-6,
            "{}",
            cost.marginal_share(1)
        );
        assert!((cost.marginal_share(31) - 1.0 / 35.0).abs() < 1e-6);
        // Steps all of one size cannot be fitted: the prior stands.
        let mut flat = StepCost::default();
        for _ in 0..20 {
            flat.record(1, 0.005);
        }
        assert!((flat.marginal_share(1) - PRIOR_SHARE).abs() < 1e-9);
    }

    #[test]
    fn availability_follows_recent_tries_and_ages_without_them() {
        let mut a = Availability::default();
        assert_eq!(a.rate(), 1.0, "untried");
        a.record(false);
        assert!((a.rate() - 1.0 / 3.0).abs() < 1e-9, "{}", a.rate());
        for _ in 0..19 {
            a.record(false);
        }
        // About five tries weigh: the rate settles near 1/7 and 6/7.
        assert!(a.rate() < 0.15, "{}", a.rate());
        for _ in 0..20 {
            a.record(true);
        }
        assert!(a.rate() > 0.84, "{}", a.rate());
        for _ in 0..200 {
            a.forget();
        }
        assert!((a.rate() - 0.5).abs() < 0.05, "back near even odds: {}", a.rate());
    }

    #[test]
    fn acceptance_follows_recent_checks_and_ages_without_them() {
        let mut a = Acceptance::default();
        assert_eq!(a.rate(), 0.5);
        for _ in 0..20 {
            a.record(4, 4);
        }
        assert!(a.rate() > 0.9, "{}", a.rate());
        for _ in 0..20 {
            // Rejected at once: one draft checked, none kept.
            a.record(4, 0);
        }
        assert!(a.rate() < 0.25, "{}", a.rate());
        for _ in 0..10 {
            a.forget();
        }
        assert!(a.rate() < 0.3, "not tried again at once: {}", a.rate());
        for _ in 0..200 {
            a.forget();
        }
        assert!((a.rate() - 0.5).abs() < 0.01, "{}", a.rate());
    }

    #[test]
    fn drafts_are_worth_checking_while_kept_more_often_than_they_cost() {
        // At batch 1 with a cheap extra token, a good copier drafts the most.
        assert_eq!(drafts_worth(0.9, 1, 0.05, 0.0, 8), 8);
        // 0.7^k > 0.2 up to k = 4 (0.24), not 5 (0.168).
        assert_eq!(drafts_worth(0.7, 1, 0.2, 0.0, 8), 4);
        // The same request in a batch of 32 where a token costs 3% of the step: 0.7 < 0.96.
        assert_eq!(drafts_worth(0.7, 32, 0.03, 0.0, 8), 0);
        // 0.99^4 = 0.9606 > 0.96, 0.99^5 = 0.951.
        assert_eq!(drafts_worth(0.99, 32, 0.03, 0.0, 8), 4);
        assert_eq!(drafts_worth(0.5, 1, 0.2, 0.0, 0), 0);
        // Checking is free (a memory-bound step) but each guess takes a draft model's pass of
        // a quarter of the step: 0.7^3 = 0.343 > 0.25 > 0.7^4 = 0.24.
        assert_eq!(drafts_worth(0.7, 1, 0.0, 0.25, 8), 3);
        assert_eq!(drafts_worth(0.2, 1, 0.0, 0.25, 8), 0);
    }

    #[test]
    fn speculation_is_chosen_over_pipelining_only_where_its_drafts_gain_more() {
        let mut cost = StepCost::default();
        let none = StepCost::default();
        let host = HostTime::default();
        // Nothing measured: drafts wanted are tried, and none wanted means a pipelined step.
        assert!(speculation_pays(32, 4, 1.0, &cost, &none, &host));
        assert!(!speculation_pays(32, 0, 0.0, &cost, &none, &host));
        // A step of r rows takes 1 ms + 0.01 ms a row; 0.1 ms of it is the host's, exposed.
        for i in 0..60 {
            let rows = 1 + i % 40;
            cost.record(rows, 0.001 + 0.00001 * rows as f64);
        }
        let mut host = HostTime::default();
        for _ in 0..60 {
            host.record(0.0, 0.0001, 0.00002);
        }
        // 32 requests: a plain step 1.32 ms, pipelined 1.22 ms, 26.2 tokens a ms. Eight drafts
        // (1.42 ms with proposing) must keep more than 5.3 of them to beat that.
        assert!(!speculation_pays(32, 8, 5.0, &cost, &none, &host));
        assert!(speculation_pays(32, 8, 6.0, &cost, &none, &host));
        // At batch 1 pipelining saves a tenth of the step, and half a kept draft is worth more.
        assert!(speculation_pays(1, 4, 0.5, &cost, &none, &host));
        assert!(!speculation_pays(1, 4, 0.05, &cost, &none, &host));
        // Where the host is the slower, a pipelined step takes the host's time.
        let mut slow = HostTime::default();
        slow.record(0.0, 0.0009, 0.0);
        // (1 + 0.2) x 0.9 ms > 1.02 ms; against the device's 0.11 ms it would lose.
        assert!(speculation_pays(1, 1, 0.2, &cost, &none, &slow));
        // Where a pipelined step drops a fifth of its rows (forced tokens after them), 32
        // requests make 25.6 tokens in 1.22 ms: 21 tokens a ms, and 8 drafts that keep 2
        // (34 tokens in 1.42 ms, 23.9 a ms) gain more.
        assert!(!speculation_pays(32, 8, 2.0, &cost, &none, &host));
        for _ in 0..60 {
            host.record_pipelined(10, 2);
        }
        assert!(speculation_pays(32, 8, 2.0, &cost, &none, &host));
        // Pipelined steps of 32 rows measured at 1 ms, not the 1.22 ms estimated: 25.6
        // tokens a ms, against 24.6 for 8 drafts that keep 3 (35 tokens in 1.42 ms).
        let mut measured = StepCost::default();
        for _ in 0..10 {
            measured.record(32, 0.001);
        }
        assert!(speculation_pays(32, 8, 3.0, &cost, &none, &host));
        assert!(!speculation_pays(32, 8, 3.0, &cost, &measured, &host));
        // No drafts wanted: pipelined still (the unpipelined step has nothing to gain).
        assert!(!speculation_pays(32, 0, 0.0, &cost, &none, &host));
    }

    #[test]
    fn expected_kept_drafts_sum_the_chances_of_keeping_each() {
        assert_eq!(expected_kept(0.5, 0), 0.0);
        assert!((expected_kept(0.5, 3) - 0.875).abs() < 1e-12);
        assert!((expected_kept(1.0, 8) - 8.0).abs() < 1e-12);
    }
}
