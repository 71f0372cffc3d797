//! [`Model`] (a loaded NEFF), its I/O description, and [`execute`].

use std::ptr::{self, NonNull};

use crate::error::{Error, Result};
use crate::library::c_chars_to_string;
use crate::safe::runtime::Runtime;
use crate::safe::tensor::TensorSet;
use crate::sys;

/// Whether a NEFF tensor is read or written by the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorUsage {
    /// An input (`NRT_TENSOR_USAGE_INPUT`).
    Input,
    /// An output (`NRT_TENSOR_USAGE_OUTPUT`).
    Output,
    /// A value this crate does not know, kept raw.
    Other(u32),
}

impl TensorUsage {
    fn from_raw(raw: sys::nrt_tensor_usage_t) -> Self {
        match raw {
            sys::NRT_TENSOR_USAGE_INPUT => TensorUsage::Input,
            sys::NRT_TENSOR_USAGE_OUTPUT => TensorUsage::Output,
            other => TensorUsage::Other(other),
        }
    }
}

/// One input or output of a loaded NEFF, copied out of `nrt_get_model_tensor_info`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The NEFF I/O name, which [`TensorSet::add`] binds by.
    pub name: String,
    /// Input or output.
    pub usage: TensorUsage,
    /// Size in bytes.
    pub size: usize,
    /// Element type, raw: see [`crate::sys::dtype`] for the two encodings.
    pub dtype: u32,
    /// Dimensions.
    pub shape: Vec<u32>,
}

/// A loaded NEFF's inputs and outputs. The runtime documents no order: look tensors up by
/// name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelIo {
    /// Every entry, in the order the runtime returned them.
    pub tensors: Vec<TensorInfo>,
}

impl ModelIo {
    /// The inputs.
    pub fn inputs(&self) -> impl Iterator<Item = &TensorInfo> {
        self.tensors
            .iter()
            .filter(|t| t.usage == TensorUsage::Input)
    }

    /// The outputs.
    pub fn outputs(&self) -> impl Iterator<Item = &TensorInfo> {
        self.tensors
            .iter()
            .filter(|t| t.usage == TensorUsage::Output)
    }

    /// The input named `name`.
    pub fn input(&self, name: &str) -> Option<&TensorInfo> {
        self.inputs().find(|t| t.name == name)
    }

    /// The output named `name`.
    pub fn output(&self, name: &str) -> Option<&TensorInfo> {
        self.outputs().find(|t| t.name == name)
    }
}

/// A NEFF loaded on NeuronCores (`nrt_load`); unloaded (`nrt_unload`) on drop.
pub struct Model {
    ptr: NonNull<sys::nrt_model_t>,
    start_nc: i32,
    nc_count: i32,
    rt: Runtime,
}

// SAFETY: a model is a libnrt handle with no thread affinity, unloaded exactly once (Drop).
unsafe impl Send for Model {}
// SAFETY: the only shared operations are nrt_execute and nrt_get_model_tensor_info. libnrt
// is built for concurrent nrt_execute on one model (nrt_get_model_instance_count is
// documented as the optimal number of threads calling nrt_execute), and neither call
// touches Rust memory other than its arguments.
unsafe impl Sync for Model {}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("start_nc", &self.start_nc)
            .field("nc_count", &self.nc_count)
            .finish()
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        let lib = &self.rt.inner.lib;
        // SAFETY: the model came from nrt_load on this (still initialised) runtime and is
        // unloaded exactly once, here. Tensor sets used with it are separate objects.
        let status = unsafe { (lib.api().nrt_unload)(self.ptr.as_ptr()) };
        if let Err(e) = lib.check("nrt_unload", status) {
            self.rt.inner.record(e);
        }
    }
}

impl Model {
    /// Loads a NEFF (`nrt_load`).
    ///
    /// `start_nc` is the first NeuronCore (relative to the visible set; one of the
    /// runtime's cores), or `None` to let libnrt pick the first free one (`-1`).
    /// `nc_count` is passed as `vnc_count`, which current runtimes document as deprecated:
    /// pass `None` (`-1`) unless an older runtime needs a replication count.
    pub fn load(
        rt: &Runtime,
        neff: &[u8],
        start_nc: Option<u32>,
        nc_count: Option<u32>,
    ) -> Result<Model> {
        const CALL: &str = "nrt_load";
        let (vnc, vnc_count) = Self::placement(rt, CALL, neff, start_nc, nc_count)?;
        let lib = &rt.inner.lib;
        let mut raw: *mut sys::nrt_model_t = ptr::null_mut();
        // SAFETY: `neff` is valid for `neff.len()` bytes of reads for the whole call (libnrt
        // copies what it keeps); `raw` is a valid out-pointer; the runtime is initialised.
        let status = unsafe {
            (lib.api().nrt_load)(neff.as_ptr().cast(), neff.len(), vnc, vnc_count, &mut raw)
        };
        lib.check(CALL, status)?;
        Self::wrap(rt, CALL, raw, vnc, vnc_count)
    }

