//! Percentiles and medians of latency samples.

/// The value at quantile `q` (0.0..=1.0) of `samples` by the nearest-rank
/// method; sorts `samples` in place. `None` for no samples.
pub(crate) fn quantile(samples: &mut [f64], q: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_by(f64::total_cmp);
    let rank = (q * samples.len() as f64).ceil() as usize;
    Some(samples[rank.clamp(1, samples.len()) - 1])
}

/// The median of `values` (the mean of the middle two for an even count);
/// `None` for none.
pub(crate) fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut s: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(quantile(&mut s, 0.5), Some(50.0));
        assert_eq!(quantile(&mut s, 0.99), Some(99.0));
        assert_eq!(quantile(&mut s, 1.0), Some(100.0));
        assert_eq!(quantile(&mut s, 0.0), Some(1.0));
        assert_eq!(quantile(&mut [], 0.5), None);
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }
}
