//! Prometheus histograms and counters read from a router's `/metrics` text, added up over
//! replicas and differenced over a measurement window.

use anyhow::Result;

/// Cumulative counts per upper bound (`le`), sorted by bound; `+Inf` last.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Buckets(pub Vec<(f64, f64)>);

impl Buckets {
    /// The histogram `name` (without `_bucket`) in an exposition; empty when absent.
    pub fn parse(text: &str, name: &str) -> Result<Buckets> {
        let bucket = format!("{name}_bucket");
        let mut out = Vec::new();
        for s in kvsight_sidecar::scrape::samples(text)? {
            if s.name == bucket
                && let Some(le) = s.labels.get("le")
            {
                out.push((le.parse().unwrap_or(f64::INFINITY), s.value));
            }
        }
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(Buckets(out))
    }

    /// Bucket-wise sum (replicas share bucket bounds).
    pub fn add(&self, other: &Buckets) -> Buckets {
        if self.0.is_empty() {
            return other.clone();
        }
        Buckets(
            self.0
                .iter()
                .map(|&(le, c)| (le, c + other.count_at(le)))
                .collect(),
        )
    }

    /// What was counted since `before`.
    pub fn since(&self, before: &Buckets) -> Buckets {
        Buckets(
            self.0
                .iter()
                .map(|&(le, c)| (le, c - before.count_at(le)))
                .collect(),
        )
    }

    fn count_at(&self, le: f64) -> f64 {
        self.0.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1)
    }

    /// Observations counted.
    pub fn total(&self) -> f64 {
        self.0.last().map_or(0.0, |b| b.1)
    }

    /// The `q` quantile, linear within its bucket as Prometheus' `histogram_quantile`; the
    /// largest finite bound when it lies in `+Inf`; `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.total();
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for &(le, c) in &self.0 {
            if c >= rank {
                if !le.is_finite() {
                    return Some(lower.0);
                }
                let span = c - lower.1;
                let frac = if span > 0.0 {
                    (rank - lower.1) / span
                } else {
                    1.0
                };
                return Some(lower.0 + (le - lower.0) * frac);
            }
            lower = (le, c);
        }
        Some(lower.0)
    }
}

/// Sum of every sample of counter `name` (all label sets) in an exposition.
pub fn counter(text: &str, name: &str) -> Result<f64> {
    Ok(kvsight_sidecar::scrape::samples(text)?
        .iter()
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .sum())
}

/// Sum of the samples of counter `name` whose label `key` is `value`.
pub fn counter_with(text: &str, name: &str, key: &str, value: &str) -> Result<f64> {
    Ok(kvsight_sidecar::scrape::samples(text)?
        .iter()
        .filter(|s| s.name == name && s.labels.get(key).is_some_and(|v| v == value))
        .map(|s| s.value)
        .sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# TYPE h histogram\n\
        h_bucket{le=\"0.001\"} 50\n\
        h_bucket{le=\"0.002\"} 90\n\
        h_bucket{le=\"0.004\"} 100\n\
        h_bucket{le=\"+Inf\"} 100\n\
        h_sum 0.1\n\
        h_count 100\n";

    #[test]
    fn quantiles_interpolate_within_the_bucket() {
        let b = Buckets::parse(TEXT, "h").unwrap();
        assert_eq!(b.total(), 100.0);
        assert!((b.quantile(0.5).unwrap() - 0.001).abs() < 1e-12);
        // rank 99 lies 9/10 of the way through the (0.002, 0.004] bucket
        assert!((b.quantile(0.99).unwrap() - 0.0038).abs() < 1e-12);
    }

    #[test]
    fn replicas_add_up_and_windows_difference() {
        let b = Buckets::parse(TEXT, "h").unwrap();
        let two = Buckets::default().add(&b).add(&b);
        assert_eq!(two.total(), 200.0);
        assert_eq!(two.since(&b), b);
        assert_eq!(b.since(&b).quantile(0.5), None);
    }
}
