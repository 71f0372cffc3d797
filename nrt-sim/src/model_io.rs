//! A model's inputs and outputs: described once at load ([`describe`]), checked against the
//! bindings at each execution, and handed to C as the array `nrt_get_model_tensor_info`
//! returns ([`InfoArray`]).
//!
//! The C array is one raw allocation (a `u64` count, then the entries: the header struct
//! ends in a flexible array member, which no Rust type can own), so this is the one module
//! besides the `extern "C"` shells that allocates and frees by hand. [`InfoArray`] owns it
//! and frees it on drop, so the registry entry is the allocation's only owner.

use std::alloc::Layout;
use std::ffi::c_char;
use std::ptr::{self, NonNull};

use deepinfer::graph::{DType, Graph};
use neuron_sys::sys::{self, nrt_tensor_info_array_t, nrt_tensor_info_t};

use crate::c_text::copy_c_chars;
use crate::fail::{Fail, Res};
use crate::identity::dtype_code;

/// One input or output of a model, as `nrt_get_model_tensor_info` reports it.
#[derive(Debug, Clone)]
pub(crate) struct IoDesc {
    pub(crate) name: String,
    pub(crate) usage: sys::nrt_tensor_usage_t,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u32>,
    pub(crate) size: usize,
}

/// Describes a graph's inputs (in parameter order) and outputs (in result order) under the NEFF
/// names the container gives them (one per input and output, in the same order, or
/// `NRT_INVALID`). Names of `NRT_TENSOR_NAME_MAX` bytes or more, dimensions beyond `u32` and
/// sizes that overflow are `NRT_INVALID`.
pub(crate) fn describe(
    graph: &Graph,
    input_names: &[String],
    output_names: &[String],
) -> Res<(Vec<IoDesc>, Vec<IoDesc>)> {
    if input_names.len() != graph.inputs().len() || output_names.len() != graph.outputs().len() {
        return Err(Fail::invalid(format!(
            "the NEFF names {} inputs and {} outputs; its HLO has {} and {}",
            input_names.len(),
            output_names.len(),
            graph.inputs().len(),
            graph.outputs().len()
        )));
    }
    let desc = |name: &str, usage, dtype: DType, dims: &[usize]| {
        if name.len() >= sys::NRT_TENSOR_NAME_MAX {
            return Err(Fail::invalid(format!(
                "tensor name `{name}` is {} bytes; the runtime's limit is {}",
                name.len(),
                sys::NRT_TENSOR_NAME_MAX - 1
            )));
        }
        let shape = dims
            .iter()
            .map(|&d| u32::try_from(d))
            .collect::<Result<Vec<u32>, _>>()
            .map_err(|_| Fail::invalid(format!("tensor `{name}`: a dimension exceeds u32")))?;
        let size = dims
            .iter()
            .try_fold(dtype.size_in_bytes(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| Fail::invalid(format!("tensor `{name}`: size overflows")))?;
        Ok(IoDesc {
            name: name.to_string(),
            usage,
            dtype,
            shape,
            size,
        })
    };
    let inputs = graph
        .inputs()
        .iter()
        .zip(input_names)
        .map(|(d, name)| desc(name, sys::NRT_TENSOR_USAGE_INPUT, d.dtype, d.shape.dims()))
        .collect::<Res<Vec<_>>>()?;
    let outputs = graph
        .outputs()
        .iter()
        .zip(output_names)
        .map(|(o, name)| {
            let n = graph.node(o.node);
            desc(name, sys::NRT_TENSOR_USAGE_OUTPUT, n.dtype, n.shape.dims())
        })
        .collect::<Res<Vec<_>>>()?;
    Ok((inputs, outputs))
}

/// A tensor-info array handed to the caller (until `nrt_free_model_tensor_info`): the C
/// layout of `nrt_tensor_info_array_t`, owned here and freed on drop.
pub(crate) struct InfoArray {
    ptr: NonNull<u8>,
    layout: Layout,
    /// The arrays the entries' `shape` pointers point into.
    shapes: Vec<Box<[u32]>>,
}

// SAFETY: the allocation is plain memory owned by this record (no thread affinity); it is
// only read by the caller and freed through the record, under the state lock.
unsafe impl Send for InfoArray {}

impl InfoArray {
    /// Builds the C array for `descs`: a `u64` count, then one `nrt_tensor_info_t` each.
    /// Out of memory is `NRT_RESOURCE`.
    pub(crate) fn new(descs: &[&IoDesc]) -> Res<InfoArray> {
        let entries = Layout::array::<nrt_tensor_info_t>(descs.len())
            .map_err(|_| Fail::new(sys::NRT_RESOURCE, "too many tensors"))?;
        let (layout, offset) = Layout::new::<u64>()
            .extend(entries)
            .map_err(|_| Fail::new(sys::NRT_RESOURCE, "too many tensors"))?;
        let layout = layout.pad_to_align();
        // The header is the C struct's `uint64_t tensor_count`, the entries its flexible array.
        debug_assert_eq!(
            offset,
            std::mem::offset_of!(nrt_tensor_info_array_t, tensor_array)
        );
        // SAFETY: the layout has a non-zero size (at least the 8-byte header).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| Fail::new(sys::NRT_RESOURCE, "out of memory"))?;
        // Owned from here on, so an early return frees it.
        let mut array = InfoArray {
            ptr,
            layout,
            shapes: Vec::with_capacity(descs.len()),
        };
        // SAFETY: `ptr` is a fresh allocation of `layout`, 8-aligned, with room for the header.
        unsafe { ptr.as_ptr().cast::<u64>().write(descs.len() as u64) };
        for (i, d) in descs.iter().enumerate() {
            let mut shape: Box<[u32]> = d.shape.clone().into_boxed_slice();
            let shape_ptr = if shape.is_empty() {
                ptr::null_mut()
            } else {
                shape.as_mut_ptr()
            };
            let mut name = [0 as c_char; sys::NRT_TENSOR_NAME_MAX];
            copy_c_chars(&mut name, &d.name);
            let info = nrt_tensor_info_t {
                name,
                usage: d.usage,
                size: d.size,
                dtype: dtype_code(d.dtype),
                shape: shape_ptr,
                ndim: d.shape.len() as u32,
            };
            // SAFETY: entry `i` lies within the allocation (offset + i * size_of < layout.size)
            // and is aligned (offset and the entry size are multiples of 8).
            unsafe {
                ptr.as_ptr()
                    .add(offset)
                    .cast::<nrt_tensor_info_t>()
                    .add(i)
                    .write(info)
            };
            // The boxed slice's heap data does not move when the box does.
            array.shapes.push(shape);
        }
        Ok(array)
    }

    /// The pointer handed to C (and the key it is looked up by when freed).
    pub(crate) fn as_ptr(&self) -> *mut nrt_tensor_info_array_t {
        self.ptr.as_ptr().cast()
    }
}

impl Drop for InfoArray {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout; dropped once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}
