//! Tensors: allocation (host memory standing in for device memory, counted against the
//! NeuronCore's HBM and filled with [`FILL_BYTE`]), slices that share their source's storage,
//! freeing, and the byte windows that reads and writes go through.

use std::sync::{Arc, Mutex};

use neuron_sys::sys::{self, nrt_tensor_placement_t};

use crate::fail::{Fail, Res};
use crate::handle::{Handle, Kind};
use crate::identity::nc_count;
use crate::state::{lock_bytes, release_hbm, reserve_hbm, state, Storage, TensorEntry};

/// What every byte of a fresh allocation holds until it is written: real device memory is not
/// cleared by the allocator, so a read of never-written memory must not see zeros. `0xFF` makes
/// an f32 or bf16 a NaN, an i32 -1 and a u32 `u32::MAX`: an uninitialised value poisons the
/// arithmetic or fails an index check instead of passing for a plausible zero.
pub const FILL_BYTE: u8 = 0xFF;

/// `offset .. offset + len` within `0 .. size`, or `NRT_INVALID` naming the range.
fn check_range(what: &str, offset: usize, len: usize, size: usize) -> Res<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Fail::invalid(format!(
            "{what}: bytes {offset}..{} are outside the tensor's {size} bytes",
            offset as u128 + len as u128
        ))),
    }
}

/// Allocates `size` bytes filled with [`FILL_BYTE`]. Device placement needs a visible core and
/// room in its HBM (`NRT_SIM_HBM_BYTES`, else `NRT_RESOURCE`, as libnrt answers an allocation
/// past a core's memory); host and virtual placements ignore `vnc`; another placement is
/// `NRT_INVALID`. Out of host memory is `NRT_RESOURCE`. The name (empty if none) keys the byte
/// counters.
pub(crate) fn allocate(
    placement: nrt_tensor_placement_t,
    vnc: i32,
    size: usize,
    name: Option<String>,
) -> Res<Handle> {
    match placement {
        sys::NRT_TENSOR_PLACEMENT_DEVICE => {
            if vnc < 0 || vnc as u32 >= nc_count() {
                return Err(Fail::invalid(format!(
                    "device tensor on NeuronCore {vnc}; {} are visible",
                    nc_count()
                )));
            }
        }
        sys::NRT_TENSOR_PLACEMENT_HOST | sys::NRT_TENSOR_PLACEMENT_VIRTUAL => {}
        other => return Err(Fail::invalid(format!("unknown placement {other}"))),
    }
    let capacity = {
        let st = state();
        st.require_running("nrt_tensor_allocate")?;
        st.config.hbm_bytes
    };
    let device =
        (placement == sys::NRT_TENSOR_PLACEMENT_DEVICE).then_some((vnc as u32, size as u64));
    if let Some((core, bytes)) = device {
        reserve_hbm(core, bytes, capacity).map_err(|used| {
            Fail::new(
                sys::NRT_RESOURCE,
                format!(
                    "cannot allocate {size} bytes on NeuronCore {core}: {used} of its {capacity} \
                     bytes of device memory are in use (NRT_SIM_HBM_BYTES)"
                ),
            )
        })?;
    }
    // Filled without the lock: a large allocation takes a while.
    let mut bytes = Vec::new();
    if bytes.try_reserve_exact(size).is_err() {
        if let Some((core, n)) = device {
            release_hbm(core, n);
        }
        return Err(Fail::new(
            sys::NRT_RESOURCE,
            format!("cannot allocate {size} bytes of host memory"),
        ));
    }
    bytes.resize(size, FILL_BYTE);
    let entry = TensorEntry {
        storage: Arc::new(Storage {
            bytes: Mutex::new(bytes),
            device,
        }),
        offset: 0,
        size,
        name: name.unwrap_or_default(),
        placement,
    };
    let mut st = state();
    st.require_running("nrt_tensor_allocate")?;
    let h = st
        .tensors
        .insert(entry)
        .ok_or_else(|| Fail::new(sys::NRT_RESOURCE, "too many tensors"))?;
    st.stats.total_bytes_allocated += size as u64;
    st.stats.tensors_allocated += 1;
    Ok(h)
}

