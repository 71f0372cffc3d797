//! Collectives on the CPU: the ranks of a tensor-parallel group are threads of one process,
//! and a collective is a meeting of those threads.
//!
//! Each rank runs the same graph on its own thread with its own [`RankComm`]. At an
//! `all_reduce` or `all_gather` every rank leaves its part in the [`Group`] and waits until all
//! ranks have; each then combines all parts itself, in rank order, so every rank computes
//! bit-identical results whatever order they arrived in. The next collective cannot start
//! until every rank has read the parts of this one.
//!
//! A rank that fails (an error in its graph, an injected fault, a lost thread) calls
//! [`RankComm::fail`]: every rank waiting in, or arriving at, a collective of that same step
//! gets an error instead of waiting forever, and the next step starts clean. A rank that never
//! arrives is caught by the group's timeout, which fails the step the same way. This is how
//! "the step fails on every rank if it fails on one, within a bounded time" is kept.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Tensor as CTensor;

use crate::error::{Error, Result};
use crate::graph::ReduceOp;

/// How long a rank waits at a collective for the others before the step fails, unless the
/// group is made with another timeout. Long enough for a slow first step of a large graph on
/// the CPU, short enough that a lost rank is reported rather than hung on.
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

/// The meeting place of one tensor-parallel group's ranks.
#[derive(Debug)]
pub struct Group {
    size: usize,
    timeout: Duration,
    state: Mutex<Meeting>,
    changed: Condvar,
}

/// One collective in progress, and the step that failed, if any.
#[derive(Debug, Default)]
struct Meeting {
    /// The step the meeting in progress belongs to (set by its first arrival).
    step: Option<u64>,
    /// Each rank's part, once it has arrived.
    parts: Vec<Option<CTensor>>,
    /// Ranks that have left their part.
    arrived: usize,
    /// Whether every rank has arrived (parts may be read; no new part may be left).
    complete: bool,
    /// Ranks that have read the parts of a complete meeting.
    left: usize,
    /// The most recent failed step and why it failed.
    failed: Option<(u64, String)>,
}

impl Meeting {
    fn clear(&mut self) {
        self.step = None;
        self.parts.iter_mut().for_each(|p| *p = None);
        self.arrived = 0;
        self.complete = false;
        self.left = 0;
    }
}

impl Group {
    /// A group of `size` ranks whose collectives give up after `timeout`.
    pub fn new(size: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Group {
            size,
            timeout,
            state: Mutex::new(Meeting {
                parts: vec![None; size],
                ..Meeting::default()
            }),
            changed: Condvar::new(),
        })
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The handle rank `rank` runs its graphs with.
    pub fn rank(self: &Arc<Self>, rank: usize) -> Result<RankComm> {
        if rank >= self.size {
            return Err(Error::Internal(format!(
                "rank {rank} of a group of {}",
                self.size
            )));
        }
        Ok(RankComm {
            group: Arc::clone(self),
            rank,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Meeting> {
        // A rank that panicked while holding the lock left the meeting half-updated; the step
        // it was in fails through `failed` or the timeout, so the state itself is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records that `step` failed (on `rank`, for `why`) and wakes every waiting rank.
    fn fail(&self, step: u64, rank: usize, why: &str) {
        let mut m = self.lock();
        if m.failed.as_ref().is_none_or(|(s, _)| *s < step) {
            m.failed = Some((step, format!("rank {rank}: {why}")));
        }
        // Only this step's meeting is abandoned: a rank that already finished the step may
        // have arrived at the next one.
        if m.step.is_none_or(|s| s == step) {
            m.clear();
        }
        self.changed.notify_all();
    }

    /// The error for a rank of `step` when that step has failed.
    fn failure(m: &Meeting, step: u64) -> Option<Error> {
        match &m.failed {
            Some((s, why)) if *s == step => Some(Error::Collective(format!(
                "the step failed on another rank ({why})"
            ))),
            _ => None,
        }
    }

    /// Leaves `part` for `rank` in `step` and returns every rank's part, in rank order, once all
    /// have arrived.
    fn exchange(&self, step: u64, rank: usize, part: CTensor) -> Result<Vec<CTensor>> {
        let deadline = Instant::now() + self.timeout;
        let mut m = self.lock();
        // Wait for the previous meeting to be read by everyone.
        while m.complete {
            m = self.wait(m, step, rank, deadline)?;
        }
        if let Some(e) = Self::failure(&m, step) {
            return Err(e);
        }
        match m.step {
            Some(s) if s != step => {
                return Err(Error::Collective(format!(
                    "rank {rank} is at step {step} but the group's collective is of step {s}"
                )))
            }
            _ => m.step = Some(step),
        }
        m.parts[rank] = Some(part);
        m.arrived += 1;
        if m.arrived == self.size {
            m.complete = true;
            self.changed.notify_all();
        }
        while !m.complete {
            m = self.wait(m, step, rank, deadline)?;
        }
        let parts = m.parts.iter().flatten().cloned().collect::<Vec<_>>();
        m.left += 1;
        if m.left == self.size {
            m.clear();
            self.changed.notify_all();
        }
        Ok(parts)
    }

    /// Waits for a change; fails when `step` has failed or the deadline passes (which fails
    /// the step for every rank).
    fn wait<'a>(
        &'a self,
        m: MutexGuard<'a, Meeting>,
        step: u64,
        rank: usize,
        deadline: Instant,
    ) -> Result<MutexGuard<'a, Meeting>> {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (0..self.size).filter(|&r| m.parts[r].is_none()).collect();
            drop(m);
            let why = format!(
                "waited {:?} at a collective for ranks {missing:?}",
                self.timeout
            );
            self.fail(step, rank, &why);
            return Err(Error::Collective(format!("rank {rank} {why}")));
        }
        let (m, _) = self
            .changed
            .wait_timeout(m, deadline - now)
            .unwrap_or_else(|e| e.into_inner());
        if let Some(e) = Self::failure(&m, step) {
            return Err(e);
        }
        Ok(m)
    }
}

/// One rank's handle on its group: what a graph with collectives is run with.
#[derive(Debug, Clone)]
pub struct RankComm {
    group: Arc<Group>,
    rank: usize,
}

impl RankComm {
    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        self.group.size
    }

