//! GGUF files, llama.cpp's format: what CPU users of llama.cpp already have on disk for
//! DeepSeek models, written by its `convert_hf_to_gguf.py` (architecture `deepseek2`, which
//! covers DeepSeek-V2, V2-Lite, V3 and R1).
//!
//! One file holds everything a model directory does: the hyperparameters (read into a
//! [`crate::config::ModelConfig`] by [`config`]), the tokenizer and chat template (rebuilt as a
//! `tokenizer.json` by `tokenizer`, with the `server` feature) and the tensors (indexed under
//! the HF names the model reads by [`tensors`], see [`crate::weights::Checkpoint::open_gguf`]).
//!
//! candle-core's GGUF reader parses the header (`gguf_file::Content`); this module adds the
//! checks it leaves out (every tensor inside the file, the architecture one we run) and typed
//! metadata getters whose errors name the key.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};

use crate::error::{Error, Result};

pub mod config;
pub mod tensors;
#[cfg(feature = "server")]
pub mod tokenizer;

/// The `general.architecture` of DeepSeek-V2/V3-family GGUF files.
pub const ARCHITECTURE: &str = "deepseek2";

/// Whether `path` names a GGUF file (by its extension; [`GgufFile::open`] checks the magic).
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// An opened GGUF file: its metadata and where each tensor's bytes are.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    content: Content,
}

impl GgufFile {
    /// Reads and checks `path`'s header: the magic and version, the metadata, and that every
    /// tensor's data lies inside the file (a truncated download fails here, naming the file
    /// and the tensor). Split files (`-00001-of-00003.gguf`) are refused with how to merge them.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let content = Content::read(&mut BufReader::new(file)).map_err(|e| {
            Error::Gguf(format!(
                "{}: not a GGUF file deepinfer can read: {e} (deepinfer reads tensors in F32, \
                 F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the Q2_K..Q6_K k-quants)",
                path.display()
            ))
        })?;
        let gguf = GgufFile {
            path: path.to_path_buf(),
            content,
        };
        if let Some(count) = gguf.metadata().opt_u64("split.count")? {
            if count > 1 {
                return Err(Error::Gguf(format!(
                    "{} is one of {count} split files; merge them into one first \
                     (`llama-gguf-split --merge FIRST-00001-of-0000N.gguf OUT.gguf`)",
                    path.display()
                )));
            }
        }
        for (name, info) in &gguf.content.tensor_infos {
            let (start, len) = gguf.byte_range(name, info)?;
            if start.checked_add(len).is_none_or(|end| end > file_len) {
                return Err(Error::Gguf(format!(
                    "{}: tensor `{name}` needs bytes {start}..{} but the file has {file_len} \
                     (truncated?)",
                    path.display(),
                    start.saturating_add(len)
                )));
            }
        }
        Ok(gguf)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The key-value metadata.
    pub fn metadata(&self) -> Metadata<'_> {
        Metadata {
            path: &self.path,
            map: &self.content.metadata,
        }
    }

    /// Every tensor, by its GGUF name.
    pub fn tensor_infos(&self) -> &HashMap<String, TensorInfo> {
        &self.content.tensor_infos
    }

    /// The absolute file offset and byte length of tensor `name`'s data; an error when its
    /// shape does not divide into whole blocks of its format.
    pub fn byte_range(&self, name: &str, info: &TensorInfo) -> Result<(u64, u64)> {
        let elems = info.shape.elem_count();
        let block = info.ggml_dtype.block_size();
        let row = info.shape.dims().last().copied().unwrap_or(1);
        if !row.is_multiple_of(block) {
            return Err(Error::Gguf(format!(
                "{}: tensor `{name}` has rows of {row} values, not whole {:?} blocks of {block}",
                self.path.display(),
                info.ggml_dtype
            )));
        }
        let len = (elems / block * info.ggml_dtype.type_size()) as u64;
        Ok((self.content.tensor_data_offset + info.offset, len))
    }
}

