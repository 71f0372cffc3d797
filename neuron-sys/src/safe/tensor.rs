//! [`Tensor`] (device or host memory, and zero-copy slices of it) and [`TensorSet`].

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::safe::runtime::Runtime;
use crate::sys;

/// Where a tensor's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Device (HBM) memory of one NeuronCore: what graphs read and write.
    Device,
    /// DMA-able host memory (deprecated by AWS; at most 4 MB).
    Host,
    /// Host virtual memory (legacy; Inferentia v1).
    Virtual,
}

impl Placement {
    /// The `nrt_tensor_placement_t` value.
    pub fn raw(self) -> sys::nrt_tensor_placement_t {
        match self {
            Placement::Device => sys::NRT_TENSOR_PLACEMENT_DEVICE,
            Placement::Host => sys::NRT_TENSOR_PLACEMENT_HOST,
            Placement::Virtual => sys::NRT_TENSOR_PLACEMENT_VIRTUAL,
        }
    }
}

/// Turns a name into a C string, rejecting interior NULs.
pub(crate) fn c_name(call: &'static str, name: &str) -> Result<CString> {
    CString::new(name)
        .map_err(|_| Error::invalid(call, format!("name {name:?} contains a NUL byte")))
}

/// `offset .. offset + len` must lie within `0 .. size`.
fn check_range(call: &'static str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::invalid(
            call,
            format!(
                "bytes {offset}..{} are outside the tensor's {size} bytes",
                offset as u128 + len as u128
            ),
        )),
    }
}

struct TensorInner {
    ptr: NonNull<sys::nrt_tensor_t>,
    size: usize,
    name: String,
    placement: Placement,
    nc: i32,
    /// For a slice: the tensor it views and the byte offset into it. Keeps the parent
    /// alive for as long as the slice exists.
    parent: Option<(Tensor, usize)>,
    rt: Runtime,
}

// SAFETY: an nrt_tensor_t is a heap object of libnrt with no thread affinity; libnrt's
// tensor calls may be made from any thread, and this handle is freed exactly once (Drop).
unsafe impl Send for TensorInner {}
// SAFETY: the shared (&self) operations are reads and writes of device or host memory
// through libnrt, which does its own synchronisation; no Rust reference to that memory is
// ever created, so concurrent use cannot break Rust's aliasing rules.
unsafe impl Sync for TensorInner {}

impl Drop for TensorInner {
    fn drop(&mut self) {
        let mut ptr = self.ptr.as_ptr();
        // SAFETY: `ptr` came from nrt_tensor_allocate(_slice) for this runtime, which is
        // still initialised (self.rt is alive), and it is freed exactly once, here. Any
        // tensor set holding it holds this TensorInner too, so no set still refers to it.
        // nrt_tensor_free returns nothing.
        unsafe { (self.rt.inner.lib.api().nrt_tensor_free)(&mut ptr) };
        // `parent` and `rt` are dropped after this body: a slice is freed before its
        // parent, and every tensor before nrt_close.
    }
}

/// A libnrt tensor: `size` bytes of device or host memory, or a zero-copy slice of another
/// tensor. Freed (`nrt_tensor_free`) when the last clone and every tensor set holding it
/// are dropped.
///
/// Cheap to clone (an `Arc`); clones are the same tensor. A tensor carries only a byte size:
/// dtype and shape belong to the model's I/O description ([`crate::ModelIo`]).
#[derive(Clone)]
pub struct Tensor {
    inner: Arc<TensorInner>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("name", &self.inner.name)
            .field("size", &self.inner.size)
            .field("placement", &self.inner.placement)
            .field("nc", &self.inner.nc)
            .field("offset_in_parent", &self.offset_in_parent())
            .finish()
    }
}