/// A view of bytes `offset .. offset + size` of `source`, sharing its storage. A range
/// outside the source is `NRT_INVALID`. Without a name, the slice is named
/// `parent[start..end]`.
pub(crate) fn slice(
    source: Handle,
    offset: usize,
    size: usize,
    name: Option<String>,
) -> Res<Handle> {
    let mut st = state();
    st.require_running("nrt_tensor_allocate_slice")?;
    let src = st.tensor("tensor_source", source)?;
    check_range("slice", offset, size, src.size)?;
    let entry = TensorEntry {
        storage: Arc::clone(&src.storage),
        offset: src.offset + offset,
        size,
        name: name.unwrap_or_else(|| format!("{}[{offset}..{}]", src.name, offset + size)),
        placement: src.placement,
    };
    st.tensors
        .insert(entry)
        .ok_or_else(|| Fail::new(sys::NRT_RESOURCE, "too many tensors"))
}

/// Frees the tensor `*tensor` names; its handle goes stale (a second free is
/// `NRT_INVALID_HANDLE`). The storage outlives it while slices view it.
pub(crate) fn free(tensor: Handle) -> Res<()> {
    let mut st = state();
    st.require_running("nrt_tensor_free")?;
    let entry = st
        .tensors
        .remove(tensor)
        .map_err(|why| Fail::handle("*tensor", Kind::Tensor, why))?;
    // The storage (if this was its last view) is freed after the lock is released.
    drop(st);
    drop(entry);
    Ok(())
}

/// The tensor's size in bytes.
pub(crate) fn size(tensor: Handle) -> Res<usize> {
    let st = state();
    st.require_running("nrt_tensor_get_size")?;
    Ok(st.tensor("tensor", tensor)?.size)
}

/// Which way bytes move through a [`Window`]; each is counted under the tensor's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Io {
    /// `nrt_tensor_read` (counted in `tensor_bytes_read`).
    Read,
    /// `nrt_tensor_write` (counted in `tensor_bytes_written`).
    Write,
    /// `nrt_tensor_memset`: set on the device, no bytes cross the bus (not counted).
    Fill,
}

/// A checked byte range of one tensor's storage, for one read or write. It holds the
/// storage, not the state, so the copy runs without the state lock.
pub(crate) struct Window {
    storage: Arc<Storage>,
    start: usize,
    len: usize,
}

impl Window {
    /// Resolves bytes `offset .. offset + size` of `tensor` for `call` (out of range is
    /// `NRT_INVALID`, a freed tensor `NRT_INVALID_HANDLE`) and counts them.
    pub(crate) fn open(
        call: &str,
        tensor: Handle,
        offset: usize,
        size: usize,
        io: Io,
    ) -> Res<Self> {
        let mut st = state();
        st.require_running(call)?;
        let t = st.tensor("tensor", tensor)?;
        check_range(call, offset, size, t.size)?;
        let (storage, start, name) = (Arc::clone(&t.storage), t.offset + offset, t.name.clone());
        let map = match io {
            Io::Read => Some(&mut st.stats.bytes_read),
            Io::Write => Some(&mut st.stats.bytes_written),
            Io::Fill => None,
        };
        if let Some(map) = map {
            *map.entry(name).or_default() += size as u64;
        }
        Ok(Window {
            storage,
            start,
            len: size,
        })
    }

    /// Runs `f` on the window's bytes, with the storage locked.
    pub(crate) fn with_bytes<T>(&self, f: impl FnOnce(&[u8]) -> T) -> T {
        f(&lock_bytes(&self.storage)[self.start..self.start + self.len])
    }

    /// Runs `f` on the window's bytes, mutably, with the storage locked.
    pub(crate) fn with_bytes_mut<T>(&self, f: impl FnOnce(&mut [u8]) -> T) -> T {
        f(&mut lock_bytes(&self.storage)[self.start..self.start + self.len])
    }
}