/// The shortest decimal that rounds to `x`, as an f64 (`0.1f32` is 0.1, not 0.10000000149).
pub fn f32_decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// A GGUF file's metadata, with getters whose errors name the file and the key.
#[derive(Debug, Clone, Copy)]
pub struct Metadata<'a> {
    path: &'a Path,
    map: &'a HashMap<String, Value>,
}

impl<'a> Metadata<'a> {
    /// The raw value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key)
    }

    fn wrong(&self, key: &str, want: &str, got: &Value) -> Error {
        Error::Gguf(format!(
            "{}: metadata `{key}` should be {want}, got {:?}",
            self.path.display(),
            got.value_type()
        ))
    }

    /// `key` as an unsigned integer of any width, if present.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = match *v {
            Value::U8(n) => Some(n as u64),
            Value::U16(n) => Some(n as u64),
            Value::U32(n) => Some(n as u64),
            Value::U64(n) => Some(n),
            Value::I8(n) => u64::try_from(n).ok(),
            Value::I16(n) => u64::try_from(n).ok(),
            Value::I32(n) => u64::try_from(n).ok(),
            Value::I64(n) => u64::try_from(n).ok(),
            _ => None,
        };
        n.map(Some)
            .ok_or_else(|| self.wrong(key, "a non-negative integer", v))
    }

    /// `key` as a `usize`; an error naming the key when it is missing.
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key))
    }

    /// `key` as a `usize`, if present.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        Ok(self.opt_u64(key)?.map(|n| n as usize))
    }

    /// `key` as a float (f32 or f64 in the file), if present. An f32 is read as the shortest
    /// decimal that rounds to it (`1e-6`, not `9.99999997e-7`): what the converter wrote.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(f32_decimal(*x))),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(v) => Err(self.wrong(key, "a float", v)),
        }
    }

    /// `key` as a float; an error naming the key when it is missing.
    pub fn f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?.ok_or_else(|| self.missing(key))
    }

    /// `key` as a boolean, if present.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong(key, "a boolean", v)),
        }
    }

    /// `key` as a string, if present.
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.wrong(key, "a string", v)),
        }
    }

    /// `key` as a string; an error naming the key when it is missing.
    pub fn str(&self, key: &str) -> Result<&'a str> {
        self.opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    /// `key` as an array of strings; an error naming the key when it is missing.
    pub fn strings(&self, key: &str) -> Result<Vec<&'a str>> {
        self.array(key)?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                v => Err(self.wrong(key, "an array of strings", v)),
            })
            .collect()
    }

    /// `key` as an array of integers, if present.
    pub fn opt_ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        if self.get(key).is_none() {
            return Ok(None);
        }
        self.array(key)?
            .iter()
            .map(|v| match *v {
                Value::U8(n) => Ok(n as i64),
                Value::I8(n) => Ok(n as i64),
                Value::U16(n) => Ok(n as i64),
                Value::I16(n) => Ok(n as i64),
                Value::U32(n) => Ok(n as i64),
                Value::I32(n) => Ok(n as i64),
                Value::I64(n) => Ok(n),
                ref v => Err(self.wrong(key, "an array of integers", v)),
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    fn array(&self, key: &str) -> Result<&'a [Value]> {
        match self.get(key) {
            None => Err(self.missing(key)),
            Some(Value::Array(a)) => Ok(a),
            Some(v) => Err(self.wrong(key, "an array", v)),
        }
    }

    fn missing(&self, key: &str) -> Error {
        Error::Gguf(format!(
            "{}: metadata `{key}` is missing",
            self.path.display()
        ))
    }

    /// `general.architecture`, checked to be one deepinfer runs.
    pub fn architecture(&self) -> Result<&'a str> {
        let arch = self.str("general.architecture")?;
        if arch != ARCHITECTURE {
            return Err(Error::Gguf(format!(
                "{}: general.architecture is `{arch}`; deepinfer runs DeepSeek-V2/V3-family \
                 models (`{ARCHITECTURE}`)",
                self.path.display()
            )));
        }
        Ok(arch)
    }
}
