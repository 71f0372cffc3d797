//! The collectives bootstrap of `nrt_load_collectives`: a rank's load returns only once every
//! rank of its group has entered the load of the same model.
//!
//! libnrt creates its global communicator inside `nrt_load_collectives` when none exists yet
//! (`nrt.h`: "if the global communicator does not exist, it will be created"), a bootstrap that,
//! like NCCL's, needs every rank of the group present: a process that loads its ranks one after
//! another on one thread waits in rank 0's load for a rank 1 that never comes
//! (aws-neuron-sdk#699 is such a hang). nrt-sim holds every collectives load the same way,
//! per model (the graph's name) and device count, so a runner that loads its ranks serially
//! fails here exactly as it would hang on a trn1, only with a bounded wait: after
//! `NRT_SIM_COLLECTIVE_TIMEOUT_MS` the waiting ranks fail with `NRT_TIMEOUT`, naming the ranks
//! that never arrived and the root communicator's address, as an NCCL-style bootstrap reports
//! a peer that never connected.
//!
//! Holding every load, not only the first (which creates the communicator), is the stricter
//! reading: if libnrt sets up per-model collective resources without a rendezvous, a runner
//! that passes here still works there; the converse would not hold.
//!
//! The meetings live outside the runtime's state lock: a rank waits here for seconds, and the
//! other ranks' calls (their weight uploads included) must go on meanwhile.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use neuron_sys::sys;

use crate::fail::{Fail, Res};
use crate::model::ENV_ROOT_COMM_ID;

/// The ranks of one bootstrap.
struct Meeting {
    /// Tells this meeting from a later one of the same model (a capture after a destroy).
    id: u64,
    /// The ranks waiting in it now.
    present: BTreeSet<u32>,
    /// Every rank that has entered it, including those that have given up since: the ones a
    /// timeout names as missing are those that never came.
    entered: BTreeSet<u32>,
}

/// Every bootstrap in progress, by (model name, device count). A meeting leaves the map when
/// its last rank arrives, or when every rank that came has given up.
struct Meetings {
    open: Mutex<HashMap<(String, u32), Meeting>>,
    changed: Condvar,
}

static MEETINGS: LazyLock<Meetings> = LazyLock::new(|| Meetings {
    open: Mutex::new(HashMap::new()),
    changed: Condvar::new(),
});

static NEXT_MEETING: AtomicU64 = AtomicU64::new(0);

/// Waits until all `device_count` ranks have entered the load of model `name`, at most
/// `timeout`. Device `device_id` entering twice while the first is still waiting is
/// `NRT_INVALID`; the ranks still missing at the timeout are `NRT_TIMEOUT`.
pub(crate) fn wait_for_every_rank(
    name: &str,
    device_id: u32,
    device_count: u32,
    timeout: Duration,
) -> Res<()> {
    let m = &*MEETINGS;
    let key = (name.to_string(), device_count);
    let mut open = m.open.lock().unwrap_or_else(PoisonError::into_inner);
    let meeting = open.entry(key.clone()).or_insert_with(|| Meeting {
        id: NEXT_MEETING.fetch_add(1, Ordering::Relaxed),
        present: BTreeSet::new(),
        entered: BTreeSet::new(),
    });
    if !meeting.present.insert(device_id) {
        return Err(Fail::invalid(format!(
            "model `{name}`: device {device_id} of {device_count} is already loading it"
        )));
    }
    meeting.entered.insert(device_id);
    let mine = meeting.id;
    if meeting.present.len() == device_count as usize {
        open.remove(&key);
        m.changed.notify_all();
        return Ok(());
    }
    let deadline = Instant::now() + timeout;
    loop {
        let waiting = open.get(&key).filter(|w| w.id == mine);
        let Some(waiting) = waiting else {
            return Ok(()); // the last rank arrived and closed the meeting
        };
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<String> = (0..device_count)
                .filter(|d| !waiting.entered.contains(d))
                .map(|d| d.to_string())
                .collect();
            let root = std::env::var(ENV_ROOT_COMM_ID).unwrap_or_default();
            let left = open.get_mut(&key).map(|w| {
                w.present.remove(&device_id);
                w.present.is_empty()
            });
            if left == Some(true) {
                open.remove(&key);
            }
            return Err(Fail::new(
                sys::NRT_TIMEOUT,
                format!(
                    "model `{name}`: device {device_id} of {device_count} waited {} ms in the \
                     collectives bootstrap ({ENV_ROOT_COMM_ID}={root}) for device(s) {} that \
                     never entered nrt_load_collectives (every rank must load concurrently, \
                     each on its own thread or process)",
                    timeout.as_millis(),
                    missing.join(", ")
                ),
            ));
        }
        open = m
            .changed
            .wait_timeout(open, deadline - now)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}
