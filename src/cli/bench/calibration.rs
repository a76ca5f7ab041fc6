//! How well a confidence separates right fields from wrong ones: AUROC with a bootstrap
//! interval over documents (a field's rightness is not independent of its document's), the
//! expected calibration error over 10 equal bins, and the reliability table behind it.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A field's confidence and whether it was right.
pub type Scored = (f64, bool);

/// The chance that a right field scores above a wrong one (ties count half); `None` without
/// both kinds.
pub fn auroc(fields: &[Scored]) -> Option<f64> {
    let right = fields.iter().filter(|f| f.1).count();
    let wrong = fields.len() - right;
    if right == 0 || wrong == 0 {
        return None;
    }
    let mut sorted: Vec<Scored> = fields.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    // Mann-Whitney: the ranks of the right fields, ties given their mean rank.
    let mut rank_sum = 0.0;
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j < sorted.len() && sorted[j].0 == sorted[i].0 {
            j += 1;
        }
        let mean_rank = (i + j + 1) as f64 / 2.0;
        rank_sum += mean_rank * sorted[i..j].iter().filter(|f| f.1).count() as f64;
        i = j;
    }
    let (r, w) = (right as f64, wrong as f64);
    Some((rank_sum - r * (r + 1.0) / 2.0) / (r * w))
}

/// The 2.5th and 97.5th percentiles of AUROC over `rounds` resamplings of the documents (each
/// a list of its fields), with replacement; a fixed seed, so the report repeats.
pub fn auroc_interval(documents: &[Vec<Scored>], rounds: usize) -> Option<(f64, f64)> {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut values = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let mut fields = Vec::new();
        for _ in 0..documents.len() {
            fields.extend_from_slice(&documents[rng.random_range(0..documents.len())]);
        }
        values.extend(auroc(&fields));
    }
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    Some((at(0.025), at(0.975)))
}

/// One bin of the reliability table: confidences in `[low, low + 0.1)` (the last bin takes 1).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Bin {
    pub low: f64,
    pub fields: usize,
    pub mean_confidence: f64,
    pub accuracy: f64,
}

pub fn reliability(fields: &[Scored]) -> Vec<Bin> {
    let mut bins: Vec<(usize, f64, usize)> = vec![(0, 0.0, 0); 10];
    for &(c, right) in fields {
        let b = &mut bins[((c * 10.0) as usize).min(9)];
        b.0 += 1;
        b.1 += c;
        b.2 += right as usize;
    }
    bins.into_iter()
        .enumerate()
        .map(|(i, (n, sum, right))| Bin {
            low: i as f64 / 10.0,
            fields: n,
            mean_confidence: if n > 0 { sum / n as f64 } else { 0.0 },
            accuracy: if n > 0 { right as f64 / n as f64 } else { 0.0 },
        })
        .collect()
}

/// Expected calibration error: the bins' gaps between accuracy and mean confidence, weighted
/// by their share of the fields.
pub fn ece(fields: &[Scored]) -> f64 {
    let n = fields.len().max(1) as f64;
    reliability(fields)
        .iter()
        .map(|b| b.fields as f64 / n * (b.accuracy - b.mean_confidence).abs())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auroc_counts_pairs_in_order_and_ties_as_half() {
        assert_eq!(auroc(&[(0.9, true), (0.1, false)]), Some(1.0));
        assert_eq!(auroc(&[(0.1, true), (0.9, false)]), Some(0.0));
        assert_eq!(auroc(&[(0.5, true), (0.5, false)]), Some(0.5));
        // Right 0.8, 0.4; wrong 0.6, 0.2: three of four pairs in order.
        assert_eq!(
            auroc(&[(0.8, true), (0.4, true), (0.6, false), (0.2, false)]),
            Some(0.75)
        );
        assert_eq!(auroc(&[(0.8, true)]), None);
    }

    #[test]
    fn calibration_error_is_the_weighted_gap_per_bin() {
        // Bin 0.9: confidence 0.95 twice, one right (gap 0.45); bin 0.2: 0.25, wrong (gap 0.25).
        let fields = [(0.95, true), (0.95, false), (0.25, false)];
        let bins = reliability(&fields);
        assert_eq!((bins[9].fields, bins[2].fields), (2, 1));
        assert!((ece(&fields) - (2.0 / 3.0 * 0.45 + 1.0 / 3.0 * 0.25)).abs() < 1e-12);
        assert_eq!(reliability(&[(1.0, true)])[9].fields, 1);
    }

    #[test]
    fn the_interval_holds_the_estimate_and_narrows_with_more_documents() {
        let doc = |k: usize| -> Vec<Scored> { (0..4).map(|i| ((i + k) as f64 / 10.0, i % 2 == 1)).collect() };
        let few: Vec<_> = (0..5).map(doc).collect();
        let many: Vec<_> = (0..80).map(|k| doc(k % 5)).collect();
        let all: Vec<Scored> = few.concat();
        let a = auroc(&all).unwrap();
        let (lo, hi) = auroc_interval(&few, 500).unwrap();
        let (lo2, hi2) = auroc_interval(&many, 500).unwrap();
        assert!(lo <= a && a <= hi, "{lo} {a} {hi}");
        assert!(hi2 - lo2 < hi - lo, "{lo2}..{hi2} vs {lo}..{hi}");
    }
}
