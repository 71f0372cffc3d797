//! What a decode step costs at each row count, as the CPU runner measured it.
//!
//! On a CPU a decode step's time grows with its rows (the default model's 32-row step costs
//! about 7 times its 1-row step), so a request with many choices in the same step slows every
//! other request's tokens. The scheduler's fair decoding asks [`super::Runner::decode_cost`]
//! how much, to bound it (`engine::scheduler`, "Fairness"). A NeuronCore reads the weights
//! once per step whatever its rows, and its runner reports nothing.
//!
//! Each row count keeps a moving average of its steps' times, so it follows the cost as the
//! contexts grow and the machine's load changes. A step is counted at no more than
//! [`OUTLIER_CAP`] times what was expected of it (its count's average, or the line between
//! measured counts around it): on a shared machine one step now and then takes ten times its
//! usual time (another process ran), and taken whole it would tell the scheduler for several
//! steps that larger steps cost little more. A count never run is estimated from its
//! neighbours: between two measured counts, on the line through them; beyond the largest, the
//! largest's cost (the step, once run, is measured); below the smallest, the smallest's cost
//! scaled down in proportion to the rows (no fixed part assumed: the estimate errs low, so a
//! bound computed from it errs strict, until the smaller count has been run).

use std::time::Duration;

/// Weight of a new step's time in its row count's moving average: about the last eight steps
/// count, so a change of load shows within a few steps while one slow step moves it little.
const NEW_STEP_WEIGHT: f64 = 0.25;

/// At most how many times the expected time a step's time counts as (see the module docs).
const OUTLIER_CAP: f64 = 2.0;

/// Moving averages of decode step times, by row count.
#[derive(Debug, Default, Clone)]
pub struct DecodeCosts {
    /// Seconds, index = rows; `None` where no step of that many rows has run.
    seconds: Vec<Option<f64>>,
}

impl DecodeCosts {
    /// Records that a decode step of `rows` rows took `took`.
    pub fn record(&mut self, rows: usize, took: Duration) {
        if rows == 0 {
            return;
        }
        if self.seconds.len() <= rows {
            self.seconds.resize(rows + 1, None);
        }
        // Only a count measured or between measured counts has an expectation to cap by.
        let cap = match self.expected(rows) {
            Some((seconds, true)) => seconds * OUTLIER_CAP,
            _ => f64::INFINITY,
        };
        let now = took.as_secs_f64().min(cap);
        let slot = &mut self.seconds[rows];
        *slot = Some(match *slot {
            Some(avg) => avg + NEW_STEP_WEIGHT * (now - avg),
            None => now,
        });
    }

    /// The expected time of a decode step of `rows` rows (see the module docs for counts never
    /// run); `None` before any step has been measured.
    pub fn estimate(&self, rows: usize) -> Option<Duration> {
        self.expected(rows)
            .map(|(seconds, _)| Duration::from_secs_f64(seconds.max(0.0)))
    }

    /// The expected seconds of `rows` rows, and whether measured counts lie on both sides of
    /// it (its own average, or the line between its nearest measured neighbours) rather than
    /// on one side only (extrapolated).
    fn expected(&self, rows: usize) -> Option<(f64, bool)> {
        let measured = |r: usize| self.seconds.get(r).copied().flatten().map(|s| (r, s));
        let below = (1..=rows.min(self.seconds.len().saturating_sub(1)))
            .rev()
            .find_map(measured);
        let above = (rows.max(1)..self.seconds.len()).find_map(measured);
        match (below, above) {
            (Some((lo, a)), Some((hi, b))) if hi > lo => {
                Some((a + (b - a) * (rows - lo) as f64 / (hi - lo) as f64, true))
            }
            // `rows` itself measured.
            (Some((_, a)), Some(_)) => Some((a, true)),
            (Some((_, a)), None) => Some((a, false)),
            (None, Some((hi, b))) => Some((b * rows as f64 / hi as f64, false)),
            (None, None) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: f64) -> Duration {
        Duration::from_secs_f64(ms / 1e3)
    }

    /// Whether the estimate for `rows` is `want` ms, to the nanosecond a `Duration` holds.
    fn estimates(costs: &DecodeCosts, rows: usize, want: f64) -> bool {
        let got = costs.estimate(rows).expect("measured").as_secs_f64() * 1e3;
        (got - want).abs() < 1e-6
    }

    #[test]
    fn nothing_measured_means_no_estimate() {
        let costs = DecodeCosts::default();
        assert_eq!(costs.estimate(4), None);
    }

    #[test]
    fn measured_counts_average_and_others_interpolate() {
        let mut costs = DecodeCosts::default();
        costs.record(2, ms(2.0));
        costs.record(10, ms(6.0));
        // A second 10-row step moves the average a quarter of the way.
        costs.record(10, ms(10.0));
        assert!(estimates(&costs, 10, 7.0));
        assert!(estimates(&costs, 2, 2.0));
        // On the line from (2, 2 ms) to (10, 7 ms).
        assert!(estimates(&costs, 6, 4.5));
        // Beyond the largest count: its cost; below the smallest: scaled by the rows.
        assert!(estimates(&costs, 32, 7.0));
        assert!(estimates(&costs, 1, 1.0));
        // A step of no rows is not a measurement.
        costs.record(0, ms(100.0));
        assert!(estimates(&costs, 1, 1.0));
    }

    #[test]
    fn a_step_counts_at_most_twice_what_was_expected() {
        let mut costs = DecodeCosts::default();
        costs.record(1, ms(1.0));
        costs.record(8, ms(4.0));
        // A stalled 8-row step counts as 8 ms: the average moves from 4 to 5, not to 27.
        costs.record(8, ms(96.0));
        assert!(estimates(&costs, 8, 5.0));
        // A first 4-row step is capped at twice the 2.71 ms on the line from 1 to 8 rows ...
        costs.record(4, ms(50.0));
        let expected = 1.0 + 4.0 * 3.0 / 7.0;
        assert!(estimates(&costs, 4, 2.0 * expected));
        // ... but a first step beyond every measured count is taken whole.
        costs.record(32, ms(20.0));
        assert!(estimates(&costs, 32, 20.0));
    }
}
