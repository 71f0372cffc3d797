//! Checkpoints: one `model.safetensors`, or the shards that `model.safetensors.index.json`
//! lists, or a llama.cpp GGUF file indexed under the same HF names ([`Checkpoint::open_gguf`]).
//!
//! [`Checkpoint::open`] reads and checks every shard's header once (names, dtypes, shapes, byte
//! ranges, and that each file is as long as its header says, so a truncated download fails at
//! open with the file's name), and keeps an owned index `name -> (shard, dtype, shape, range)`.
//! Tensor data is read on demand, one tensor at a time, with positioned reads from the file.
//!
//! Rejected alternatives:
//! - **mmap** (`memmap2`) would avoid one copy, but `Mmap::map` is `unsafe` (the file can change
//!   under the mapping) and the crate forbids `unsafe` outside `neuron-sys`. Since every tensor is
//!   converted as it is read (to the dtype the weights are held in), the conversion's copy is
//!   the only one that matters.
//! - **`std::fs::read` of every shard** at open keeps parsing trivial (one
//!   `safetensors::SafeTensors` per buffer), but holds the whole checkpoint in host memory
//!   (31 GB for V2-Lite) on top of the converted weights.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use candle_core::quantized::{GgmlDType, QuantizedType};
use candle_core::Tensor;
use safetensors::tensor::Metadata;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::graph::DType;

mod convert;
mod fp4;
mod gguf;

use convert::Buffer;
pub use fp4::scale_name;

/// Name of a single-file checkpoint.
const SINGLE_FILE: &str = "model.safetensors";
/// Name of the index of a sharded checkpoint.
const INDEX_FILE: &str = "model.safetensors.index.json";
/// The safetensors crate's own limit on a header's size.
const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Bytes read and converted at a time, so a large tensor needs no second full-size buffer.
const READ_CHUNK_BYTES: usize = 1 << 22;

/// An opened checkpoint directory: one `model.safetensors`, or shards listed in
/// `model.safetensors.index.json`.
///
/// Headers are parsed and checked at open; tensor data is read from the files when asked for
/// (see the module docs for why the files are not memory-mapped).
#[derive(Debug)]
pub struct Checkpoint {
    /// The shard files, in the order their indices appear in `tensors`.
    shards: Vec<PathBuf>,
    /// Every tensor of every shard, by name.
    tensors: BTreeMap<String, TensorEntry>,
}

/// Where one tensor lives and what it holds.
#[derive(Debug, Clone)]
struct TensorEntry {
    shard: usize,
    encoding: Encoding,
    shape: Vec<usize>,
    /// Absolute byte offset of the data in the shard file.
    offset: u64,
    /// Length of the data in bytes.
    len: usize,
}

impl Checkpoint {
    /// Opens the checkpoint in `dir`, reading and checking every shard's header.
    ///
    /// Fails, naming the path, when `dir` cannot be read, holds neither `model.safetensors` nor
    /// `model.safetensors.index.json`, the index is malformed or names a missing shard or a tensor
    /// its shard lacks, a tensor appears in two shards, or a header is corrupt or its file
    /// truncated.
    pub fn open(dir: &Path) -> Result<Self> {
        let io = |source| Error::Io {
            path: dir.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(dir).map_err(io)?;
        if !meta.is_dir() {
            return Err(Error::Weights(format!(
                "{} is not a directory (expected a checkpoint directory holding {SINGLE_FILE} or {INDEX_FILE})",
                dir.display()
            )));
        }
        // Listing the directory surfaces a permission problem as such, not as "no checkpoint".
        std::fs::read_dir(dir).map_err(io)?;

        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        if index_path.is_file() {
            Self::open_sharded(dir, &index_path)
        } else if single_path.is_file() {
            let mut ckpt = Checkpoint {
                shards: Vec::new(),
                tensors: BTreeMap::new(),
            };
            ckpt.add_shard(single_path)?;
            Ok(ckpt)
        } else {
            Err(Error::Weights(format!(
                "no {SINGLE_FILE} or {INDEX_FILE} in {}",
                dir.display()
            )))
        }
    }

    fn open_sharded(dir: &Path, index_path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(index_path).map_err(|source| Error::Io {
            path: index_path.to_path_buf(),
            source,
        })?;
        let index: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            Error::Weights(format!("{}: not valid JSON: {e}", index_path.display()))
        })?;
        let Some(weight_map) = index.get("weight_map").and_then(|m| m.as_object()) else {
            return Err(Error::Weights(format!(
                "{}: no \"weight_map\" object",
                index_path.display()
            )));
        };

