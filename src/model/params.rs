//! The model's parameters: what each graph input named after a weight holds, in which dtype it
//! is stored, how it is read from an HF checkpoint, and the once-at-load preparation.
//!
//! Names follow the HF checkpoint wherever a tensor is used as stored. Stacked experts are
//! the one derived weight: the per-expert `mlp.experts.E.{gate,up,down}_proj.weight` become one
//! `[experts, out, in]` tensor each (`mlp.experts.gate_proj`, ...), which both MoE strategies
//! index. MLA's absorbed matrices (`w_uk`, `w_uv`) are not stored: decode slices them out of
//! `kv_b_proj` inside the graph, so the weight is held once.
//!
//! Every weight is stored in one dtype, the precision policy's (see [`super::precision`]), except
//! the router's (`mlp.gate.weight`, and V3's `e_score_correction_bias`), which stays f32: it is
//! tiny (experts x hidden) and decides which experts run, where a rounding flips a choice and
//! changes the output by far more than rounding elsewhere does. transformers keeps it in f32
//! for the same reason (`_keep_in_fp32_modules`). V3.2's indexer head weights
//! (`indexer.weights_proj.weight`, `[index_n_heads, hidden]`) stay f32 for the same reason:
//! they decide which tokens attention sees, and transformers keeps them in f32 too.
//!
//! A DeepSeek-V4 model's weights are its published tensors by name, its matrices in the
//! weights' dtype and everything else in f32 (`super::v4::tensors::V4TensorKind`), a rank's cut
//! taken as [`super::v4::shard`] says (its hash layers' `tid2eid` as i32, its routed experts
//! stacked per projection). They are read whole before they are stacked, so loading one holds
//! its routed experts twice for a moment.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor as CTensor};

use crate::config::v4::V4Config;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::graph::DType;
use crate::host::{candle_dtype, QuantizedWeight, Value};
use crate::weights::{Checkpoint, Conversion};

use super::precision::{Dots, Precision, Quantize, INT4_GROUP};
use super::shard::{self, Split};
use super::v4::{shard as shard_v4, tensors as tensors_v4};

/// Shape and stored dtype of every parameter a graph may reference, by name.
#[derive(Debug, Clone)]
pub struct WeightSpecs {
    shapes: HashMap<String, Vec<usize>>,
    /// Parameters whose stored dtype their kind decides rather than the precision policy (a
    /// DeepSeek-V4 model's: see [`WeightSpecs::dtype`]).
    dtypes: HashMap<String, DType>,
    precision: Precision,
    ranks: usize,
    vocab_size: usize,
}

impl WeightSpecs {
    /// Every parameter of `cfg` (stacked experts, and their scales when quantized, included),
    /// stored as `precision` says.
    pub fn new(cfg: &ModelConfig, precision: &Precision) -> Self {
        if let Some(v4) = &cfg.v4 {
            // The unsplit rank's tensors, as its graphs name them (routed experts stacked);
            // one rank divides every count, so nothing is refused.
            let tensors = shard_v4::rank_tensors(v4, 1).unwrap_or_default();
            return WeightSpecs::v4(v4, precision, 1, tensors);
        }
        let mut m = HashMap::new();
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        m.insert("model.embed_tokens.weight".into(), vec![v, h]);
        m.insert("model.norm.weight".into(), vec![h]);
        if !cfg.tie_word_embeddings {
            m.insert("lm_head.weight".into(), vec![v, h]);
        }
        for l in 0..cfg.cached_layers() {
            layer_params(&mut m, cfg, precision, l);
        }
        for l in cfg.num_hidden_layers..cfg.cached_layers() {
            mtp_params(&mut m, cfg, l);
        }
        WeightSpecs {
            shapes: m,
            dtypes: HashMap::new(),
            precision: *precision,
            ranks: 1,
            vocab_size: cfg.vocab_size,
        }
    }

    /// The parameters one rank of a `ranks`-way tensor-parallel model holds: every shape
    /// divided as [`shard::split_of`] says, plus the rank's [`shard::SHARD_OFFSETS`]. Every
    /// rank's shards have the same shapes, so one graph serves them all.
    pub fn sharded(cfg: &ModelConfig, precision: &Precision, ranks: usize) -> Result<Self> {
        if let Some(v4) = &cfg.v4 {
            let tensors = shard_v4::rank_tensors(v4, ranks)?;
            return Ok(WeightSpecs::v4(v4, precision, ranks, tensors));
        }
        shard::validate(cfg, ranks)?;
        let mut specs = WeightSpecs::new(cfg, precision);
        if ranks > 1 {
            for (name, shape) in specs.shapes.iter_mut() {
                *shape = shard::shard_shape(shape, shard::split_of(name), ranks);
            }
            specs
                .shapes
                .insert(shard::SHARD_OFFSETS.to_string(), vec![2]);
        }
        specs.ranks = ranks;
        Ok(specs)
    }

    /// A DeepSeek-V4 model's `tensors` for one rank of `ranks`, with the rank's offsets when
    /// split.
    fn v4(
        cfg: &V4Config,
        precision: &Precision,
        ranks: usize,
        tensors: Vec<shard_v4::RankTensor>,
    ) -> Self {
        let dtypes = tensors
            .iter()
            .map(|t| (t.name.clone(), t.kind.dtype(precision.weights)))
            .collect();
        let mut shapes: HashMap<String, Vec<usize>> =
            tensors.into_iter().map(|t| (t.name, t.shape)).collect();
        if ranks > 1 {
            shapes.insert(shard::SHARD_OFFSETS.to_string(), vec![2]);
        }
        WeightSpecs {
            shapes,
            dtypes,
            precision: *precision,
            ranks,
            vocab_size: cfg.vocab_size,
        }
    }