impl Tensor {
    /// Allocates `size` bytes with `nrt_tensor_allocate`.
    ///
    /// `nc` is the NeuronCore (relative to the visible set) for [`Placement::Device`]; it
    /// must be one of the runtime's cores. Host and virtual placements ignore it (libnrt
    /// takes `-1`). `name` is optional for libnrt and used only in its logs; binding to a
    /// model is by the name given to [`TensorSet::add`].
    pub fn allocate(
        rt: &Runtime,
        placement: Placement,
        nc: u32,
        size: usize,
        name: &str,
    ) -> Result<Tensor> {
        const CALL: &str = "nrt_tensor_allocate";
        let vnc: i32 = match placement {
            Placement::Device => {
                rt.check_nc(CALL, nc)?;
                i32::try_from(nc).map_err(|_| {
                    Error::invalid(CALL, format!("NeuronCore {nc} does not fit an int"))
                })?
            }
            Placement::Host | Placement::Virtual => -1,
        };
        let cname = c_name(CALL, name)?;
        let lib = &rt.inner.lib;
        let mut raw: *mut sys::nrt_tensor_t = ptr::null_mut();
        // SAFETY: placement is a valid enum value, `cname` is NUL-terminated and outlives the
        // call, and `raw` is a valid out-pointer. The runtime is initialised (rt is alive).
        let status = unsafe {
            (lib.api().nrt_tensor_allocate)(placement.raw(), vnc, size, cname.as_ptr(), &mut raw)
        };
        lib.check(CALL, status)?;
        let ptr = NonNull::new(raw).ok_or(Error::NullHandle { call: CALL })?;
        Ok(Self::own(rt, ptr, name, placement, vnc, None))
    }

    /// Allocates `size` bytes of device memory on NeuronCore `nc`.
    pub fn device(rt: &Runtime, nc: u32, size: usize, name: &str) -> Result<Tensor> {
        Self::allocate(rt, Placement::Device, nc, size, name)
    }

    /// Allocates `size` bytes of (DMA-able) host memory.
    pub fn host(rt: &Runtime, size: usize, name: &str) -> Result<Tensor> {
        Self::allocate(rt, Placement::Host, 0, size, name)
    }

    /// Takes ownership of a fresh handle. The size is the runtime's (`nrt_tensor_get_size`),
    /// so bounds checks use what libnrt actually allocated.
    fn own(
        rt: &Runtime,
        ptr: NonNull<sys::nrt_tensor_t>,
        name: &str,
        placement: Placement,
        nc: i32,
        parent: Option<(Tensor, usize)>,
    ) -> Tensor {
        // SAFETY: `ptr` is a live tensor just returned by libnrt.
        let size = unsafe { (rt.inner.lib.api().nrt_tensor_get_size)(ptr.as_ptr()) };
        Tensor {
            inner: Arc::new(TensorInner {
                ptr,
                size,
                name: name.to_string(),
                placement,
                nc,
                parent,
                rt: rt.clone(),
            }),
        }
    }

    /// A zero-copy view of bytes `offset .. offset + size` (`nrt_tensor_allocate_slice`).
    ///
    /// The slice shares the parent's storage and keeps the parent alive. Binding the first
    /// rows of a persistent buffer to a smaller graph is the intended use.
    pub fn slice(&self, offset: usize, size: usize) -> Result<Tensor> {
        const CALL: &str = "nrt_tensor_allocate_slice";
        check_range(CALL, offset, size, self.inner.size)?;
        let rt = &self.inner.rt;
        let lib = &rt.inner.lib;
        let f = lib
            .api()
            .nrt_tensor_allocate_slice
            .ok_or_else(|| lib.unsupported(CALL))?;
        let name = format!("{}[{offset}..{}]", self.inner.name, offset + size);
        let cname = c_name(CALL, &name)?;
        let mut raw: *mut sys::nrt_tensor_t = ptr::null_mut();
        // SAFETY: the source is a live tensor, the range was checked against its size,
        // `cname` outlives the call and `raw` is a valid out-pointer.
        let status = unsafe {
            f(
                self.inner.ptr.as_ptr(),
                offset,
                size,
                cname.as_ptr(),
                &mut raw,
            )
        };
        lib.check(CALL, status)?;
        let ptr = NonNull::new(raw).ok_or(Error::NullHandle { call: CALL })?;
        Ok(Self::own(
            rt,
            ptr,
            &name,
            self.inner.placement,
            self.inner.nc,
            Some((self.clone(), offset)),
        ))
    }