        // tensor name -> shard file name, as the index says.
        let mut wanted: BTreeMap<&str, &str> = BTreeMap::new();
        for (name, file) in weight_map {
            let Some(file) = file.as_str() else {
                return Err(Error::Weights(format!(
                    "{}: weight_map[{name:?}] must be a file name, got {file}",
                    index_path.display()
                )));
            };
            let mut parts = Path::new(file).components();
            if !matches!(
                (parts.next(), parts.next()),
                (Some(Component::Normal(_)), None)
            ) {
                return Err(Error::Weights(format!(
                    "{}: shard {file:?} (for tensor `{name}`) is not a plain file name in the checkpoint directory",
                    index_path.display()
                )));
            }
            wanted.insert(name, file);
        }

        let mut files: Vec<&str> = wanted.values().copied().collect();
        files.sort_unstable();
        files.dedup();
        let mut ckpt = Checkpoint {
            shards: Vec::new(),
            tensors: BTreeMap::new(),
        };
        for file in files {
            let path = dir.join(file);
            if !path.is_file() {
                return Err(Error::Weights(format!(
                    "{} lists shard {file}, which is missing from {}",
                    index_path.display(),
                    dir.display()
                )));
            }
            ckpt.add_shard(path)?;
        }

        for (name, file) in wanted {
            let in_named_shard = ckpt
                .tensors
                .get(name)
                .is_some_and(|e| ckpt.shards[e.shard].file_name() == Some(file.as_ref()));
            if !in_named_shard {
                return Err(Error::Weights(format!(
                    "{} puts tensor `{name}` in {file}, whose header does not have it",
                    index_path.display()
                )));
            }
        }
        Ok(ckpt)
    }

    /// Reads `path`'s header and adds its tensors to the index.
    fn add_shard(&mut self, path: PathBuf) -> Result<()> {
        let (metadata, data_start) = read_header(&path)?;
        let shard = self.shards.len();
        for (name, info) in metadata.tensors() {
            let (begin, end) = info.data_offsets;
            let entry = TensorEntry {
                shard,
                encoding: Encoding::Plain(info.dtype),
                shape: info.shape.clone(),
                offset: data_start + begin as u64,
                len: end - begin,
            };
            if let Some(previous) = self.tensors.insert(name.clone(), entry) {
                return Err(Error::Weights(format!(
                    "tensor `{name}` is in both {} and {}",
                    self.shards[previous.shard].display(),
                    path.display()
                )));
            }
        }
        self.shards.push(path);
        Ok(())
    }

    /// Whether the checkpoint has a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Every tensor name, sorted; for listing what a checkpoint holds and spotting unused
    /// tensors.
    pub fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    /// How tensor `name` is stored, as safetensors names its dtype (`F32`, `BF16`, `I64`,
    /// `F8_E4M3`, ...) or a GGUF's block type; `None` when there is no such tensor.
    pub fn dtype_name(&self, name: &str) -> Option<String> {
        self.entry(name).map(|e| e.encoding.to_string())
    }

    /// The shape of tensor `name`, as stored.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        self.entry(name)
            .map(|e| e.shape.clone())
            .ok_or_else(|| Error::Weights(format!("tensor `{name}` is missing")))
    }

    fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// The float dtype the checkpoint stores its weights in: that of `model.embed_tokens.weight`
    /// (or of the first float tensor), what `--dtype auto` serves. FP8 checkpoints keep their
    /// embeddings in bf16, so they report bf16; so do GGUF files whose embedding is quantized.
    pub fn float_dtype(&self) -> Option<DType> {
        let of = |e: &TensorEntry| match e.encoding {
            Encoding::Plain(Dtype::F32) => Some(DType::F32),
            Encoding::Plain(Dtype::BF16) => Some(DType::BF16),
            Encoding::Plain(Dtype::F16) => Some(DType::F16),
            // A GGUF whose embedding is in GGML blocks: what is dequantized is held in bf16
            // (half f32's memory; the block-quantized matrices run as stored).
            Encoding::Blocks(_) => Some(DType::BF16),
            _ => None,
        };
        // The embedding's, under MLA's name or DeepSeek-V4's: a V4 checkpoint keeps its
        // hyper-connections and sinks in f32 beside bf16 matrices, so any tensor would not do.
        self.entry("model.embed_tokens.weight")
            .or_else(|| self.entry("embed.weight"))
            .and_then(of)
            .or_else(|| self.tensors.values().find_map(of))
    }

    /// Reads a tensor as f32, checking its shape (see [`Checkpoint::tensor`]).
    pub fn tensor_f32(&self, name: &str, expected_shape: &[usize]) -> Result<Tensor> {
        self.tensor(name, expected_shape, &Conversion::to(DType::F32))
    }

    /// Reads tensor `name` in `conv.dtype`, checking its shape. f32, bf16 and f16 tensors are
    /// converted (narrowing to f16 fails on values beyond its range); a `float8_e4m3fn` tensor
    /// is dequantized with its `<name>_scale_inv` block scales (`conv.fp8_block`).
    ///
    /// The result lives on the CPU. Errors name the tensor and the expected shape when
    /// the tensor is missing or has another shape, and the file when it cannot be read.
    pub fn tensor(
        &self,
        name: &str,
        expected_shape: &[usize],
        conv: &Conversion,
    ) -> Result<Tensor> {
        let n = expected_shape.iter().product();
        let mut out = Buffer::new(conv.dtype, n, name)?;
        self.read_into(name, expected_shape, conv, &mut out)?;
        out.into_tensor(expected_shape)
    }

    /// Reads an integer tensor `name` (any safetensors integer dtype, such as DeepSeek-V4's
    /// `tid2eid` table stored as I64) as an i32 `[..expected_shape]` tensor, checking its shape
    /// and that every value fits an i32. Errors name the tensor.
    pub fn tensor_i32(&self, name: &str, expected_shape: &[usize]) -> Result<Tensor> {
        let entry = self.checked_entry(name, expected_shape)?;
        let Encoding::Plain(dtype) = entry.encoding else {
            return Err(Error::Weights(format!(
                "tensor `{name}` is {}, not an integer tensor",
                entry.encoding
            )));
        };
        let width = dtype.bitsize() / 8;
        let signed = matches!(dtype, Dtype::I8 | Dtype::I16 | Dtype::I32 | Dtype::I64);
        if !signed && !matches!(dtype, Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64) {
            return Err(Error::Weights(format!(
                "tensor `{name}` is {dtype}, not an integer tensor"
            )));
        }
        let mut values = Vec::with_capacity(expected_shape.iter().product());
        self.read_raw(name, entry, READ_CHUNK_BYTES / width * width, |chunk| {
            for bytes in chunk.chunks_exact(width) {
                let mut le = [0u8; 8];
                le[..width].copy_from_slice(bytes);
                // Sign-extend a negative signed value from its width.
                if signed && bytes[width - 1] & 0x80 != 0 {
                    le[width..].fill(0xff);
                }
                let wide = match signed {
                    true => i128::from(i64::from_le_bytes(le)),
                    false => i128::from(u64::from_le_bytes(le)),
                };
                let v = i32::try_from(wide).map_err(|_| {
                    Error::Weights(format!(
                        "tensor `{name}` holds {wide}, beyond what an i32 holds"
                    ))
                })?;
                values.push(v);
            }
            Ok(())
        })?;
        Tensor::from_vec(values, expected_shape, &candle_core::Device::Cpu)
            .map_err(|e| Error::Weights(format!("tensor `{name}`: {e}")))
    }

    /// Reads tensors `names`, each of `shape`, stacked into one `[names.len(), ..shape]` tensor
    /// in `conv.dtype`, converting each straight into its place (no per-tensor copies).
    pub fn stacked(&self, names: &[String], shape: &[usize], conv: &Conversion) -> Result<Tensor> {
        let n = names.len() * shape.iter().product::<usize>();
        let mut out = Buffer::new(conv.dtype, n, names.first().map_or("", String::as_str))?;
        for name in names {
            self.read_into(name, shape, conv, &mut out)?;
        }
        let mut dims = vec![names.len()];
        dims.extend_from_slice(shape);
        out.into_tensor(&dims)
    }

    /// Checks that tensor `name` is present with shape `expected_shape`, without reading it;
    /// the error names the tensor.
    pub fn check(&self, name: &str, expected_shape: &[usize]) -> Result<()> {
        self.checked_entry(name, expected_shape).map(|_| ())
    }

    fn checked_entry(&self, name: &str, expected_shape: &[usize]) -> Result<&TensorEntry> {
        let Some(entry) = self.entry(name) else {
            return Err(Error::Weights(format!(
                "tensor `{name}` is missing (expected shape {expected_shape:?})"
            )));
        };
        if entry.shape != expected_shape {
            return Err(Error::Weights(format!(
                "tensor `{name}` has shape {:?}, expected {expected_shape:?}",
                entry.shape
            )));
        }
        Ok(entry)
    }

    /// Appends tensor `name`'s values, converted, to `out`.
    fn read_into(
        &self,
        name: &str,
        expected_shape: &[usize],
        conv: &Conversion,
        out: &mut Buffer,
    ) -> Result<()> {
        let entry = self.checked_entry(name, expected_shape)?;
        match entry.encoding {
            Encoding::Plain(Dtype::F8_E4M3) => {
                let mut values = self.read_f32(name, entry)?;
                self.dequantize(name, &entry.shape, conv, &mut values)?;
                out.extend(&values, name)
            }
            Encoding::Plain(_) => self.read_chunks(name, entry, |chunk| out.extend(chunk, name)),
            Encoding::Blocks(_) => {
                self.read_block_chunks(name, entry, |chunk| out.extend(chunk, name))
            }
            Encoding::KvB(_) => out.extend(&self.read_f32(name, entry)?, name),
        }
    }

    /// Multiplies an fp8 weight's values by its block scales ([`Checkpoint::fp8_scale_name`]),
    /// checking that the config gives a block size, that the scales' shape matches it and that
    /// every scale is finite.
    fn dequantize(
        &self,
        name: &str,
        shape: &[usize],
        conv: &Conversion,
        values: &mut [f32],
    ) -> Result<()> {
        let Some(block) = conv.fp8_block else {
            return Err(Error::Weights(format!(
                "tensor `{name}` is float8_e4m3fn but config.json has no \
                 quantization_config.weight_block_size to dequantize it with"
            )));
        };
        let &[rows, cols] = shape else {
            return Err(Error::Weights(format!(
                "tensor `{name}` is float8_e4m3fn with shape {shape:?}; block-scaled fp8 \
                 weights are 2-D"
            )));
        };
        let want = [rows.div_ceil(block[0]), cols.div_ceil(block[1])];
        let scales_name = self.fp8_scale_name(name).ok_or_else(|| {
            Error::Weights(format!(
                "tensor `{name}` is float8_e4m3fn but its scales (`{name}_scale_inv`, or \
                 `.scale` beside `.weight`) are missing (expected shape {want:?} for blocks of \
                 {block:?})"
            ))
        })?;
        let of = format!("`{name}` {shape:?} in blocks of {block:?}");
        let dtypes = [Dtype::F32, Dtype::BF16, Dtype::F8_E8M0];
        let scales = self.scales(&scales_name, &want, &of, &dtypes)?;
        convert::apply_block_scales(values, cols, &scales, block);
        Ok(())
    }

    /// The name of fp8 weight `name`'s block scales in this checkpoint: `<name>_scale_inv`
    /// (DeepSeek-V3/R1 on the Hub) or, for `X.weight`, `X.scale` (DeepSeek's own naming, which
    /// V4 is published in). `None` when neither is there.
    pub fn fp8_scale_name(&self, name: &str) -> Option<String> {
        let own = name.ends_with(".weight").then(|| scale_name(name));
        [Some(format!("{name}_scale_inv")), own]
            .into_iter()
            .flatten()
            .find(|n| self.contains(n))
    }

    /// The values of scale tensor `name` as f32, checking its shape (`want`, what the weight
    /// `of` needs), its dtype (one of `dtypes`) and that every value is finite.
    fn scales(&self, name: &str, want: &[usize], of: &str, dtypes: &[Dtype]) -> Result<Vec<f32>> {
        let entry = self.entry(name).ok_or_else(|| {
            Error::Weights(format!(
                "tensor `{name}` is missing (expected shape {want:?})"
            ))
        })?;
        if entry.shape != want {
            return Err(Error::Weights(format!(
                "tensor `{name}` has shape {:?}, but {of} needs {want:?}",
                entry.shape
            )));
        }
        if !matches!(entry.encoding, Encoding::Plain(d) if dtypes.contains(&d)) {
            let names: Vec<String> = dtypes.iter().map(|d| format!("{d:?}")).collect();
            return Err(Error::Weights(format!(
                "tensor `{name}` is {}; scales here are {}",
                entry.encoding,
                names.join(" or ")
            )));
        }
        let values = self.read_f32(name, entry)?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(Error::Weights(format!(
                "tensor `{name}` holds a non-finite scale ({}) at index {i}",
                values[i]
            )));
        }
        Ok(values)
    }

    /// Every value of a tensor as f32 (GGML blocks dequantized, a split `kv_b_proj` joined).
    fn read_f32(&self, name: &str, entry: &TensorEntry) -> Result<Vec<f32>> {
        match &entry.encoding {
            Encoding::Plain(_) => {
                let mut values = Vec::with_capacity(entry.shape.iter().product());
                self.read_chunks(name, entry, |chunk| {
                    values.extend_from_slice(chunk);
                    Ok(())
                })?;
                Ok(values)
            }
            Encoding::Blocks(_) => {
                let mut values = Vec::with_capacity(entry.shape.iter().product());
                self.read_block_chunks(name, entry, |chunk| {
                    values.extend_from_slice(chunk);
                    Ok(())
                })?;
                Ok(values)
            }
            Encoding::KvB(halves) => {
                let k = self.read_f32(name, &halves.key)?;
                let v = self.read_f32(name, &halves.value)?;
                Ok(halves.join(&k, &v))
            }
        }
    }

    /// Reads a tensor in GGML blocks a chunk of whole blocks at a time, dequantizing each
    /// chunk to f32 and handing it to `sink`: a large tensor (a quantized embedding, 0.84 GB in
    /// f32 for V2-Lite) is never held whole in f32 on its way to the dtype it is held in.
    fn read_block_chunks(
        &self,
        name: &str,
        entry: &TensorEntry,
        mut sink: impl FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let format = block_format(name, entry)?;
        let (block_bytes, block_values) = (format.type_size(), format.block_size());
        let chunk_bytes = (READ_CHUNK_BYTES / block_bytes).max(1) * block_bytes;
        self.read_raw(name, entry, chunk_bytes, |chunk| {
            let blocks = stored_blocks(name, format, chunk)?;
            let values = blocks
                .dequantize(chunk.len() / block_bytes * block_values)
                .map_err(|e| Error::Weights(format!("dequantizing `{name}`: {e}")))?;
            match values {
                candle_core::CpuStorage::F32(v) => sink(&v),
                _ => Err(Error::Internal(format!(
                    "candle dequantized `{name}` to another dtype than f32"
                ))),
            }
        })
    }

    /// Tensor `name` as stored in GGML blocks, when it is (a GGUF's quantized matrices, for the
    /// CPU backend to multiply as they are): candle's CPU storage of its blocks, or `None` for
    /// a tensor in a plain float dtype. The shape is checked as [`Checkpoint::tensor`] checks
    /// it. The file's bytes pass through one buffer of the tensor's size on the way (candle's
    /// storage copies them into its own), which is freed on return.
    pub fn blocks(
        &self,
        name: &str,
        expected_shape: &[usize],
    ) -> Result<Option<Box<dyn QuantizedType>>> {
        let entry = self.checked_entry(name, expected_shape)?;
        let Encoding::Blocks(format) = entry.encoding else {
            return Ok(None);
        };
        // In 8-byte words: aligned for any block type (see `read_raw`).
        let mut words = vec![0u64; entry.len.div_ceil(8)];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
        let bytes = &mut bytes[..entry.len];
        let mut file = self.open_at(entry)?;
        self.read_exact(name, entry, &mut file, bytes)?;
        stored_blocks(name, format, bytes).map(Some)
    }

    /// The GGML block format tensor `name` is stored in; `None` when it is stored otherwise or
    /// not at all. Read from the header: no tensor bytes are read.
    pub fn stored_block_format(&self, name: &str) -> Option<GgmlDType> {
        match self.entry(name)?.encoding {
            Encoding::Blocks(format) => Some(format),
            _ => None,
        }
    }

    /// Whether any tensor is stored in GGML blocks (only a quantized GGUF's are), which only
    /// the CPU backend multiplies.
    pub fn has_blocks(&self) -> bool {
        self.tensors
            .values()
            .any(|e| matches!(e.encoding, Encoding::Blocks(_)))
    }

    /// The raw bytes of a stored tensor, read straight into the vector returned.
    fn read_bytes(&self, name: &str, entry: &TensorEntry) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; entry.len];
        let mut file = self.open_at(entry)?;
        self.read_exact(name, entry, &mut file, &mut bytes)?;
        Ok(bytes)
    }

    /// Reads a tensor's bytes from its file a chunk at a time, decoding each chunk to f32 and
    /// handing it to `sink`.
    fn read_chunks(
        &self,
        name: &str,
        entry: &TensorEntry,
        mut sink: impl FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let dtype = match entry.encoding {
            Encoding::Plain(dtype) if convert::readable(dtype) => dtype,
            _ => {
                return Err(Error::Weights(format!(
                    "tensor `{name}` is {}, which deepinfer cannot read (it reads F32, BF16, \
                     F16 and block-scaled F8_E4M3)",
                    entry.encoding
                )))
            }
        };
        let elem_bytes = (dtype.bitsize() / 8).max(1);
        // Whole elements per chunk, so no value straddles two chunks.
        let chunk_bytes = READ_CHUNK_BYTES / elem_bytes * elem_bytes;
        let mut values = Vec::with_capacity(chunk_bytes / elem_bytes);
        self.read_raw(name, entry, chunk_bytes, |chunk| {
            values.clear();
            convert::decode(dtype, chunk, &mut values);
            sink(&values)
        })
    }

    /// Reads a tensor's bytes from its file in chunks of at most `chunk_bytes`, handing each
    /// to `sink`.
    fn read_raw(
        &self,
        name: &str,
        entry: &TensorEntry,
        chunk_bytes: usize,
        mut sink: impl FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let mut file = self.open_at(entry)?;
        // In 8-byte words, so that every chunk starts aligned for any GGML block type (candle
        // views bytes as blocks in place, and checks their alignment).
        let len = chunk_bytes.min(entry.len).max(1);
        let mut words = vec![0u64; len.div_ceil(8)];
        let buf: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
        let buf = &mut buf[..len];
        let mut remaining = entry.len;
        while remaining > 0 {
            let n = remaining.min(buf.len());
            self.read_exact(name, entry, &mut file, &mut buf[..n])?;
            sink(&buf[..n])?;
            remaining -= n;
        }
        Ok(())
    }

    /// The file holding `entry`, positioned at its data.
    fn open_at(&self, entry: &TensorEntry) -> Result<File> {
        let path = &self.shards[entry.shard];
        let io = |source| Error::Io {
            path: path.clone(),
            source,
        };
        let mut file = File::open(path).map_err(io)?;
        file.seek(SeekFrom::Start(entry.offset)).map_err(io)?;
        Ok(file)
    }

    /// Fills `buf` from `file` (tensor `name`'s, see [`Checkpoint::open_at`]).
    fn read_exact(
        &self,
        name: &str,
        entry: &TensorEntry,
        file: &mut File,
        buf: &mut [u8],
    ) -> Result<()> {
        file.read_exact(buf).map_err(|e| {
            Error::Weights(format!(
                "{}: cannot read tensor `{name}` ({e}); was the file changed or truncated after it was opened?",
                self.shards[entry.shard].display()
            ))
        })
    }
}