    /// The precision these weights are stored in.
    pub fn precision(&self) -> &Precision {
        &self.precision
    }

    /// These specs with graphs multiplying in `dots`: the same stored weights, built into a
    /// device's graphs ([`Dots::DEVICE`]) or the CPU's ([`Dots::Widen`]).
    pub fn with_dots(&self, dots: Dots) -> Self {
        WeightSpecs {
            precision: self.precision.with_dots(dots),
            ..self.clone()
        }
    }

    /// The tensor-parallel degree these shapes are one rank's share of (1: the whole model).
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The model's whole vocabulary: the embedding's rows split over the ranks may be more
    /// (padded, see [`shard`]).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The shape of a parameter, if the model has it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.shapes.get(name).map(|v| v.as_slice())
    }

    /// The dtype parameter `name` is stored in: the router's weight and bias are f32 whatever
    /// the policy, and so are quantized experts' scales (see the module docs).
    pub fn dtype(&self, name: &str) -> DType {
        if let Some(&dtype) = self.dtypes.get(name) {
            dtype
        } else if name == shard::SHARD_OFFSETS || name.ends_with(".tid2eid") {
            DType::I32
        } else if name.ends_with(".mlp.gate.weight")
            || name.ends_with(".e_score_correction_bias")
            || name.ends_with(".indexer.weights_proj.weight")
            || name.ends_with("_proj_scale")
        {
            DType::F32
        } else if stacked_expert(name).is_some() {
            QuantizedExperts::under(self.precision.quantize)
                .map_or(self.precision.weights, QuantizedExperts::dtype)
        } else {
            self.precision.weights
        }
    }

    /// All parameter names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.shapes.keys().map(|s| s.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// Total number of parameters.
    pub fn param_count(&self) -> usize {
        self.shapes
            .values()
            .map(|s| s.iter().product::<usize>())
            .sum()
    }

    /// Bytes of all parameters as stored.
    pub fn bytes(&self) -> u64 {
        self.shapes
            .iter()
            .map(|(n, s)| (s.iter().product::<usize>() * self.dtype(n).size_in_bytes()) as u64)
            .sum()
    }
}

/// The model's parameters in their stored dtypes, ready to bind to graph inputs by name: held
/// as host tensors ([`ModelWeights::load`], [`ModelWeights::random`]: what the CPU backend
/// computes on), or read from the checkpoint when asked for ([`ModelWeights::stream`]: what a
/// device runner uploads, one tensor at a time, so the host never holds the whole model).
#[derive(Debug, Clone)]
pub struct ModelWeights {
    tensors: HashMap<String, CTensor>,
    /// Weights held in a GGML block format instead (`--quantize q8_0|q4_k`, CPU only; see
    /// [`ggml_format`]).
    quantized: HashMap<String, QuantizedWeight>,
    specs: WeightSpecs,
    /// For streamed weights: the checkpoint and which shard of it these weights are.
    stream: Option<Stream>,
}

/// Where streamed weights are read from.
#[derive(Debug, Clone)]
struct Stream {
    ckpt: Arc<Checkpoint>,
    cfg: ModelConfig,
    /// The whole model's specs (what the checkpoint holds, in the stored dtypes).
    whole: WeightSpecs,
    /// This rank and the rank count (0 of 1: the whole model).
    rank: usize,
    ranks: usize,
    /// A DeepSeek-V4 model's reader of this rank's tensors (its graph inputs are cut from
    /// the published tensors by [`shard_v4`], not by [`shard::split_of`]).
    v4: Option<Arc<shard_v4::RankReader>>,
}

impl ModelWeights {
    /// Loads and prepares every parameter from a checkpoint in `dtype`, checking each shape.
    /// Each tensor is converted as it is read; no wider copy of the checkpoint is ever held.
    pub fn load(cfg: &ModelConfig, ckpt: &Checkpoint, precision: &Precision) -> Result<Self> {
        if let Some(v4) = &cfg.v4 {
            let whole = tensors_v4::load(v4, ckpt, precision.weights)?;
            return ModelWeights::v4_rank(cfg, v4, &whole, 0, 1, precision);
        }
        let specs = WeightSpecs::new(cfg, precision);
        check_draft_layers(cfg, ckpt, &specs)?;
        let mut weights = ModelWeights::held(specs.clone());
        // Only a quantized GGUF holds GGML blocks; asked once, not per parameter.
        let has_blocks = ckpt.has_blocks();
        for name in specs.names() {
            let stored = if has_blocks {
                stored_blocks(ckpt, &specs, name)?
            } else {
                None
            };
            if let Some(q) = stored {
                weights.quantized.insert(name.to_string(), q);
                continue;
            }
            for (name, t) in read_param(cfg, ckpt, &specs, name, 0, 1)? {
                weights.insert(name, t)?;
            }
        }
        Ok(weights)
    }