    /// Copies `data` into the tensor at byte `offset` (`nrt_tensor_write`, host to device).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        const CALL: &str = "nrt_tensor_write";
        check_range(CALL, offset, data.len(), self.inner.size)?;
        if data.is_empty() {
            return Ok(());
        }
        let lib = &self.inner.rt.inner.lib;
        // SAFETY: live tensor; `data` is valid for `data.len()` bytes of reads; the range
        // lies within the tensor.
        let status = unsafe {
            (lib.api().nrt_tensor_write)(
                self.inner.ptr.as_ptr(),
                data.as_ptr().cast::<c_void>(),
                offset,
                data.len(),
            )
        };
        lib.check(CALL, status)
    }

    /// Sets bytes `offset .. offset + len` of the tensor to `value` (`nrt_tensor_memset`).
    ///
    /// Done by the runtime where the tensor lives: zeroing a device buffer sends no bytes
    /// over the bus, where writing zeros from the host would send all of them (a KV-cache
    /// root of many GB per NeuronCore). A library without the symbol (older than runtime 2.0)
    /// is [`crate::Error::Unsupported`]; [`Tensor::fill_or_write`] falls back to writes.
    pub fn fill(&self, offset: usize, value: u8, len: usize) -> Result<()> {
        const CALL: &str = "nrt_tensor_memset";
        check_range(CALL, offset, len, self.inner.size)?;
        let lib = &self.inner.rt.inner.lib;
        let f = lib
            .api()
            .nrt_tensor_memset
            .ok_or_else(|| lib.unsupported(CALL))?;
        if len == 0 {
            return Ok(());
        }
        // SAFETY: live tensor; the range lies within it; no host memory is passed.
        let status = unsafe {
            f(
                self.inner.ptr.as_ptr(),
                offset as u64,
                std::os::raw::c_int::from(value),
                len,
            )
        };
        lib.check(CALL, status)
    }

    /// [`Tensor::fill`] where the library has `nrt_tensor_memset`, else writes of `value` from
    /// the host in pieces of at most 1 MiB (what every libnrt can do, at the bus's cost).
    pub fn fill_or_write(&self, offset: usize, value: u8, len: usize) -> Result<()> {
        if self.inner.rt.inner.lib.api().nrt_tensor_memset.is_some() {
            return self.fill(offset, value, len);
        }
        check_range("nrt_tensor_write", offset, len, self.inner.size)?;
        let piece = vec![value; len.min(1 << 20)];
        let mut at = offset;
        while at < offset + len {
            let n = piece.len().min(offset + len - at);
            self.write(at, &piece[..n])?;
            at += n;
        }
        Ok(())
    }

    /// Copies bytes `offset .. offset + buf.len()` of the tensor into `buf`
    /// (`nrt_tensor_read`, device to host).
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        const CALL: &str = "nrt_tensor_read";
        check_range(CALL, offset, buf.len(), self.inner.size)?;
        if buf.is_empty() {
            return Ok(());
        }
        let lib = &self.inner.rt.inner.lib;
        // SAFETY: live tensor; `buf` is valid for `buf.len()` bytes of writes and is not
        // aliased (it is a &mut); the range lies within the tensor.
        let status = unsafe {
            (lib.api().nrt_tensor_read)(
                self.inner.ptr.as_ptr(),
                buf.as_mut_ptr().cast::<c_void>(),
                offset,
                buf.len(),
            )
        };
        lib.check(CALL, status)
    }

    /// Reads `len` bytes at `offset` into a new vector.
    pub fn read_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        check_range("nrt_tensor_read", offset, len, self.inner.size)?;
        let mut buf = vec![0u8; len];
        self.read(offset, &mut buf)?;
        Ok(buf)
    }

    /// Size in bytes, as libnrt reports it.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The name given at allocation (for a slice: `parent[start..end]`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Where the memory lives.
    pub fn placement(&self) -> Placement {
        self.inner.placement
    }

    /// The NeuronCore of a device tensor; `-1` for host memory.
    pub fn nc(&self) -> i32 {
        self.inner.nc
    }

    /// For a slice, the tensor it views.
    pub fn parent(&self) -> Option<&Tensor> {
        self.inner.parent.as_ref().map(|(t, _)| t)
    }

    /// For a slice, its byte offset in the parent.
    pub fn offset_in_parent(&self) -> Option<usize> {
        self.inner.parent.as_ref().map(|(_, off)| *off)
    }

    /// Whether `other` is this same tensor (a clone), not merely equal bytes.
    pub fn same_as(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The runtime this tensor belongs to.
    pub fn runtime(&self) -> &Runtime {
        &self.inner.rt
    }

    /// The raw handle, for calls this crate does not wrap. It stays valid while `self`
    /// (or a clone, or a tensor set holding it) is alive; do not free it.
    pub fn as_raw(&self) -> *mut sys::nrt_tensor_t {
        self.inner.ptr.as_ptr()
    }
}

/// A name → tensor map handed to `nrt_execute` (`nrt_allocate_tensor_set`).
///
/// libnrt's set does not own its tensors and must not outlive them; this wrapper holds a
/// clone of every tensor added, so they live at least as long as the set. One tensor may
/// sit in several sets and under several names (an aliased KV-cache root is bound under its
/// input name in the input set and its output name in the output set).
pub struct TensorSet {
    ptr: NonNull<sys::nrt_tensor_set_t>,
    tensors: HashMap<String, Tensor>,
    rt: Runtime,
}

