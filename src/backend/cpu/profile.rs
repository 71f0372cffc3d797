//! Where a CPU step's time goes: wall time per op kind, summed over the steps run while
//! profiling is on (`deepinfer bench --profile`).
//!
//! Off by default, and then it costs one relaxed atomic load per node. On, each node is
//! timed on the thread that runs the graph (candle's CPU ops are synchronous, so a node's
//! time is its wall time, its own thread pool included) and the totals are kept per label:
//! the op's name, with the matmul split by the kernel that ran it, since that is where a
//! decode step spends most of its time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

static ON: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<Option<HashMap<&'static str, OpTime>>> = Mutex::new(None);

/// The time spent in one kind of op.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OpTime {
    /// Wall time, summed.
    pub total: Duration,
    /// Nodes run.
    pub count: u64,
}

/// Starts profiling (process-wide), clearing earlier totals.
pub fn start() {
    if let Ok(mut t) = TOTALS.lock() {
        *t = Some(HashMap::new());
    }
    ON.store(true, Ordering::Relaxed);
}

/// Stops profiling and returns the totals, the largest first.
pub fn stop() -> Vec<(&'static str, OpTime)> {
    ON.store(false, Ordering::Relaxed);
    let totals = TOTALS.lock().ok().and_then(|mut t| t.take());
    let mut v: Vec<_> = totals.unwrap_or_default().into_iter().collect();
    v.sort_by(|a, b| b.1.total.cmp(&a.1.total).then(a.0.cmp(b.0)));
    v
}

/// Whether nodes are being timed.
pub(crate) fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Adds one node's time under `label`.
pub(crate) fn record(label: &'static str, took: Duration) {
    if let Ok(mut t) = TOTALS.lock() {
        if let Some(map) = t.as_mut() {
            let e = map.entry(label).or_default();
            e.total += took;
            e.count += 1;
        }
    }
}
