//! Tensor parallelism's split of the decoder (Megatron-LM's): rank `r` of `n` holds a slice of
//! the query heads, the KV heads those queries read, and a slice of the MLP's intermediate
//! width. q|k|v and gate|up are split by output rows (column-parallel), so each rank computes
//! its heads and its share of SiLU(gate) * up with no communication; the attention output
//! and down projections are split by input columns (row-parallel), so each rank's product is
//! a partial sum that an all-reduce completes. Norms, the embedding and the head stay whole.
//!
//! Where ranks outnumber the KV heads (a group of query heads spans ranks), each rank keeps a
//! copy of the one KV head its queries read, as vLLM does.

use std::ops::Range;

use super::config::ModelConfig;
use super::error::{Result, RuntimeError};

/// One rank's part of a model split over `size` GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
}

impl Shard {
    /// The whole model: one rank.
    pub const WHOLE: Shard = Shard { rank: 0, size: 1 };

    /// Rank `rank` of `size`, where `cfg` splits that many ways.
    pub fn new(rank: usize, size: usize, cfg: &ModelConfig) -> Result<Shard> {
        check(cfg, size)?;
        if rank >= size {
            return Err(RuntimeError::Device(format!("rank {rank} of a group of {size}")));
        }
        Ok(Shard { rank, size })
    }

    pub fn is_whole(&self) -> bool {
        self.size == 1
    }

    /// Rank 0 computes the logits and draws; the others only help with the layers.
    pub fn leads(&self) -> bool {
        self.rank == 0
    }

    /// This rank's query heads.
    pub fn q_heads(&self, cfg: &ModelConfig) -> Range<usize> {
        let per = cfg.num_heads / self.size;
        self.rank * per..(self.rank + 1) * per
    }

    /// The KV heads this rank's queries read: its own where they split evenly, else the one
    /// its group shares with other ranks.
    pub fn kv_heads(&self, cfg: &ModelConfig) -> Range<usize> {
        let group = cfg.num_heads / cfg.num_kv_heads;
        let q = self.q_heads(cfg);
        q.start / group..(q.end - 1) / group + 1
    }

    /// This rank's columns of the MLP's intermediate width.
    pub fn intermediate(&self, cfg: &ModelConfig) -> Range<usize> {
        let per = cfg.intermediate_size / self.size;
        self.rank * per..(self.rank + 1) * per
    }

    /// The shape this rank computes: its heads and its intermediate width, the hidden size,
    /// vocabulary and everything else whole.
    pub fn config(&self, cfg: &ModelConfig) -> ModelConfig {
        let mut local = cfg.clone();
        local.num_heads = self.q_heads(cfg).len();
        local.num_kv_heads = self.kv_heads(cfg).len();
        local.intermediate_size = self.intermediate(cfg).len();
        local
    }

    /// Rows of the stacked `[q | k | v]` projection (or its bias, `width` 1) this rank
    /// keeps: its query heads' rows, then its KV heads' rows of k and of v.
    pub fn qkv_rows(&self, cfg: &ModelConfig, q: &[f32], k: &[f32], v: &[f32], width: usize) -> Vec<f32> {
        let hd = cfg.head_dim * width;
        let heads = |m: &[f32], r: Range<usize>| m[r.start * hd..r.end * hd].to_vec();
        let mut out = heads(q, self.q_heads(cfg));
        out.extend(heads(k, self.kv_heads(cfg)));
        out.extend(heads(v, self.kv_heads(cfg)));
        out
    }

    /// Rows `range` of a row-major matrix `width` wide.
    pub fn rows(m: &[f32], width: usize, range: Range<usize>) -> Vec<f32> {
        m[range.start * width..range.end * width].to_vec()
    }

    /// Columns `range` of every row of a row-major matrix `width` wide.
    pub fn columns(m: &[f32], width: usize, range: Range<usize>) -> Vec<f32> {
        m.chunks_exact(width)
            .flat_map(|row| &row[range.clone()])
            .copied()
            .collect()
    }
}