    /// The bytes of RAM [`ModelWeights::load`] will hold for `cfg` from `ckpt` in `precision`,
    /// told from the checkpoint's headers before a tensor is read: every parameter in the
    /// dtype it is held in, and weights in GGML blocks (a GGUF's as stored, or `--quantize
    /// q8_0|q4_k`'s) as [`QuantizedWeight::predicted_bytes`] says candle's kernels hold them.
    /// `None` for DeepSeek-V4, whose load holds the whole model before cutting it
    /// (`tensors_v4`), which this does not model.
    pub fn predicted_bytes(
        cfg: &ModelConfig,
        ckpt: &Checkpoint,
        precision: &Precision,
    ) -> Result<Option<u64>> {
        if cfg.v4.is_some() {
            return Ok(None);
        }
        let specs = WeightSpecs::new(cfg, precision);
        let ggml_kernels = multiplies_ggml_blocks(precision.quantize);
        let mut total = 0u64;
        for name in specs.names() {
            let shape = specs.shape(name).unwrap_or_default();
            // As `load`: a linear weight every tensor of which is stored in blocks is held so.
            let sources = checkpoint_tensors(&specs, name, 0, 1);
            let formats: Option<Vec<_>> = sources
                .iter()
                .map(|(source, _)| ckpt.stored_block_format(source))
                .collect();
            match formats {
                Some(formats) if ggml_kernels && multiplied_in_blocks(name) => {
                    let stacked = stacked_expert(name).is_some();
                    for ((_, dims), format) in sources.iter().zip(formats) {
                        // One expert of a stacked weight is held as an expert is.
                        let dims = match stacked {
                            true => [&[1], &dims[..]].concat(),
                            false => dims.clone(),
                        };
                        total += QuantizedWeight::predicted_bytes(format, &dims)?;
                    }
                }
                _ => {
                    total += match ggml_format(name, shape, precision.quantize) {
                        Some(format) => QuantizedWeight::predicted_bytes(format, shape)?,
                        None => {
                            (shape.iter().product::<usize>() * specs.dtype(name).size_in_bytes())
                                as u64
                        }
                    }
                }
            }
        }
        Ok(Some(total))
    }

    /// Rank `rank` of `ranks`'s tensors of a DeepSeek-V4 model, cut from the `whole` model's
    /// (by published name, as [`tensors_v4::load`] holds them; see [`shard_v4`]).
    fn v4_rank(
        cfg: &ModelConfig,
        v4: &V4Config,
        whole: &HashMap<String, CTensor>,
        rank: usize,
        ranks: usize,
        precision: &Precision,
    ) -> Result<Self> {
        Ok(ModelWeights {
            tensors: shard_v4::rank_weights(v4, whole, ranks, rank)?,
            ..ModelWeights::held(WeightSpecs::sharded(cfg, precision, ranks)?)
        })
    }

    /// No weights yet, for `specs`.
    fn held(specs: WeightSpecs) -> Self {
        ModelWeights {
            tensors: HashMap::new(),
            quantized: HashMap::new(),
            specs,
            stream: None,
        }
    }

    /// Holds `t` as parameter `name`: in a GGML block format when the precision asks for one
    /// and the weight takes it, else as it is.
    fn insert(&mut self, name: String, t: CTensor) -> Result<()> {
        match ggml_format(&name, t.dims(), self.specs.precision.quantize) {
            Some(format) => {
                let q = QuantizedWeight::quantize(&t, format).map_err(|e| {
                    Error::Weights(format!("quantizing `{name}` to {format:?}: {e}"))
                })?;
                self.quantized.insert(name, q);
            }
            None => {
                self.tensors.insert(name, t);
            }
        }
        Ok(())
    }

    /// The parameters of a checkpoint in `precision`, read only when [`ModelWeights::fetch`]
    /// asks for one (a device runner uploading at capture): the host holds at most one tensor
    /// as read and one shard of it at a time (a DeepSeek-V4 rank's routed experts of one
    /// projection, which it stacks), not the model. Every tensor the model needs is
    /// checked now (present, of the right shape), so a broken checkpoint fails here, naming
    /// the tensor, not halfway through a capture.
    pub fn stream(cfg: &ModelConfig, ckpt: Arc<Checkpoint>, precision: &Precision) -> Result<Self> {
        let specs = WeightSpecs::new(cfg, precision);
        let v4 = match &cfg.v4 {
            Some(v4) => {
                tensors_v4::check(v4, &ckpt)?;
                let reader = shard_v4::RankReader::new(v4, 1, 0, precision.weights)?;
                Some(Arc::new(reader))
            }
            None => {
                for name in specs.names() {
                    for (source, shape) in checkpoint_tensors(&specs, name, 0, 1) {
                        ckpt.check(&source, &shape)?;
                    }
                }
                None
            }
        };
        Ok(ModelWeights {
            stream: Some(Stream {
                ckpt,
                cfg: cfg.clone(),
                whole: specs.clone(),
                rank: 0,
                ranks: 1,
                v4,
            }),
            ..ModelWeights::held(specs)
        })
    }

    /// Parameter `name` as a host tensor, with any made together with it (quantized experts'
    /// `_scale`): the held ones, or for streamed weights this rank's shard, read from the
    /// checkpoint now (and not kept).
    pub fn fetch(&self, name: &str) -> Result<Vec<(String, CTensor)>> {
        let missing = || Error::Binding {
            name: name.to_string(),
            msg: "no such weight".into(),
        };
        let Some(st) = &self.stream else {
            return Ok(vec![(name.to_string(), self.get(name)?.clone())]);
        };
        if let Some(reader) = &st.v4 {
            return reader.read(&st.ckpt, name)?.ok_or_else(missing);
        }
        if name == shard::SHARD_OFFSETS {
            let t = shard_offsets(&st.cfg, st.rank, st.ranks)?;
            return Ok(vec![(name.to_string(), t)]);
        }
        // Quantized experts' scales come with their experts (quantized together).
        let param = name.strip_suffix("_scale").unwrap_or(name);
        if self.specs.shape(param).is_none() {
            return Err(missing());
        }
        let got = read_param(&st.cfg, &st.ckpt, &st.whole, param, st.rank, st.ranks)?;
        if !got.iter().any(|(n, _)| n == name) {
            return Err(missing());
        }
        Ok(got)
    }