/// How a tensor's bytes encode its values.
#[derive(Debug, Clone)]
enum Encoding {
    /// A safetensors dtype (a GGUF's F32, F16 and BF16 tensors are read as these too).
    Plain(Dtype),
    /// GGML blocks (a quantized GGUF's `Q8_0`, `Q4_K`, ...).
    Blocks(GgmlDType),
    /// A GGUF's `kv_b_proj`, stored split in two (see [`gguf::KvHalves`]).
    KvB(Box<gguf::KvHalves>),
}

impl std::fmt::Display for Encoding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Encoding::Plain(d) => write!(f, "{d}"),
            Encoding::Blocks(b) => write!(f, "GGML {b:?}"),
            Encoding::KvB(_) => write!(f, "split into attn_k_b and attn_v_b"),
        }
    }
}

/// How a tensor is read: the dtype it is held in, and for fp8 checkpoints the block size of
/// their scales (`quantization_config.weight_block_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conversion {
    /// The dtype the values are held in (f32, bf16 or f16).
    pub dtype: DType,
    /// `[rows, cols]` of one fp8 scale block, if the checkpoint is block-quantized.
    pub fp8_block: Option<[usize; 2]>,
}

impl Conversion {
    /// Plain conversion to `dtype` (no fp8 scales).
    pub fn to(dtype: DType) -> Self {
        Conversion {
            dtype,
            fp8_block: None,
        }
    }
}