    /// Loads one rank of a NEFF with collectives (`nrt_load_collectives`): a tensor-parallel
    /// graph whose all-reduces and all-gathers span `device_count` ranks, this one being global
    /// rank `device_id` (ranks on other instances included: libnrt's collectives reach them
    /// over EFA, bootstrapped from `NEURON_RT_ROOT_COMM_ID`, which must be set). `start_nc` and
    /// `nc_count` are as for [`Model::load`]. [`Error::Unsupported`] when the runtime lacks
    /// the call.
    pub fn load_collectives(
        rt: &Runtime,
        neff: &[u8],
        start_nc: Option<u32>,
        nc_count: Option<u32>,
        device_id: u32,
        device_count: u32,
    ) -> Result<Model> {
        const CALL: &str = "nrt_load_collectives";
        if device_id >= device_count {
            return Err(Error::invalid(
                CALL,
                format!("device id {device_id} is not below the device count {device_count}"),
            ));
        }
        let (vnc, vnc_count) = Self::placement(rt, CALL, neff, start_nc, nc_count)?;
        let lib = &rt.inner.lib;
        let load = lib
            .api()
            .nrt_load_collectives
            .ok_or_else(|| lib.unsupported(CALL))?;
        let mut raw: *mut sys::nrt_model_t = ptr::null_mut();
        // SAFETY: as in `load`; the two context arguments are plain integers.
        let status = unsafe {
            load(
                neff.as_ptr().cast(),
                neff.len(),
                vnc,
                vnc_count,
                device_id,
                device_count,
                &mut raw,
            )
        };
        lib.check(CALL, status)?;
        Self::wrap(rt, CALL, raw, vnc, vnc_count)
    }

    /// The `vnc` and `vnc_count` arguments of a load, checked.
    fn placement(
        rt: &Runtime,
        call: &'static str,
        neff: &[u8],
        start_nc: Option<u32>,
        nc_count: Option<u32>,
    ) -> Result<(i32, i32)> {
        if neff.is_empty() {
            return Err(Error::invalid(call, "the NEFF is empty"));
        }
        let vnc = match start_nc {
            Some(nc) => {
                rt.check_nc(call, nc)?;
                i32::try_from(nc).map_err(|_| {
                    Error::invalid(call, format!("NeuronCore {nc} does not fit an int32"))
                })?
            }
            None => -1,
        };
        let vnc_count = match nc_count {
            Some(0) => return Err(Error::invalid(call, "nc_count must be at least 1")),
            Some(n) => i32::try_from(n)
                .map_err(|_| Error::invalid(call, format!("nc_count {n} does not fit an int32")))?,
            None => -1,
        };
        Ok((vnc, vnc_count))
    }

    /// The model behind the handle a successful load wrote.
    fn wrap(
        rt: &Runtime,
        call: &'static str,
        raw: *mut sys::nrt_model_t,
        vnc: i32,
        vnc_count: i32,
    ) -> Result<Model> {
        let ptr = NonNull::new(raw).ok_or(Error::NullHandle { call })?;
        Ok(Model {
            ptr,
            start_nc: vnc,
            nc_count: vnc_count,
            rt: rt.clone(),
        })
    }