    /// Random weights in `dtype` (deterministic in `seed`) for benchmarks and tests of configs
    /// that have no checkpoint. Values are scaled like a trained model's (norm weights near 1).
    pub fn random(cfg: &ModelConfig, seed: u64, precision: &Precision) -> Result<Self> {
        if cfg.v4.is_some() {
            return Err(Error::InvalidInput(
                "random weights are made for the MLA family; a DeepSeek-V4 model needs its \
                 checkpoint"
                    .into(),
            ));
        }
        let specs = WeightSpecs::new(cfg, precision);
        let mut weights = ModelWeights::held(specs.clone());
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for name in specs.names() {
            let stored = specs.shape(name).unwrap_or_default();
            let shape = logical_shape(stored, specs.dtype(name));
            let shape = shape.as_slice();
            let n: usize = shape.iter().product();
            let is_norm = name.ends_with("norm.weight");
            let scale = if is_norm { 0.1 } else { 0.05 };
            let data: Vec<f32> = (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    if is_norm {
                        1.0 + u * scale
                    } else if name.ends_with("correction_bias") {
                        0.0
                    } else {
                        u * scale * 2.0
                    }
                })
                .collect();
            if name.ends_with("_proj_scale") {
                continue; // made with its experts
            }
            let t = if let Some(q) = QuantizedExperts::of(specs.dtype(name)) {
                let (codes, scales) = q.quantize(&data, shape[shape.len() - 1]);
                let scale = format!("{name}_scale");
                let scale_shape = specs.shape(&scale).unwrap_or_default();
                weights.insert(
                    scale.clone(),
                    CTensor::from_vec(scales, scale_shape, &Device::Cpu)?,
                )?;
                CTensor::from_vec(codes, stored, &Device::Cpu)?
            } else {
                CTensor::from_vec(data, shape, &Device::Cpu)?
                    .to_dtype(candle_dtype(specs.dtype(name)))?
            };
            weights.insert(name.to_string(), t)?;
        }
        Ok(weights)
    }

    /// Rank `rank`'s shards of these (whole-model) weights for a `ranks`-way tensor-parallel
    /// model (see [`shard`]): row splits are views of the whole tensor (no copy), column
    /// splits are copied.
    pub fn shard(&self, cfg: &ModelConfig, rank: usize, ranks: usize) -> Result<Self> {
        if self.specs.ranks != 1 || rank >= ranks {
            return Err(Error::Internal(format!(
                "shard {rank} of {ranks} of weights that are already a 1/{} shard",
                self.specs.ranks
            )));
        }
        let quantize = self.specs.precision.quantize;
        if quantize.is_cpu_only() && ranks > 1 {
            return Err(quantize.cpu_only_error("tensor parallelism (--tp above 1)"));
        }
        if !self.quantized.is_empty() && ranks > 1 {
            return Err(Error::InvalidInput(
                "weights held in GGML blocks (a quantized GGUF's) are not split for tensor \
                 parallelism (--tp above 1); run them at --tp 1, or use a bf16/f32 checkpoint"
                    .into(),
            ));
        }
        if let Some(st) = &self.stream {
            let v4 = match &cfg.v4 {
                Some(v4) => Some(Arc::new(shard_v4::RankReader::new(
                    v4,
                    ranks,
                    rank,
                    self.specs.precision.weights,
                )?)),
                None => None,
            };
            return Ok(ModelWeights {
                stream: Some(Stream {
                    rank,
                    ranks,
                    v4,
                    ..st.clone()
                }),
                ..ModelWeights::held(WeightSpecs::sharded(cfg, &self.specs.precision, ranks)?)
            });
        }
        if let Some(v4) = &cfg.v4 {
            return ModelWeights::v4_rank(
                cfg,
                v4,
                &self.tensors,
                rank,
                ranks,
                &self.specs.precision,
            );
        }
        let specs = WeightSpecs::sharded(cfg, &self.specs.precision, ranks)?;
        let mut tensors = HashMap::with_capacity(self.tensors.len() + 1);
        for (name, t) in &self.tensors {
            let shard = match shard::split_of(name) {
                Split::Replicated => t.clone(),
                split => take_shard(t, split, rank, ranks)?.contiguous()?,
            };
            tensors.insert(name.clone(), shard);
        }
        if ranks > 1 {
            tensors.insert(
                shard::SHARD_OFFSETS.to_string(),
                shard_offsets(cfg, rank, ranks)?,
            );
        }
        Ok(ModelWeights {
            tensors,
            quantized: self.quantized.clone(),
            specs,
            stream: None,
        })
    }

    /// What the weights are: every name's shape and stored dtype.
    pub fn specs(&self) -> &WeightSpecs {
        &self.specs
    }

    /// These weights, their graphs multiplying in `dots` (see [`WeightSpecs::with_dots`]).
    pub fn with_dots(mut self, dots: Dots) -> Self {
        self.specs = self.specs.with_dots(dots);
        if let Some(stream) = &mut self.stream {
            stream.whole = stream.whole.with_dots(dots);
        }
        self
    }

    /// The bytes of RAM the held weights take: each tensor's, and each matrix in GGML blocks
    /// as candle's kernels hold it ([`QuantizedWeight::held_bytes`]). What
    /// [`ModelWeights::predicted_bytes`] tells before loading.
    pub fn held_bytes(&self) -> u64 {
        let tensors: usize = self
            .tensors
            .values()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        tensors as u64
            + self
                .quantized
                .values()
                .map(QuantizedWeight::held_bytes)
                .sum::<u64>()
    }

    /// The held tensor bound to the graph input `name` (none for streamed weights: see
    /// [`ModelWeights::fetch`]).
    pub fn get(&self, name: &str) -> Result<&CTensor> {
        self.tensors.get(name).ok_or_else(|| Error::Binding {
            name: name.to_string(),
            msg: match self.quantized.get(name) {
                Some(q) => format!("held in {:?} blocks, not as a tensor", q.format()),
                None => "no such weight".into(),
            },
        })
    }

    /// What the CPU backend binds to the graph input `name`: the held tensor, or the weight in
    /// its GGML block format.
    pub fn value(&self, name: &str) -> Result<Value> {
        match self.quantized.get(name) {
            Some(q) => Ok(Value::Quantized(q.clone())),
            None => Ok(Value::Tensor(self.get(name)?.clone())),
        }
    }

    /// The LM head's weight: the embedding's when embeddings are tied; a DeepSeek-V4 model's
    /// published `head.weight`.
    pub fn lm_head_name(cfg: &ModelConfig) -> &'static str {
        if cfg.v4.is_some() {
            "head.weight"
        } else if cfg.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        }
    }
}

