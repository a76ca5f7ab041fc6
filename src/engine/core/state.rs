//! A request's state on the engine's side of the step (the scheduler keeps its tokens and
//! cache slots): its sampler, constraint, detokenizer, stop strings, times and counts.

use std::time::Instant;

use super::RequestMetrics;
use crate::engine::contained::ContainedMatcher;
use crate::engine::detokenizer::Detokenizer;
use crate::engine::speculation::{Acceptance, Availability, Proposer};
use crate::engine::stop::StopStrings;
use crate::sampling::Sampler;

pub(super) struct State {
    pub(super) sampler: Sampler,
    pub(super) matcher: Option<ContainedMatcher>,
    pub(super) detokenizer: Detokenizer,
    pub(super) stops: StopStrings,
    pub(super) arrived: Instant,
    pub(super) scheduled_at: Option<Instant>,
    pub(super) last_token_at: Option<Instant>,
    pub(super) metrics: RequestMetrics,
    /// Who proposed each of the request's current drafts.
    pub(super) draft_sources: Vec<Proposer>,
    pub(super) acceptance: Acceptance,
    /// How often proposing gave it drafts when it wanted some.
    pub(super) availability: Availability,
}