/// Whether `cfg` splits `size` ways: query heads and the intermediate width evenly, and KV
/// heads either evenly or with each rank's queries inside one KV head's group.
pub fn check(cfg: &ModelConfig, size: usize) -> Result<()> {
    let refuse = |why: String| {
        Err(RuntimeError::BadMetadata {
            key: "tensor_parallel_size".into(),
            reason: format!("{size}: {why}"),
        })
    };
    if size == 0 {
        return refuse("at least one GPU".into());
    }
    if !cfg.num_heads.is_multiple_of(size) {
        return refuse(format!("the {} query heads do not divide evenly", cfg.num_heads));
    }
    if !cfg.intermediate_size.is_multiple_of(size) {
        return refuse(format!(
            "the MLP's width {} does not divide evenly",
            cfg.intermediate_size
        ));
    }
    let (per_rank, group) = (cfg.num_heads / size, cfg.num_heads / cfg.num_kv_heads);
    if !per_rank.is_multiple_of(group) && !group.is_multiple_of(per_rank) {
        return refuse(format!(
            "{per_rank} query heads a rank would straddle groups of {group} sharing a KV head"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(heads: usize, kv: usize, inter: usize) -> ModelConfig {
        let mut c = ModelConfig::preset("llama-3.1-8b").unwrap();
        c.num_heads = heads;
        c.num_kv_heads = kv;
        c.intermediate_size = inter;
        c.head_dim = 2;
        c.hidden_size = heads * 2;
        c
    }

    #[test]
    fn heads_split_evenly_or_kv_heads_are_shared() {
        // Llama-3.1-8B's 32 query and 8 KV heads over 4 ranks: 8 and 2 each.
        let c = cfg(32, 8, 16);
        let s = Shard::new(3, 4, &c).unwrap();
        assert_eq!(
            (s.q_heads(&c), s.kv_heads(&c), s.intermediate(&c)),
            (24..32, 6..8, 12..16)
        );
        assert_eq!(s.config(&c).num_heads / s.config(&c).num_kv_heads, 4);
        // 8 query heads over 2 KV heads, 8 ranks: ranks 0-3 keep KV head 0, 4-7 head 1.
        let c = cfg(8, 2, 8);
        let kv: Vec<_> = (0..8).map(|r| Shard::new(r, 8, &c).unwrap().kv_heads(&c)).collect();
        assert_eq!(kv[3], 0..1);
        assert_eq!(kv[4], 1..2);
        // SmolLM2: 9 query heads, 3 KV heads: 3 ranks, not 2.
        let c = cfg(9, 3, 6);
        assert_eq!(Shard::new(1, 3, &c).unwrap().kv_heads(&c), 1..2);
        let e = Shard::new(0, 2, &c).unwrap_err().to_string();
        assert!(e.contains("9 query heads"), "{e}");
        // 6 query heads a rank over groups of 4: a rank would need parts of two KV heads.
        assert!(check(&cfg(12, 3, 4), 2).is_err());
    }

    #[test]
    fn slices_take_the_rank_s_rows_and_columns() {
        let c = cfg(4, 2, 4);
        let s = Shard::new(1, 2, &c).unwrap();
        // One value a row of q (4 heads of 2), k and v (2 heads of 2): width 1.
        let q: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let k: Vec<f32> = (10..14).map(|i| i as f32).collect();
        let v: Vec<f32> = (20..24).map(|i| i as f32).collect();
        assert_eq!(s.qkv_rows(&c, &q, &k, &v, 1), [4., 5., 6., 7., 12., 13., 22., 23.]);
        let m: Vec<f32> = (0..12).map(|i| i as f32).collect();
        assert_eq!(Shard::rows(&m, 3, 1..3), [3., 4., 5., 6., 7., 8.]);
        assert_eq!(Shard::columns(&m, 4, 2..4), [2., 3., 6., 7., 10., 11.]);
    }
}