/// Inserts decoder layer `l`'s parameters (an MTP layer's decoder block too) into `m`.
fn layer_params(
    m: &mut HashMap<String, Vec<usize>>,
    cfg: &ModelConfig,
    precision: &Precision,
    l: usize,
) {
    let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
    let p = format!("model.layers.{l}");
    m.insert(format!("{p}.input_layernorm.weight"), vec![h]);
    m.insert(format!("{p}.post_attention_layernorm.weight"), vec![h]);
    let a = format!("{p}.self_attn");
    match cfg.q_lora_rank {
        Some(r) => {
            m.insert(format!("{a}.q_a_proj.weight"), vec![r, h]);
            m.insert(format!("{a}.q_a_layernorm.weight"), vec![r]);
            m.insert(
                format!("{a}.q_b_proj.weight"),
                vec![heads * cfg.qk_head_dim(), r],
            );
        }
        None => {
            m.insert(
                format!("{a}.q_proj.weight"),
                vec![heads * cfg.qk_head_dim(), h],
            );
        }
    }
    m.insert(
        format!("{a}.kv_a_proj_with_mqa.weight"),
        vec![cfg.kv_cache_width(), h],
    );
    m.insert(format!("{a}.kv_a_layernorm.weight"), vec![cfg.kv_lora_rank]);
    m.insert(
        format!("{a}.kv_b_proj.weight"),
        vec![
            heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            cfg.kv_lora_rank,
        ],
    );
    m.insert(
        format!("{a}.o_proj.weight"),
        vec![h, heads * cfg.v_head_dim],
    );
    if let (Some(ix), Some(q_rank)) = (cfg.indexer, cfg.q_lora_rank) {
        let i = format!("{a}.indexer");
        m.insert(
            format!("{i}.wq_b.weight"),
            vec![ix.n_heads * ix.head_dim, q_rank],
        );
        m.insert(format!("{i}.wk.weight"), vec![ix.head_dim, h]);
        m.insert(format!("{i}.k_norm.weight"), vec![ix.head_dim]);
        m.insert(format!("{i}.k_norm.bias"), vec![ix.head_dim]);
        m.insert(format!("{i}.weights_proj.weight"), vec![ix.n_heads, h]);
    }
    let mp = format!("{p}.mlp");
    match &cfg.routing {
        Some(r) if cfg.is_moe_layer(l) => {
            let (e, i) = (r.n_routed_experts, cfg.moe_intermediate_size);
            m.insert(format!("{mp}.gate.weight"), vec![e, h]);
            if cfg.architecture.routes_like_v3() {
                m.insert(format!("{mp}.gate.e_score_correction_bias"), vec![e]);
            }
            for (proj, out, inputs) in [("gate", i, h), ("up", i, h), ("down", h, i)] {
                let name = format!("{mp}.experts.{proj}_proj");
                let (stored, scale) = expert_storage(precision.quantize, e, out, inputs);
                m.insert(name.clone(), stored);
                if let Some(scale) = scale {
                    m.insert(format!("{name}_scale"), scale);
                }
            }
            if cfg.n_shared_experts > 0 {
                let s = i * cfg.n_shared_experts;
                m.insert(format!("{mp}.shared_experts.gate_proj.weight"), vec![s, h]);
                m.insert(format!("{mp}.shared_experts.up_proj.weight"), vec![s, h]);
                m.insert(format!("{mp}.shared_experts.down_proj.weight"), vec![h, s]);
            }
        }
        _ => {
            let i = cfg.intermediate_size;
            m.insert(format!("{mp}.gate_proj.weight"), vec![i, h]);
            m.insert(format!("{mp}.up_proj.weight"), vec![i, h]);
            m.insert(format!("{mp}.down_proj.weight"), vec![h, i]);
        }
    }
}

