//! Parallel loops of the CPU backend's own kernels, on candle-core's CPU thread pool.
//!
//! candle's CPU ops (elementwise maps, its quantized matmuls) run on its own barrier pool, whose
//! idle workers spin for a while before they sleep. Kernels of ours on a second pool (rayon's)
//! would then contend with them for the same cores: on a two-core machine a rayon task waited
//! for a spinning candle worker, and moving the widening matmuls here made MLA's absorbed
//! attention matmuls twice as fast (benches/README.md). Both loops here hand out their items
//! through the pool's shared cursor, and each item's output is its own (a mutex per item, never
//! contended), so no `unsafe` is needed.

use std::sync::Mutex;

/// Sets `RAYON_NUM_THREADS` to the machine's parallelism unless the user set it. candle-core
/// asks for its thread count on every matrix product, and without the variable that means
/// parsing `/proc/cpuinfo` each time (several percent of a decode step); set once, before any
/// thread starts, the answer is an env lookup. The binary and the benches call it first thing.
pub fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// Runs `task(scratch, i, chunk)` for every `size`-long chunk of `out` on candle's CPU thread
/// pool, with a `scratch` made by `init` once per run of chunks a thread takes (not per chunk).
pub(crate) fn for_each_chunk<T: Send, S>(
    out: &mut [T],
    size: usize,
    init: impl Fn() -> S + Sync,
    task: impl Fn(&mut S, usize, &mut [T]) + Sync,
) {
    let chunks: Vec<Mutex<&mut [T]>> = out.chunks_mut(size.max(1)).map(Mutex::new).collect();
    candle_core::utils::barrier_pool().execute_chunked(chunks.len(), |range| {
        let mut scratch = init();
        for i in range {
            // Each chunk is one task's alone: never contended, never poisoned.
            if let Ok(mut chunk) = chunks[i].lock() {
                task(&mut scratch, i, &mut chunk);
            }
        }
    });
}

/// `f(i)` for every `i` below `count`, computed on candle's CPU thread pool (see
/// [`for_each_chunk`]).
pub(crate) fn parallel_map<R: Send>(
    count: usize,
    f: impl Fn(usize) -> R + Sync,
) -> candle_core::Result<Vec<R>> {
    let slots: Vec<Mutex<Option<R>>> = (0..count).map(|_| Mutex::new(None)).collect();
    candle_core::utils::barrier_pool().execute_chunked(count, |range| {
        for i in range {
            let r = f(i);
            if let Ok(mut slot) = slots[i].lock() {
                *slot = Some(r);
            }
        }
    });
    slots
        .into_iter()
        .map(|s| s.into_inner().ok().flatten())
        .collect::<Option<Vec<R>>>()
        .ok_or_else(|| candle_core::Error::Msg("a parallel task did not finish".into()))
}