// SAFETY: a tensor set is a libnrt heap object with no thread affinity, destroyed exactly
// once (Drop); mutation goes through &mut self. Not Sync: concurrent lookups in libnrt's map
// are not documented to be safe.
unsafe impl Send for TensorSet {}

impl std::fmt::Debug for TensorSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&String> = self.tensors.keys().collect();
        names.sort();
        f.debug_struct("TensorSet").field("names", &names).finish()
    }
}

impl Drop for TensorSet {
    fn drop(&mut self) {
        let mut ptr = self.ptr.as_ptr();
        // SAFETY: the set came from nrt_allocate_tensor_set for this (still initialised)
        // runtime and is destroyed exactly once, here; nrt_destroy_tensor_set does not free
        // the tensors, which `self.tensors` releases after this body.
        unsafe { (self.rt.inner.lib.api().nrt_destroy_tensor_set)(&mut ptr) };
    }
}

impl TensorSet {
    /// An empty set (`nrt_allocate_tensor_set`).
    pub fn new(rt: &Runtime) -> Result<TensorSet> {
        const CALL: &str = "nrt_allocate_tensor_set";
        let lib = &rt.inner.lib;
        let mut raw: *mut sys::nrt_tensor_set_t = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the runtime is initialised.
        let status = unsafe { (lib.api().nrt_allocate_tensor_set)(&mut raw) };
        lib.check(CALL, status)?;
        let ptr = NonNull::new(raw).ok_or(Error::NullHandle { call: CALL })?;
        Ok(TensorSet {
            ptr,
            tensors: HashMap::new(),
            rt: rt.clone(),
        })
    }

    /// Binds `tensor` under `name` (`nrt_add_tensor_to_tensor_set`), replacing any tensor
    /// bound under that name. The set keeps `tensor` alive.
    pub fn add(&mut self, name: &str, tensor: &Tensor) -> Result<()> {
        const CALL: &str = "nrt_add_tensor_to_tensor_set";
        if !tensor.runtime().same_as(&self.rt) {
            return Err(Error::invalid(
                CALL,
                format!("tensor {:?} belongs to another runtime", tensor.name()),
            ));
        }
        let cname = c_name(CALL, name)?;
        let lib = &self.rt.inner.lib;
        // SAFETY: live set and tensor; `cname` is NUL-terminated (libnrt copies the key).
        // The tensor must outlive the set's reference to it: the clone stored below does
        // that, and it is stored only once libnrt has accepted it.
        let status = unsafe {
            (lib.api().nrt_add_tensor_to_tensor_set)(
                self.ptr.as_ptr(),
                cname.as_ptr(),
                tensor.as_raw(),
            )
        };
        lib.check(CALL, status)?;
        // Replacing drops the previous tensor only now that libnrt no longer refers to it.
        self.tensors.insert(name.to_string(), tensor.clone());
        Ok(())
    }

    /// The tensor bound under `name` (`nrt_get_tensor_from_tensor_set`), or `None`.
    pub fn get(&self, name: &str) -> Result<Option<Tensor>> {
        const CALL: &str = "nrt_get_tensor_from_tensor_set";
        let cname = c_name(CALL, name)?;
        let lib = &self.rt.inner.lib;
        let mut raw: *mut sys::nrt_tensor_t = ptr::null_mut();
        // SAFETY: live set; `cname` is NUL-terminated; `raw` is a valid out-pointer. The
        // returned handle is not owned (the set's entry is), and is only compared below.
        let status = unsafe {
            (lib.api().nrt_get_tensor_from_tensor_set)(self.ptr.as_ptr(), cname.as_ptr(), &mut raw)
        };
        let ours = self.tensors.get(name);
        match (status == sys::NRT_SUCCESS, ours) {
            (true, Some(t)) if t.as_raw() == raw => Ok(Some(t.clone())),
            (true, _) => Err(Error::invalid(
                CALL,
                format!(
                    "libnrt's set holds a different tensor under {name:?} than this wrapper added"
                ),
            )),
            // libnrt reports a missing name as a failure (NRT_FAILURE).
            (false, None) => Ok(None),
            (false, Some(_)) => lib.check(CALL, status).map(|()| None),
        }
    }

    /// Whether a tensor is bound under `name` (from this wrapper's record; no libnrt call).
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The names bound, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Number of names bound.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether nothing is bound.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The runtime this set belongs to.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    pub(crate) fn as_raw(&self) -> *mut sys::nrt_tensor_set_t {
        self.ptr.as_ptr()
    }
}