    /// The group this rank meets in (another rank of it joins with `group().rank(r)`).
    pub fn group(&self) -> &Arc<Group> {
        &self.group
    }

    /// Fails `step` on every rank (those waiting now and those still to arrive).
    pub fn fail(&self, step: u64, why: &str) {
        self.group.fail(step, self.rank, why);
    }

    /// The elementwise `op` of every rank's `x`, combined in rank order.
    pub fn all_reduce(&self, step: u64, x: &CTensor, op: ReduceOp) -> Result<CTensor> {
        let parts = self.group.exchange(step, self.rank, x.clone())?;
        let mut acc = parts[0].clone();
        for p in &parts[1..] {
            acc = match op {
                ReduceOp::Sum => acc.add(p)?,
                ReduceOp::Max => acc.maximum(p)?,
                ReduceOp::Min => acc.minimum(p)?,
            };
        }
        Ok(acc)
    }

    /// Every rank's `x` joined along `dim`, in rank order.
    pub fn all_gather(&self, step: u64, x: &CTensor, dim: usize) -> Result<CTensor> {
        let parts = self.group.exchange(step, self.rank, x.clone())?;
        Ok(CTensor::cat(&parts, dim)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn run_ranks<T: Send>(n: usize, f: impl Fn(RankComm) -> T + Sync) -> Vec<T> {
        let group = Group::new(n, Duration::from_secs(5));
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let comm = group.rank(r).expect("rank");
                    let f = &f;
                    s.spawn(move || f(comm))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("join")).collect()
        })
    }

    #[test]
    fn every_rank_gets_the_sum_and_the_gather_in_rank_order() {
        let out = run_ranks(4, |c| {
            let x = CTensor::new(&[c.rank() as f32, 10.0], &Device::Cpu).expect("x");
            let mut sums = Vec::new();
            // Many rounds back to back: a fast rank must not overwrite a round still being read.
            for step in 0..50 {
                let s = c.all_reduce(step, &x, ReduceOp::Sum).expect("sum");
                sums.push(s.to_vec1::<f32>().expect("vec"));
            }
            let g = c.all_gather(50, &x, 0).expect("gather");
            (sums, g.to_vec1::<f32>().expect("vec"))
        });
        for (sums, g) in out {
            assert!(sums.iter().all(|s| s == &[6.0, 40.0]));
            assert_eq!(g, [0.0, 10.0, 1.0, 10.0, 2.0, 10.0, 3.0, 10.0]);
        }
    }

    #[test]
    fn a_failed_rank_fails_the_step_everywhere_and_the_next_step_works() {
        let out = run_ranks(3, |c| {
            let x = CTensor::new(&[1f32], &Device::Cpu).expect("x");
            let first = if c.rank() == 1 {
                c.fail(0, "injected");
                Err(Error::Collective("injected here".into()))
            } else {
                c.all_reduce(0, &x, ReduceOp::Sum)
            };
            let second = c.all_reduce(1, &x, ReduceOp::Sum).expect("next step");
            (first.is_err(), second.to_vec1::<f32>().expect("vec"))
        });
        for (failed, second) in out {
            assert!(failed);
            assert_eq!(second, [3.0]);
        }
    }

    #[test]
    fn a_missing_rank_times_out_instead_of_hanging() {
        let group = Group::new(2, Duration::from_millis(200));
        let c = group.rank(0).expect("rank");
        let x = CTensor::new(&[1f32], &Device::Cpu).expect("x");
        let err = c.all_reduce(0, &x, ReduceOp::Sum).expect_err("times out");
        assert!(err.to_string().contains("ranks [1]"), "{err}");
    }
}