    /// The NEFF's inputs and outputs (`nrt_get_model_tensor_info`, then
    /// `nrt_free_model_tensor_info`). [`Error::Unsupported`] when the runtime lacks them.
    pub fn io(&self) -> Result<ModelIo> {
        const CALL: &str = "nrt_get_model_tensor_info";
        let lib = &self.rt.inner.lib;
        let get = lib
            .api()
            .nrt_get_model_tensor_info
            .ok_or_else(|| lib.unsupported(CALL))?;
        let free = lib
            .api()
            .nrt_free_model_tensor_info
            .ok_or_else(|| lib.unsupported("nrt_free_model_tensor_info"))?;
        let mut raw: *mut sys::nrt_tensor_info_array_t = ptr::null_mut();
        // SAFETY: live model; `raw` is a valid out-pointer.
        let status = unsafe { get(self.ptr.as_ptr(), &mut raw) };
        lib.check(CALL, status)?;
        let array = NonNull::new(raw).ok_or(Error::NullHandle { call: CALL })?;

        /// Frees the array on every path out of `io`, errors included.
        struct FreeOnDrop<'a> {
            array: NonNull<sys::nrt_tensor_info_array_t>,
            free: <sys::nrt_free_model_tensor_info_fn as crate::library::OptionFn>::Fn,
            model: &'a Model,
        }
        impl Drop for FreeOnDrop<'_> {
            fn drop(&mut self) {
                // SAFETY: the array came from nrt_get_model_tensor_info and is freed once.
                let status = unsafe { (self.free)(self.array.as_ptr()) };
                if let Err(e) = self
                    .model
                    .rt
                    .inner
                    .lib
                    .check("nrt_free_model_tensor_info", status)
                {
                    self.model.rt.inner.record(e);
                }
            }
        }
        let _guard = FreeOnDrop {
            array,
            free,
            model: self,
        };

        // SAFETY: the array is live until `_guard` drops; its header is 8 bytes.
        let count = unsafe { (*array.as_ptr()).tensor_count };
        let count = usize::try_from(count)
            .ok()
            .filter(|&n| n <= 1 << 20)
            .ok_or_else(|| Error::invalid(CALL, format!("implausible tensor_count {count}")))?;
        // The entries follow the 8-byte header (a flexible array member). The pointer is
        // derived from the array pointer itself, not from a reference to the 8-byte header,
        // so reading past the header stays within the allocation's provenance.
        // SAFETY: `array` is valid; addr_of! creates no reference.
        let first = unsafe { ptr::addr_of!((*array.as_ptr()).tensor_array) }
            .cast::<sys::nrt_tensor_info_t>();
        let mut tensors = Vec::with_capacity(count);
        for i in 0..count {
            // SAFETY: libnrt allocated `count` entries after the header; entry `i` is within
            // them and properly aligned (the array is 8-aligned, entries are 296 bytes).
            let info = unsafe { &*first.add(i) };
            let shape = if info.ndim == 0 || info.shape.is_null() {
                Vec::new()
            } else {
                // SAFETY: `shape` points at `ndim` u32s owned by libnrt until the array is
                // freed (after this copy).
                unsafe { std::slice::from_raw_parts(info.shape, info.ndim as usize) }.to_vec()
            };
            tensors.push(TensorInfo {
                name: c_chars_to_string(&info.name),
                usage: TensorUsage::from_raw(info.usage),
                size: info.size,
                dtype: info.dtype,
                shape,
            });
        }
        Ok(ModelIo { tensors })
    }

    /// Runs the model once (`nrt_execute`); see [`execute`].
    pub fn execute(&self, inputs: &TensorSet, outputs: &TensorSet) -> Result<()> {
        execute(self, inputs, outputs)
    }

    /// The NeuronCore passed to `nrt_load` (`-1`: chosen by libnrt).
    pub fn start_nc(&self) -> i32 {
        self.start_nc
    }

    /// The `vnc_count` passed to `nrt_load` (`-1`: automatic).
    pub fn nc_count(&self) -> i32 {
        self.nc_count
    }

    /// The runtime this model is loaded in.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// The raw handle, for calls this crate does not wrap. Valid while `self` is alive; do
    /// not unload it.
    pub fn as_raw(&self) -> *mut sys::nrt_model_t {
        self.ptr.as_ptr()
    }
}

/// Runs `model` once, synchronously (`nrt_execute`): reads the tensors bound in `inputs`
/// and writes those bound in `outputs`, matched by NEFF I/O name.
///
/// One tensor may be bound in both sets (an input aliased to an output, such as a KV-cache
/// root updated in place) when the NEFF declares that alias; binding one buffer to an
/// input and an output that are not declared aliases gives undefined results on device
/// (not Rust UB: the memory is device memory).
pub fn execute(model: &Model, inputs: &TensorSet, outputs: &TensorSet) -> Result<()> {
    const CALL: &str = "nrt_execute";
    if !inputs.runtime().same_as(&model.rt) || !outputs.runtime().same_as(&model.rt) {
        return Err(Error::invalid(
            CALL,
            "the model and the tensor sets belong to different runtimes",
        ));
    }
    let lib = &model.rt.inner.lib;
    // SAFETY: live model and sets of one initialised runtime; every tensor in the sets is
    // kept alive by them for the whole call.
    let status =
        unsafe { (lib.api().nrt_execute)(model.ptr.as_ptr(), inputs.as_raw(), outputs.as_raw()) };
    lib.check(CALL, status)
}
