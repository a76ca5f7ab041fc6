//! Turning one row of logits into one token: penalties (repetition, frequency, presence, DRY),
//! temperature, min-p, top-k, top-p,
//! a per-request seeded random stream, and log-probabilities.

mod params;
mod sampler;

pub use params::{ContrastParams, DryParams, SamplingParamError, SamplingParams, MAX_LOGPROBS};
pub use sampler::{argmax, DeviceDraw, SampledToken, Sampler, TokenConfidence, TopLogprob};
