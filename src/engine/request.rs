//! One request as the scheduler sees it: its tokens, how many of them have keys and values in
//! the cache, and where it is in its life.

use super::kv_cache_manager::RequestId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
    /// Was running, lost its blocks to a more deserving request; waits to be recomputed.
    Preempted,
    Finished,
}

#[derive(Debug, Clone)]
pub struct Request {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    /// Lower runs first under the priority policy (as in vLLM).
    pub priority: i32,
    /// Order of arrival: breaks priority ties, and is the FCFS order.
    pub arrival: u64,
    /// Tokens whose keys and values are in the cache.
    pub num_computed: usize,
    /// Prompt tokens found in the prefix cache when the request was (last) scheduled.
    pub num_cached: usize,
    pub num_preemptions: usize,
    pub status: RequestStatus,
    /// Guesses of the tokens after the last known one (speculative decoding): computed in the
    /// next step after the known tokens, kept only as far as the model agrees with them.
    pub drafts: Vec<u32>,
    /// The prompt of its shadow sequence, where it has one: another prompt fed the same output
    /// and drafts beside it, on blocks the scheduler plans with its own (context-aware
    /// decoding's twin, `engine::contrast`).
    pub shadow: Option<Vec<u32>>,
    /// Tokens of the shadow (its prompt, then the output) whose keys and values its blocks hold.
    pub shadow_computed: usize,
    /// The last output token is a placeholder (`scheduler::PENDING`) for a token a launched
    /// step is still drawing.
    pub pending: bool,
    /// The most output tokens it may have (its `max_tokens`): a placeholder that is its last
    /// token ends it, so a pipelined plan leaves it out.
    pub max_output: usize,
}

impl Request {
    pub fn new(id: RequestId, prompt: Vec<u32>, priority: i32, arrival: u64) -> Self {
        Request {
            id,
            prompt,
            output: Vec::new(),
            priority,
            arrival,
            num_computed: 0,
            num_cached: 0,
            num_preemptions: 0,
            status: RequestStatus::Waiting,
            drafts: Vec::new(),
            shadow: None,
            shadow_computed: 0,
            pending: false,
            max_output: usize::MAX,
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    /// Token `i` of prompt-then-output.
    pub fn token(&self, i: usize) -> u32 {
        if i < self.prompt.len() {
            self.prompt[i]
        } else {
            self.output[i - self.prompt.len()]
        }
    }

    /// Tokens `range` of prompt-then-output (copied as two slices: a speculating step asks for
    /// every request's whole context).
    pub fn tokens(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        if range.is_empty() {
            return Vec::new();
        }
        let p = self.prompt.len();
        let mut out = Vec::with_capacity(range.len());
        out.extend_from_slice(&self.prompt[range.start.min(p)..range.end.min(p)]);
        out.extend_from_slice(&self.output[range.start.max(p) - p..range.end.max(p) - p]);
        out
    }

    /// Every token, prompt then output.
    pub fn all_tokens(&self) -> Vec<u32> {
        self.tokens(0..self.num_tokens())
    }

    /// The query tokens of a step from `start`: `num_known` known tokens, then the first
    /// `num_drafts` drafts.
    pub fn span(&self, start: usize, num_known: usize, num_drafts: usize) -> Vec<u32> {
        let mut tokens = self.tokens(start..start + num_known);
        tokens.extend_from_slice(&self.drafts[..num_drafts]);
        tokens
    }

    /// Its last token is a placeholder that ends it: the output or the context is full.
    pub fn ends_at_placeholder(&self, token_limit: usize) -> bool {
        self.pending && (self.output.len() >= self.max_output || self.num_tokens() >= token_limit)
    }

    /// Still prefilling: this step's tokens end before the last known one, so no token is
    /// sampled after them.
    pub fn is_prefill_chunk(&self, num_new: usize) -> bool {
        self.num_computed + num_new < self.num_tokens()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_of_tokens_reads_across_the_prompt_and_the_output() {
        let mut r = Request::new(1, vec![10, 11, 12], 0, 0);
        r.output = vec![20, 21];
        let each = |range: std::ops::Range<usize>| range.map(|i| r.token(i)).collect::<Vec<_>>();
        for start in 0..=5 {
            for end in start..=5 {
                assert_eq!(r.tokens(start..end), each(start..end), "{start}..{end}");
            }
        }
        assert_eq!(r.all_tokens(), [10, 11, 12, 20, 21]);
        assert_eq!(r.span(1, 3, 0), [11, 12, 20]);
    }
}