/// Inserts what MTP layer `l` has besides its decoder block, in DeepSeek-V3's published names
/// (see [`super::mtp`]): the two input norms, the projection of their concatenation, its head's
/// norm, and its own embedding and head unless it shares the model's.
fn mtp_params(m: &mut HashMap<String, Vec<usize>>, cfg: &ModelConfig, l: usize) {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let p = format!("model.layers.{l}");
    m.insert(format!("{p}.enorm.weight"), vec![h]);
    m.insert(format!("{p}.hnorm.weight"), vec![h]);
    m.insert(format!("{p}.eh_proj.weight"), vec![h, 2 * h]);
    m.insert(format!("{p}.shared_head.norm.weight"), vec![h]);
    if !cfg.draft_shares_embeddings {
        m.insert(format!("{p}.embed_tokens.weight"), vec![v, h]);
        m.insert(format!("{p}.shared_head.head.weight"), vec![v, h]);
    }
}

/// Fails, naming them all, when the checkpoint lacks tensors of the MTP layers `cfg` loads
/// ([`ModelConfig::draft_layers`]): a config that promises a layer its files do not ship (or a
/// converter that dropped it, as transformers' `save_pretrained` does) is told apart from a
/// damaged file before anything is read.
fn check_draft_layers(cfg: &ModelConfig, ckpt: &Checkpoint, specs: &WeightSpecs) -> Result<()> {
    let first = format!("model.layers.{}.", cfg.num_hidden_layers);
    let missing: Vec<String> = specs
        .names()
        .into_iter()
        .filter(|name| cfg.draft_layers > 0 && name.starts_with(&first))
        .flat_map(|name| checkpoint_tensors(specs, name, 0, 1))
        .map(|(name, _)| name)
        .filter(|name| !ckpt.contains(name))
        .collect();
    const SHOWN: usize = 8;
    match missing.len() {
        0 => Ok(()),
        n => Err(Error::Weights(format!(
            "speculative decoding drafts with the multi-token-prediction layer \
             `{first}*` (config.json's num_nextn_predict_layers is {}), but the checkpoint \
             lacks {n} of its tensors: {}{}",
            cfg.num_nextn_predict_layers,
            missing[..n.min(SHOWN)].join(", "),
            if n > SHOWN {
                format!(" and {} more", n - SHOWN)
            } else {
                String::new()
            }
        ))),
    }
}

/// Rank `rank`'s [`shard::SHARD_OFFSETS`]: its first vocabulary row and first expert.
fn shard_offsets(cfg: &ModelConfig, rank: usize, ranks: usize) -> Result<CTensor> {
    let experts = cfg.routing.as_ref().map_or(0, |r| r.n_routed_experts);
    let offsets = [
        (rank * shard::rows_per_rank(cfg.vocab_size, ranks)) as i32,
        (rank * experts / ranks) as i32,
    ];
    Ok(CTensor::new(&offsets, &Device::Cpu)?)
}

/// The checkpoint tensors parameter `name` is made of for rank `rank` of `ranks`, with their
/// shapes: the tensor itself, or for stacked experts the rank's experts' own tensors.
fn checkpoint_tensors(
    specs: &WeightSpecs,
    name: &str,
    rank: usize,
    ranks: usize,
) -> Vec<(String, Vec<usize>)> {
    let shape = logical_shape(specs.shape(name).unwrap_or_default(), specs.dtype(name));
    if let Some((prefix, proj)) = stacked_expert(name) {
        let per = shape[0] / ranks;
        return (rank * per..(rank + 1) * per)
            .map(|e| (format!("{prefix}.{e}.{proj}.weight"), shape[1..].to_vec()))
            .collect();
    }
    if name.ends_with("_proj_scale") {
        return Vec::new(); // made with its experts
    }
    vec![(name.to_string(), shape.to_vec())]
}

/// Reads rank `rank`'s shard of parameter `name` (of the whole model's `specs`) from the
/// checkpoint, prepared as `specs` says: converted, sharded as [`shard::split_of`] says (a
/// stacked expert tensor reads only the rank's experts), routed experts quantized when
/// `--quantize` says so (returned with their `_scale`). Scales alone return nothing: they come
/// with their experts.
fn read_param(
    cfg: &ModelConfig,
    ckpt: &Checkpoint,
    specs: &WeightSpecs,
    name: &str,
    rank: usize,
    ranks: usize,
) -> Result<Vec<(String, CTensor)>> {
    let shape = specs.shape(name).unwrap_or_default();
    let dt = specs.dtype(name);
    let conv = |dtype| Conversion {
        dtype,
        fp8_block: cfg.fp8_block,
    };
    if stacked_expert(name).is_some() {
        let names: Vec<String> = checkpoint_tensors(specs, name, rank, ranks)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        return Ok(if let Some(quantized) = QuantizedExperts::of(dt) {
            let expert = logical_shape(&shape[1..], dt);
            let (q, scales) =
                quantize_experts(ckpt, &names, &expert, &conv(DType::F32), quantized)?;
            vec![(name.to_string(), q), (format!("{name}_scale"), scales)]
        } else {
            vec![(
                name.to_string(),
                ckpt.stacked(&names, &shape[1..], &conv(dt))?,
            )]
        });
    }
    if name.ends_with("_proj_scale") {
        return Ok(Vec::new());
    }
    if name == "lm_head.weight" && !ckpt.contains(name) {
        return Err(Error::Weights(format!(
            "tensor `lm_head.weight` is missing (expected shape {shape:?}; config.json says tie_word_embeddings is false)"
        )));
    }
    let whole = ckpt.tensor(name, shape, &conv(dt))?;
    let t = match (shard::split_of(name), ranks) {
        (_, 1) | (Split::Replicated, _) => whole,
        // A copy, so the whole tensor is freed once the shard is taken.
        (split, _) => take_shard(&whole, split, rank, ranks)?.copy()?,
    };
    Ok(vec![(name.to_string(), t)])
}