/// The block format of a tensor in GGML blocks.
fn block_format(name: &str, entry: &TensorEntry) -> Result<GgmlDType> {
    match entry.encoding {
        Encoding::Blocks(format) => Ok(format),
        _ => Err(Error::Internal(format!(
            "tensor `{name}` is not in GGML blocks"
        ))),
    }
}

/// candle's CPU storage of the `format` blocks in `bytes` (copied), which must start 8-byte
/// aligned (candle checks) and hold whole blocks.
fn stored_blocks(name: &str, format: GgmlDType, bytes: &[u8]) -> Result<Box<dyn QuantizedType>> {
    if !bytes.len().is_multiple_of(format.type_size()) {
        return Err(Error::Weights(format!(
            "tensor `{name}`: {} bytes are not whole {format:?} blocks of {}",
            bytes.len(),
            format.type_size()
        )));
    }
    Ok(format.from_data(std::borrow::Cow::Borrowed(bytes)))
}

/// Reads and checks a safetensors file's header; returns it and the file offset of the data.
fn read_header(path: &Path) -> Result<(Metadata, u64)> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let corrupt = |what: String| Error::Weights(format!("{}: {what}", path.display()));
    let mut file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    if file_len < 8 {
        return Err(corrupt(format!(
            "{file_len} bytes is too short for a safetensors header (truncated?)"
        )));
    }
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes).map_err(io)?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES || 8 + header_len > file_len {
        return Err(corrupt(format!(
            "the header claims {header_len} bytes but the file has {file_len} (truncated, or not a safetensors file)"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let metadata: Metadata = serde_json::from_slice(&header)
        .map_err(|e| corrupt(format!("corrupt safetensors header: {e}")))?;
    let data_start = 8 + header_len;
    let expected_len = data_start + metadata.data_len() as u64;
    if file_len != expected_len {
        let what = if file_len < expected_len {
            "truncated"
        } else {
            "has trailing bytes"
        };
        return Err(corrupt(format!(
            "{what}: its header describes {expected_len} bytes but the file has {file_len}"
        )));
    }
    Ok((metadata, data_start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh, empty directory under the system temp dir.
    fn temp_dir(tag: &str) -> PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "deepinfer-weights-{}-{}-{tag}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Bytes of one tensor in `dtype` from f32 values.
    fn encode(dtype: Dtype, values: &[f32]) -> Vec<u8> {
        match dtype {
            Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::BF16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            Dtype::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            Dtype::I32 => values
                .iter()
                .flat_map(|v| (*v as i32).to_le_bytes())
                .collect(),
            Dtype::I64 => values
                .iter()
                .flat_map(|v| (*v as i64).to_le_bytes())
                .collect(),
            Dtype::U8 => values.iter().map(|v| *v as u8).collect(),
            other => panic!("test helper does not encode {other}"),
        }
    }

    /// Writes a safetensors file of `(name, dtype, shape, values)`.
    fn write(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<f32>)]) {
        let bytes: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(n, d, s, v)| (n.to_string(), *d, s.clone(), encode(*d, v)))
            .collect();
        let views: Vec<(String, TensorView<'_>)> = bytes
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    fn err(r: Result<impl std::fmt::Debug>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn single_file_f32_bf16_f16() {
        let dir = temp_dir("single");
        let vals = vec![1.0, -2.5, 0.15625, 3e4, -0.0, 65504.0];
        write(
            &dir.join(SINGLE_FILE),
            &[
                (
                    "a.f32",
                    Dtype::F32,
                    vec![2, 3],
                    vec![1.5, -2.0, 3.25, 0.1, 1e-8, 7.0],
                ),
                ("b.bf16", Dtype::BF16, vec![3, 2], vals.clone()),
                ("c.f16", Dtype::F16, vec![6], vals.clone()),
                ("d.i32", Dtype::I32, vec![2], vec![1.0, 2.0]),
            ],
        );
        let ckpt = Checkpoint::open(&dir).unwrap();
        assert_eq!(ckpt.names(), vec!["a.f32", "b.bf16", "c.f16", "d.i32"]);
        assert!(ckpt.contains("b.bf16") && !ckpt.contains("nope"));
        assert_eq!(ckpt.shape("b.bf16").unwrap(), vec![3, 2]);

        let a = ckpt.tensor_f32("a.f32", &[2, 3]).unwrap();
        assert_eq!(a.dims(), &[2, 3]);
        assert_eq!(values(&a), vec![1.5, -2.0, 3.25, 0.1, 1e-8, 7.0]);
        let b = ckpt.tensor_f32("b.bf16", &[3, 2]).unwrap();
        let want: Vec<f32> = vals
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(values(&b), want);
        let c = ckpt.tensor_f32("c.f16", &[6]).unwrap();
        assert_eq!(values(&c), vals);

        let msg = err(ckpt.tensor_f32("d.i32", &[2]));
        assert!(msg.contains("`d.i32`") && msg.contains("I32"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn integer_tensors_read_as_i32_and_values_beyond_it_are_named() {
        let dir = temp_dir("ints");
        write(
            &dir.join(SINGLE_FILE),
            &[
                ("ids", Dtype::I64, vec![2, 2], vec![0.0, 7.0, -3.0, 2.0]),
                ("small", Dtype::U8, vec![3], vec![0.0, 200.0, 5.0]),
                ("huge", Dtype::I64, vec![1], vec![4e9]),
                ("f", Dtype::F32, vec![1], vec![1.0]),
            ],
        );
        let ckpt = Checkpoint::open(&dir).unwrap();
        let ids = ckpt.tensor_i32("ids", &[2, 2]).unwrap();
        assert_eq!(ids.to_vec2::<i32>().unwrap(), vec![vec![0, 7], vec![-3, 2]]);
        let small = ckpt.tensor_i32("small", &[3]).unwrap();
        assert_eq!(small.to_vec1::<i32>().unwrap(), vec![0, 200, 5]);
        let msg = err(ckpt.tensor_i32("huge", &[1]));
        assert!(
            msg.contains("`huge`") && msg.contains("4000000000"),
            "{msg}"
        );
        let msg = err(ckpt.tensor_i32("f", &[1]));
        assert!(
            msg.contains("`f`") && msg.contains("not an integer"),
            "{msg}"
        );
        let msg = err(ckpt.tensor_i32("ids", &[4]));
        assert!(msg.contains("`ids`") && msg.contains("[4]"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn large_tensor_crosses_read_chunks() {
        let dir = temp_dir("large");
        let n = READ_CHUNK_BYTES / 2 + 3; // bf16: more than one chunk, with a ragged tail
        let vals: Vec<f32> = (0..n).map(|i| (i % 251) as f32 - 125.0).collect();
        write(
            &dir.join(SINGLE_FILE),
            &[("w", Dtype::BF16, vec![n], vals.clone())],
        );
        let ckpt = Checkpoint::open(&dir).unwrap();
        assert_eq!(values(&ckpt.tensor_f32("w", &[n]).unwrap()), vals);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_and_misshaped_tensors() {
        let dir = temp_dir("shape");
        write(
            &dir.join(SINGLE_FILE),
            &[("w", Dtype::F32, vec![2, 2], vec![0.0; 4])],
        );
        let ckpt = Checkpoint::open(&dir).unwrap();
        let msg = err(ckpt.tensor_f32("model.layers.0.self_attn.q_proj.weight", &[48, 64]));
        assert_eq!(
            msg,
            "checkpoint: tensor `model.layers.0.self_attn.q_proj.weight` is missing (expected shape [48, 64])"
        );
        let msg = err(ckpt.tensor_f32("w", &[4]));
        assert_eq!(msg, "checkpoint: tensor `w` has shape [2, 2], expected [4]");
        assert!(err(ckpt.shape("x")).contains("`x`"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sharded_checkpoint() {
        let dir = temp_dir("sharded");
        write(
            &dir.join("model-00001-of-00002.safetensors"),
            &[("a", Dtype::BF16, vec![2], vec![1.0, 2.0])],
        );
        write(
            &dir.join("model-00002-of-00002.safetensors"),
            &[
                ("b", Dtype::F16, vec![1, 2], vec![3.0, 4.0]),
                ("c", Dtype::F32, vec![1], vec![5.0]),
            ],
        );
        let index = serde_json::json!({
            "metadata": {"total_size": 14},
            "weight_map": {
                "a": "model-00001-of-00002.safetensors",
                "b": "model-00002-of-00002.safetensors",
                "c": "model-00002-of-00002.safetensors"
            }
        });
        std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        assert_eq!(ckpt.names(), vec!["a", "b", "c"]);
        assert_eq!(values(&ckpt.tensor_f32("a", &[2]).unwrap()), vec![1.0, 2.0]);
        assert_eq!(
            values(&ckpt.tensor_f32("b", &[1, 2]).unwrap()),
            vec![3.0, 4.0]
        );
        assert_eq!(values(&ckpt.tensor_f32("c", &[1]).unwrap()), vec![5.0]);

        // The index names a shard that is not there.
        let index = serde_json::json!({"weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "z": "model-00003-of-00003.safetensors"
        }});
        std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
        let msg = err(Checkpoint::open(&dir));
        assert!(
            msg.contains(INDEX_FILE) && msg.contains("model-00003-of-00003.safetensors"),
            "{msg}"
        );

        // The index puts a tensor in a shard that lacks it.
        let index = serde_json::json!({"weight_map": {"b": "model-00001-of-00002.safetensors"}});
        std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
        let msg = err(Checkpoint::open(&dir));
        assert!(
            msg.contains("`b`") && msg.contains("model-00001-of-00002"),
            "{msg}"
        );

        // A shard outside the directory.
        let index = serde_json::json!({"weight_map": {"a": "../elsewhere.safetensors"}});
        std::fs::write(dir.join(INDEX_FILE), index.to_string()).unwrap();
        let msg = err(Checkpoint::open(&dir));
        assert!(msg.contains("../elsewhere.safetensors"), "{msg}");

        // A malformed index.
        std::fs::write(dir.join(INDEX_FILE), "{\"weight_map\": ").unwrap();
        let msg = err(Checkpoint::open(&dir));
        assert!(msg.contains(INDEX_FILE) && msg.contains("line 1"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn truncated_and_corrupt_files_are_named() {
        let dir = temp_dir("truncated");
        let path = dir.join(SINGLE_FILE);
        write(&path, &[("w", Dtype::F32, vec![4], vec![1.0; 4])]);
        let full = std::fs::read(&path).unwrap();

        std::fs::write(&path, &full[..full.len() - 3]).unwrap();
        let msg = err(Checkpoint::open(&dir));
        assert!(
            msg.contains(SINGLE_FILE) && msg.contains("truncated"),
            "{msg}"
        );

        std::fs::write(&path, &full[..20]).unwrap();
        let msg = err(Checkpoint::open(&dir));
        assert!(
            msg.contains(SINGLE_FILE) && msg.contains("truncated"),
            "{msg}"
        );

        std::fs::write(&path, &full[..5]).unwrap();
        let msg = err(Checkpoint::open(&dir));
        assert!(
            msg.contains(SINGLE_FILE) && msg.contains("too short"),
            "{msg}"
        );

        let mut garbage = full.clone();
        garbage[8] = b'!';
        std::fs::write(&path, &garbage).unwrap();
        let msg = err(Checkpoint::open(&dir));
        assert!(
            msg.contains(SINGLE_FILE) && msg.contains("corrupt"),
            "{msg}"
        );

        let mut longer = full.clone();
        longer.extend_from_slice(&[0, 0]);
        std::fs::write(&path, &longer).unwrap();
        let msg = err(Checkpoint::open(&dir));
        assert!(msg.contains("trailing"), "{msg}");

        // Truncated after open: the read names the file.
        std::fs::write(&path, &full).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        std::fs::write(&path, &full[..full.len() - 3]).unwrap();
        let msg = err(ckpt.tensor_f32("w", &[4]));
        assert!(msg.contains(SINGLE_FILE) && msg.contains("`w`"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unreadable_or_empty_directories() {
        let missing = std::env::temp_dir().join("deepinfer-weights-does-not-exist");
        let msg = err(Checkpoint::open(&missing));
        assert!(msg.contains("deepinfer-weights-does-not-exist"), "{msg}");

        let dir = temp_dir("empty");
        let msg = err(Checkpoint::open(&dir));
        assert!(msg.contains("no model.safetensors"), "{msg}");

        let file = dir.join("plain-file");
        std::fs::write(&file, "x").unwrap();
        let msg = err(Checkpoint::open(&file));
        assert!(msg.contains("not a directory"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
