//! Where a model comes from: an HF checkpoint directory (`config.json`, safetensors,
//! `tokenizer.json`), or one GGUF file (llama.cpp's format: the configuration, tokenizer and
//! tensors in one file, see [`crate::gguf`]). Every command's `--model` takes either.

use std::path::{Path, PathBuf};

use crate::config::v4::V4Config;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gguf::{self, GgufFile};
use crate::weights::Checkpoint;

/// An HF checkpoint directory or a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A directory holding `config.json` and the safetensors.
    Dir(PathBuf),
    /// A `.gguf` file.
    Gguf(PathBuf),
}

impl ModelSource {
    /// What `path` is: a directory, or a file named `*.gguf`. Anything else (a missing path,
    /// another kind of file) is an error naming it.
    pub fn new(path: &Path) -> Result<Self> {
        if path.is_dir() {
            return Ok(ModelSource::Dir(path.to_path_buf()));
        }
        if path.is_file() && gguf::is_gguf(path) {
            return Ok(ModelSource::Gguf(path.to_path_buf()));
        }
        let why = if path.exists() {
            "is neither a checkpoint directory nor a .gguf file"
        } else {
            "does not exist (expected a checkpoint directory or a .gguf file)"
        };
        Err(Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, why),
        })
    }

    /// The directory or file.
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Dir(p) | ModelSource::Gguf(p) => p,
        }
    }

    /// The model's configuration: `config.json`, or the GGUF's metadata. A DeepSeek-V4
    /// checkpoint's tensors are checked against its config here, so a broken one is named
    /// before anything is allocated (see [`crate::model::v4::tensors`]).
    pub fn config(&self) -> Result<ModelConfig> {
        match self {
            ModelSource::Dir(dir) => {
                let path = dir.join("config.json");
                if let Some(v4) = V4Config::from_file_if_v4(&path)? {
                    crate::model::v4::tensors::check(&v4, &Checkpoint::open(dir)?)?;
                    return Ok(v4.into_model_config());
                }
                ModelConfig::from_file(&path)
            }
            ModelSource::Gguf(file) => GgufFile::open(file)?.model_config(),
        }
    }

    /// The opened checkpoint (its headers read and checked; tensors are read when asked for).
    pub fn checkpoint(&self) -> Result<Checkpoint> {
        match self {
            ModelSource::Dir(dir) => Checkpoint::open(dir),
            ModelSource::Gguf(file) => Checkpoint::open_gguf(file),
        }
    }

    /// The configuration and the opened checkpoint (a GGUF's header is read once for both).
    pub fn open(&self) -> Result<(ModelConfig, Checkpoint)> {
        match self {
            ModelSource::Dir(dir) => Ok((self.config()?, Checkpoint::open(dir)?)),
            ModelSource::Gguf(file) => {
                let gguf = GgufFile::open(file)?;
                Ok((gguf.model_config()?, Checkpoint::from_gguf(&gguf)?))
            }
        }
    }
}