/// Rank `rank`'s shard of `t` split `split` over `ranks` (not [`Split::Replicated`]): a view of
/// its rows or last-dimension columns, except for the last rank's rows of a vocabulary the
/// degree does not divide, which end in zero rows up to [`shard::rows_per_rank`] (the padding
/// the graph masks, see [`shard`]).
fn take_shard(t: &CTensor, split: Split, rank: usize, ranks: usize) -> Result<CTensor> {
    let dim = match split {
        Split::Cols => t.rank() - 1,
        _ => 0,
    };
    let n = t.dim(dim)?;
    let (len, start) = match split {
        Split::Rows => {
            let per = shard::rows_per_rank(n, ranks);
            (per, (rank * per).min(n))
        }
        _ => (n / ranks, rank * (n / ranks)),
    };
    let held = len.min(n - start);
    let part = t.narrow(dim, start, held)?;
    Ok(if held == len {
        part
    } else {
        part.pad_with_zeros(dim, 0, len - held)?
    })
}

/// Reads each expert (`names`, each of `shape` `[out, in]`) as f32 and quantizes it, stacked:
/// `(` codes `[experts, ..]` (bytes), f32 scales `[experts, ..]` `)` in the layouts
/// [`QuantizedExperts::quantize`] gives.
fn quantize_experts(
    ckpt: &Checkpoint,
    names: &[String],
    shape: &[usize],
    conv: &Conversion,
    quantized: QuantizedExperts,
) -> Result<(CTensor, CTensor)> {
    let (mut q, mut scales) = (Vec::new(), Vec::new());
    for name in names {
        let w = ckpt
            .tensor(name, shape, conv)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let (qe, se) = quantized.quantize(&w, shape[1]);
        q.extend(qe);
        scales.extend(se);
    }
    let (stored, scale) = quantized.shapes(names.len(), shape[0], shape[1]);
    Ok((
        CTensor::from_vec(q, stored.as_slice(), &Device::Cpu)?,
        CTensor::from_vec(scales, scale.as_slice(), &Device::Cpu)?,
    ))
}

/// How a stacked expert tensor's codes are held when `--quantize` quantizes routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QuantizedExperts {
    /// One int8 code a value, one scale a row ([`quantize_rows`]).
    Int8,
    /// Two 4-bit codes a byte, one scale per [`INT4_GROUP`] values of a row
    /// ([`quantize_rows_int4`]).
    Int4,
}

impl QuantizedExperts {
    /// The format `--quantize` holds routed experts in (`None`: the weights' dtype).
    fn under(quantize: Quantize) -> Option<Self> {
        match quantize {
            Quantize::ExpertsInt8 => Some(QuantizedExperts::Int8),
            Quantize::ExpertsInt4 => Some(QuantizedExperts::Int4),
            _ => None,
        }
    }

    /// The format codes of stored dtype `dtype` are in (`None`: not quantized).
    fn of(dtype: DType) -> Option<Self> {
        [QuantizedExperts::Int8, QuantizedExperts::Int4]
            .into_iter()
            .find(|q| q.dtype() == dtype)
    }

    /// The stored dtype of the codes.
    fn dtype(self) -> DType {
        match self {
            QuantizedExperts::Int8 => DType::I8,
            QuantizedExperts::Int4 => DType::U8,
        }
    }

    /// Codes and scales of rows of `cols` values.
    fn quantize(self, w: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
        match self {
            QuantizedExperts::Int8 => quantize_rows(w, cols),
            QuantizedExperts::Int4 => quantize_rows_int4(w, cols),
        }
    }

    /// The stored shapes of `experts` stacked `[out, inputs]` matrices: codes and scales.
    fn shapes(self, experts: usize, out: usize, inputs: usize) -> (Vec<usize>, Vec<usize>) {
        match self {
            QuantizedExperts::Int8 => (vec![experts, out, inputs], vec![experts, out]),
            QuantizedExperts::Int4 => (
                vec![experts, out, inputs.div_ceil(2)],
                vec![experts, out, inputs.div_ceil(INT4_GROUP)],
            ),
        }
    }
}

/// The stored shapes of a stacked `[experts, out, inputs]` expert projection under
/// `quantize`, and of its scales when it has them.
fn expert_storage(
    quantize: Quantize,
    experts: usize,
    out: usize,
    inputs: usize,
) -> (Vec<usize>, Option<Vec<usize>>) {
    match QuantizedExperts::under(quantize) {
        Some(q) => {
            let (stored, scale) = q.shapes(experts, out, inputs);
            (stored, Some(scale))
        }
        None => (vec![experts, out, inputs], None),
    }
}

/// The shape of the values a parameter stored as `stored` in `dtype` holds: int4 codes pack
/// two values a byte along the last dim.
fn logical_shape(stored: &[usize], dtype: DType) -> Vec<usize> {
    let mut shape = stored.to_vec();
    if QuantizedExperts::of(dtype) == Some(QuantizedExperts::Int4) {
        if let Some(last) = shape.last_mut() {
            *last *= 2;
        }
    }
    shape
}

/// Symmetric int8 quantization of each row of `cols` values: `scale = max|w| / 127` (1 for a
/// row of zeros), `q = round_half_even(w / scale)` clamped to ±127, in f32 arithmetic; returns
/// the codes as bytes (two's complement, how the CPU backend holds i8) and one scale per row.
/// `q * scale` is the dequantized weight the graph computes.
pub fn quantize_rows(w: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut q = Vec::with_capacity(w.len());
    let mut scales = Vec::with_capacity(w.len() / cols.max(1));
    for row in w.chunks_exact(cols.max(1)) {
        let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
        q.extend(
            row.iter()
                .map(|&v| ((v / scale).round_ties_even().clamp(-127.0, 127.0) as i8) as u8),
        );
        scales.push(scale);
    }
    (q, scales)
}

/// Symmetric 4-bit quantization of each row of `cols` (even) values in groups of
/// [`INT4_GROUP`] (the last group of a row may be shorter): per group `scale = max|w| / 7`
/// (0 for a group of zeros, whose codes are then 0), `q = round_half_even(w / scale)` clamped
/// to ±7, in f32 arithmetic. Returns the codes two a byte, `q + 8` of the even value in the
/// low nibble and of the odd one in the high nibble, and the scales (`[rows, groups]`
/// row-major). `q * scale` is the dequantized weight the graph computes.
pub fn quantize_rows_int4(w: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
    let cols = cols.max(1);
    let mut packed = Vec::with_capacity(w.len() / 2);
    let mut scales = Vec::with_capacity(w.len().div_ceil(INT4_GROUP));
    let mut codes = Vec::with_capacity(cols);
    for row in w.chunks_exact(cols) {
        codes.clear();
        for group in row.chunks(INT4_GROUP) {
            let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = amax / 7.0;
            codes.extend(group.iter().map(|&v| {
                let q = if scale > 0.0 {
                    (v / scale).round_ties_even().clamp(-7.0, 7.0)
                } else {
                    0.0
                };
                (q as i8 + 8) as u8
            }));
            scales.push(scale);
        }
        packed.extend(
            codes
                .chunks(2)
                .map(|pair| pair[0] | (pair.get(1).copied().unwrap_or(8) << 4)),
        );
    }
    (packed, scales)
}

/// The GGML block format parameter `name` (of shape `dims`) is held in under `quantize`, if
/// any: every linear layer's weight (attention projections, dense and shared MLPs, routed
/// experts, an untied LM head), as llama.cpp quantizes them. Not quantized: what the graph reads
/// other than as a matmul's weight (the embedding, a gather; `kv_b_proj`, which decode slices
/// into MLA's absorbed matrices), the f32 router and norms, and V3.2's small indexer. `q4_k`
/// needs rows a multiple of 256 wide and falls back to `q8_0` (rows a multiple of 32), as
/// llama.cpp falls back for such tensors; a weight neither fits stays as it is.
pub fn ggml_format(
    name: &str,
    dims: &[usize],
    quantize: Quantize,
) -> Option<candle_core::quantized::GgmlDType> {
    use candle_core::quantized::GgmlDType;
    let wanted = match quantize {
        Quantize::Q8_0 => GgmlDType::Q8_0,
        Quantize::Q4K => GgmlDType::Q4K,
        Quantize::None | Quantize::ExpertsInt8 | Quantize::ExpertsInt4 => return None,
    };
    let cols = *dims.last()?;
    if !multiplied_in_blocks(name) || !(2..=3).contains(&dims.len()) {
        return None;
    }
    [wanted, GgmlDType::Q8_0]
        .into_iter()
        .find(|&f| QuantizedWeight::fits(cols, f))
}

/// Whether parameter `name` may be held in GGML blocks: a linear layer's weight (see
/// [`ggml_format`] for which are and why).
fn multiplied_in_blocks(name: &str) -> bool {
    name == "lm_head.weight"
        || stacked_expert(name).is_some()
        || ((name.ends_with("_proj.weight") || name.ends_with(".kv_a_proj_with_mqa.weight"))
            && !name.ends_with(".kv_b_proj.weight")
            && !name.contains(".indexer."))
}

/// Whether `quantize` multiplies GGML blocks at all (none, q8_0, q4_k); int8 and int4 experts
/// are made from dequantized values instead.
fn multiplies_ggml_blocks(quantize: Quantize) -> bool {
    matches!(quantize, Quantize::None | Quantize::Q8_0 | Quantize::Q4K)
}

/// A GGUF's block-quantized linear weight `name`, kept in the blocks the file stores (a Q4_K
/// file runs Q4_K, not a requantization of it): when the checkpoint holds every tensor of it
/// in GGML blocks and the precision multiplies GGML blocks at all (`--quantize` none, q8_0 or
/// q4_k; int8 and int4 experts are made from the dequantized values instead). `None` sends
/// the weight through [`read_param`], which dequantizes what it reads.
fn stored_blocks(
    ckpt: &Checkpoint,
    specs: &WeightSpecs,
    name: &str,
) -> Result<Option<QuantizedWeight>> {
    if !multiplies_ggml_blocks(specs.precision.quantize) || !multiplied_in_blocks(name) {
        return Ok(None);
    }
    let mut blocks = Vec::new();
    for (source, shape) in checkpoint_tensors(specs, name, 0, 1) {
        match ckpt.blocks(&source, &shape)? {
            Some(q) => blocks.push((q, shape)),
            None => return Ok(None),
        }
    }
    let experts = stacked_expert(name).is_some();
    QuantizedWeight::from_blocks(blocks, experts)
        .map(Some)
        .map_err(|e| Error::Weights(format!("`{name}` in GGML blocks: {e}")))
}

/// `(prefix, proj)` for a stacked expert name like `model.layers.3.mlp.experts.gate_proj`.
fn stacked_expert(name: &str) -> Option<(&str, &str)> {
    let (prefix, proj) = name.rsplit_once('.')?;
    (prefix.ends_with(".mlp.experts") && proj.ends_with("_proj")).then_some((prefix, proj))
}
