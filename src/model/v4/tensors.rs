//! Every tensor a DeepSeek-V4 checkpoint holds, in the published naming (`embed.weight`,
//! `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`, `layers.N.hc_attn_fn`, ...),
//! with the shape its [`V4Config`] gives it, and the check of a checkpoint against that list.
//!
//! The names are those of DeepSeek's releases, which transformers 5.25 maps onto its modules
//! (`conversion_mapping.py`, `"deepseek_v4"`); the shapes follow `modeling_deepseek_v4.py`. One
//! name has two spellings: the attention's key/value norm is `attn.kv_norm.weight` in DeepSeek's
//! inference code and `attn.norm.weight` where transformers writes it back; either is accepted.
//! The multi-token-prediction layers (`mtp.{k}.*`) are listed and checked when in use
//! ([`V4Config::with_draft_layer`]): a full block under the decoder layers' names, and the MTP
//! layer's own `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm` and `hc_head_*` (DeepSeek-V4's
//! `MTPBlock`; the embedding and head are the main model's). Others are left unread.

use std::collections::HashMap;

use candle_core::Tensor;

use crate::config::v4::{V4Attention, V4Config, V4Experts, V4Routing, FP4_GROUP};
use crate::error::{Error, Result};
use crate::graph::DType;
use crate::weights::{scale_name, Checkpoint, Conversion};

/// What a tensor holds, which decides the stored dtypes it may have and the dtype it is held in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum V4TensorKind {
    /// A matrix the activations are multiplied by (a projection, a shared or unquantized
    /// routed expert, the embedding, the LM head): stored as f32, bf16 or f16, or in FP8 (E4M3)
    /// with its block scales (`X.scale` beside `X.weight`); held in the weights' dtype (`--dtype`:
    /// f32 or bf16), FP8 ones dequantized into it.
    Matrix,
    /// Parameters held in f32 whatever the weights' dtype: vectors (norms, sinks, `ape`, the
    /// router's bias), the router's matrix and the indexer's head weights (they decide which
    /// experts and which compressed entries a token sees, and transformers keeps routers in
    /// f32 too), and the hyper-connections' small mixing matrices. Stored as f32, bf16 or f16
    /// (FP8 accepted for a 2-D one, dequantized to f32).
    Float,
    /// A hash layer's `tid2eid` table: expert ids, an integer dtype.
    ExpertIds,
    /// A routed expert's matrix in FP4 (`expert_dtype: fp4`), its shape the values' `[out,
    /// in]`: codes two a byte and `X.scale`, read as stored (`weights::fp4`).
    Fp4,
}

/// One tensor of a V4 checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct V4Tensor {
    /// Its published name, and the other accepted spelling where there is one.
    pub names: Vec<String>,
    /// Its shape.
    pub shape: Vec<usize>,
    /// What it holds.
    pub kind: V4TensorKind,
}

impl V4TensorKind {
    /// The dtype a rank's graph input of this kind is held in when the weights are held in
    /// `weights`: matrices in it, other floats in f32 (an FP4 expert's scales too), expert ids
    /// in i32, FP4 codes as bytes.
    pub fn dtype(self, weights: DType) -> DType {
        match self {
            V4TensorKind::Matrix => weights,
            V4TensorKind::Float => DType::F32,
            V4TensorKind::ExpertIds => DType::I32,
            V4TensorKind::Fp4 => DType::U8,
        }
    }
}

impl V4Tensor {
    fn new(name: String, shape: Vec<usize>, kind: V4TensorKind) -> Self {
        V4Tensor {
            names: vec![name],
            shape,
            kind,
        }
    }

    fn float(name: String, shape: Vec<usize>) -> Self {
        V4Tensor::new(name, shape, V4TensorKind::Float)
    }

    fn matrix(name: String, shape: Vec<usize>) -> Self {
        V4Tensor::new(name, shape, V4TensorKind::Matrix)
    }
}

/// Every tensor of a V4 model of `cfg` (with the MTP layers in use), in a fixed order.
pub fn expected(cfg: &V4Config) -> Vec<V4Tensor> {
    let (h, v, n) = (cfg.hidden_size, cfg.vocab_size, cfg.hc_mult);
    let (heads, d) = (cfg.num_attention_heads, cfg.head_dim);
    let mix = (2 + n) * n;
    let mut out = vec![
        V4Tensor::matrix("embed.weight".into(), vec![v, h]),
        V4Tensor::float("norm.weight".into(), vec![h]),
        V4Tensor::float("hc_head_fn".into(), vec![n, n * h]),
        V4Tensor::float("hc_head_base".into(), vec![n]),
        V4Tensor::float("hc_head_scale".into(), vec![1]),
    ];
    if !cfg.tie_word_embeddings {
        out.push(V4Tensor::matrix("head.weight".into(), vec![v, h]));
    }
    for l in 0..cfg.num_hidden_layers + cfg.draft_layers {
        let p = cfg.layer_prefix(l);
        if l >= cfg.num_hidden_layers {
            out.extend(draft_tensors(cfg, &p));
        }
        let mut t = |name: String, shape: Vec<usize>| out.push(V4Tensor::float(name, shape));
        t(format!("{p}.attn_norm.weight"), vec![h]);
        t(format!("{p}.ffn_norm.weight"), vec![h]);
        for hc in ["hc_attn", "hc_ffn"] {
            t(format!("{p}.{hc}_fn"), vec![mix, n * h]);
            t(format!("{p}.{hc}_base"), vec![mix]);
            t(format!("{p}.{hc}_scale"), vec![3]);
        }
        // Attention: q through its latent, the one K=V head, the grouped output projection.
        let a = format!("{p}.attn");
        let q = cfg.q_lora_rank;
        let matrix = |name: String, shape: Vec<usize>| (name, shape, V4TensorKind::Matrix);
        let float = |name: String, shape: Vec<usize>| (name, shape, V4TensorKind::Float);
        let mut attention = vec![
            matrix(format!("{a}.wq_a.weight"), vec![q, h]),
            float(format!("{a}.q_norm.weight"), vec![q]),
            matrix(format!("{a}.wq_b.weight"), vec![heads * d, q]),
            matrix(format!("{a}.wkv.weight"), vec![d, h]),
            matrix(
                format!("{a}.wo_a.weight"),
                vec![cfg.o_groups * cfg.o_lora_rank, heads * d / cfg.o_groups],
            ),
            matrix(
                format!("{a}.wo_b.weight"),
                vec![h, cfg.o_groups * cfg.o_lora_rank],
            ),
            float(format!("{a}.attn_sink"), vec![heads]),
        ];
        // The compressors: CSA's project to two series (2d), HCA's to one; CSA's indexer has
        // its own, at index_head_dim.
        let compressor = |prefix: &str, width: usize, rate: usize, series: usize| {
            vec![
                matrix(format!("{prefix}.wkv.weight"), vec![series * width, h]),
                matrix(format!("{prefix}.wgate.weight"), vec![series * width, h]),
                float(format!("{prefix}.ape"), vec![rate, series * width]),
                float(format!("{prefix}.norm.weight"), vec![width]),
            ]
        };
        match cfg.attention[l] {
            V4Attention::Sliding => {}
            V4Attention::HeavilyCompressed => {
                attention.extend(compressor(&format!("{a}.compressor"), d, cfg.hca_rate, 1));
            }
            V4Attention::CompressedSparse => {
                attention.extend(compressor(&format!("{a}.compressor"), d, cfg.csa_rate, 2));
                if let Some(ix) = cfg.indexer {
                    let i = format!("{a}.indexer");
                    attention.extend(compressor(
                        &format!("{i}.compressor"),
                        ix.head_dim,
                        cfg.csa_rate,
                        2,
                    ));
                    attention.push(matrix(
                        format!("{i}.wq_b.weight"),
                        vec![ix.heads * ix.head_dim, q],
                    ));
                    attention.push(float(format!("{i}.weights_proj.weight"), vec![ix.heads, h]));
                }
            }
        }
        for (name, shape, kind) in attention {
            out.push(V4Tensor::new(name, shape, kind));
        }
        // MoE: the router (its correction bias, or a hash layer's table), the experts, the
        // shared expert.
        let f = format!("{p}.ffn");
        let (e, k, m) = (
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
        );
        out.push(V4Tensor::float(format!("{f}.gate.weight"), vec![e, h]));
        if cfg.routing[l] == V4Routing::TopK {
            out.push(V4Tensor::float(format!("{f}.gate.bias"), vec![e]));
        }
        let expert_kind = match cfg.experts {
            V4Experts::Float => V4TensorKind::Matrix,
            V4Experts::Fp4 => V4TensorKind::Fp4,
        };
        // One shared expert as wide as a routed one (transformers' `DeepseekV4MLP` reads
        // `moe_intermediate_size`).
        let shared = format!("{f}.shared_experts");
        out.push(V4Tensor::matrix(format!("{shared}.w1.weight"), vec![m, h]));
        out.push(V4Tensor::matrix(format!("{shared}.w2.weight"), vec![h, m]));
        out.push(V4Tensor::matrix(format!("{shared}.w3.weight"), vec![m, h]));
        for x in 0..e {
            for (proj, shape) in [("w1", [m, h]), ("w2", [h, m]), ("w3", [m, h])] {
                out.push(V4Tensor {
                    names: vec![format!("{f}.experts.{x}.{proj}.weight")],
                    shape: shape.to_vec(),
                    kind: expert_kind,
                });
            }
        }
        if cfg.routing[l] == V4Routing::Hash {
            out.push(V4Tensor {
                names: vec![format!("{f}.gate.tid2eid")],
                shape: vec![v, k],
                kind: V4TensorKind::ExpertIds,
            });
        }
        out.push(V4Tensor {
            names: vec![format!("{a}.kv_norm.weight"), format!("{a}.norm.weight")],
            shape: vec![d],
            kind: V4TensorKind::Float,
        });
    }
    out
}

/// An MTP layer's own tensors besides its block (prefix `p`, `mtp.{k}`): the two projections
/// of its inputs, their norms, its hyper-head and final norm.
fn draft_tensors(cfg: &V4Config, p: &str) -> Vec<V4Tensor> {
    let (h, n) = (cfg.hidden_size, cfg.hc_mult);
    vec![
        V4Tensor::matrix(format!("{p}.e_proj.weight"), vec![h, h]),
        V4Tensor::matrix(format!("{p}.h_proj.weight"), vec![h, h]),
        V4Tensor::float(format!("{p}.enorm.weight"), vec![h]),
        V4Tensor::float(format!("{p}.hnorm.weight"), vec![h]),
        V4Tensor::float(format!("{p}.norm.weight"), vec![h]),
        V4Tensor::float(format!("{p}.hc_head_fn"), vec![n, n * h]),
        V4Tensor::float(format!("{p}.hc_head_base"), vec![n]),
        V4Tensor::float(format!("{p}.hc_head_scale"), vec![1]),
    ]
}

/// Checks `ckpt` against [`expected`]: every tensor present under one of its names, with its
/// shape and a dtype its kind allows (an FP8 weight and an FP4 expert with their scales), and
/// no other tensor (MTP layers not in use aside). Returns how many tensors of [`expected`] were checked.
/// The error names the tensor, and for a tensor the config does not explain, what in the
/// config to look at.
pub fn check(cfg: &V4Config, ckpt: &Checkpoint) -> Result<usize> {
    let tensors = expected(cfg);
    let mut seen = std::collections::HashSet::new();
    for t in &tensors {
        let Some(name) = t.names.iter().find(|n| ckpt.contains(n)) else {
            return Err(Error::Weights(format!(
                "tensor `{}` is missing (expected shape {:?})",
                t.names.join("` or `"),
                t.shape
            )));
        };
        let dtype = ckpt.dtype_name(name).unwrap_or_default();
        match t.kind {
            V4TensorKind::Fp4 => {
                let (out, inputs) = (t.shape[0], t.shape[1]);
                if !matches!(dtype.as_str(), "I8" | "U8") {
                    return Err(Error::Weights(format!(
                        "tensor `{name}` is stored as {dtype}, but config.json's expert_dtype \
                         fp4 stores routed experts as FP4 codes two a byte (I8); set \
                         expert_dtype to how they are stored"
                    )));
                }
                ckpt.check(name, &[out, inputs / 2])?;
                let scale = scale_name(name);
                ckpt.check(&scale, &[out, inputs / FP4_GROUP])?;
                seen.insert(scale);
            }
            V4TensorKind::Matrix | V4TensorKind::Float if dtype == "F8_E4M3" => {
                ckpt.check(name, &t.shape)?;
                let Some(block) = cfg.fp8_block else {
                    return Err(Error::Weights(format!(
                        "tensor `{name}` is stored as F8_E4M3, but config.json has no \
                         quantization_config.weight_block_size for its scales"
                    )));
                };
                let scale = ckpt.fp8_scale_name(name).ok_or_else(|| {
                    Error::Weights(format!(
                        "tensor `{name}` is stored as F8_E4M3, but its scales `{}` are missing",
                        scale_name(name)
                    ))
                })?;
                let blocks: Vec<usize> = t
                    .shape
                    .iter()
                    .zip(block)
                    .map(|(n, b)| n.div_ceil(b))
                    .collect();
                ckpt.check(&scale, &blocks)?;
                seen.insert(scale);
            }
            kind => {
                ckpt.check(name, &t.shape)?;
                let allowed: &[&str] = match kind {
                    V4TensorKind::ExpertIds => {
                        &["I64", "I32", "U8", "I16", "U16", "U32", "U64", "I8"]
                    }
                    _ => &["F32", "BF16", "F16"],
                };
                if !allowed.contains(&dtype.as_str()) {
                    let why = match kind {
                        V4TensorKind::ExpertIds => "a hash layer's expert table holds integers",
                        _ if t.shape.len() == 2 => {
                            "deepinfer reads DeepSeek-V4's weights in f32, bf16, f16 and \
                             block-scaled F8_E4M3, and routed experts in FP4 too"
                        }
                        _ => "deepinfer reads DeepSeek-V4's vectors in f32, bf16 and f16",
                    };
                    return Err(Error::Weights(format!(
                        "tensor `{name}` is stored as {dtype}: {why}"
                    )));
                }
            }
        }
        seen.insert(name.clone());
    }
    if let Some(other) = ckpt
        .names()
        .into_iter()
        .find(|n| !seen.contains(n) && !unused_draft_layer(cfg, n))
    {
        return Err(Error::Weights(format!(
            "tensor `{other}` is not a parameter of the model config.json describes (check \
             layer_types, mlp_layer_types, n_routed_experts and num_hidden_layers against the \
             checkpoint)"
        )));
    }
    Ok(tensors.len())
}

/// Whether `name` belongs to an MTP layer `cfg` does not use (left unread).
fn unused_draft_layer(cfg: &V4Config, name: &str) -> bool {
    let Some(rest) = name.strip_prefix("mtp.") else {
        return false;
    };
    let k = rest.split('.').next().and_then(|k| k.parse::<usize>().ok());
    k.is_none_or(|k| k >= cfg.draft_layers)
}

/// Reads every tensor of [`expected`] from `ckpt` (after [`check`]), keyed by its published
/// name, the name the graphs' weight inputs take, as [`read`] gives each.
pub fn load(cfg: &V4Config, ckpt: &Checkpoint, weights: DType) -> Result<HashMap<String, Tensor>> {
    check(cfg, ckpt)?;
    let mut out = HashMap::new();
    for t in expected(cfg) {
        out.extend(read(cfg, ckpt, &t, weights)?);
    }
    Ok(out)
}

/// Reads tensor `t` of [`expected`] from `ckpt` (under whichever of its names `ckpt` holds),
/// keyed by its published name, in the dtype [`V4TensorKind::dtype`] gives it for weights held
/// in `weights`: matrices in `weights` and other floats in f32 (FP8 ones dequantized with
/// their block scales), `tid2eid` as i32, and an FP4 expert as stored, its codes (u8) under
/// its name and its scales (f32) under `X.scale`.
pub fn read(
    cfg: &V4Config,
    ckpt: &Checkpoint,
    t: &V4Tensor,
    weights: DType,
) -> Result<Vec<(String, Tensor)>> {
    let stored = t
        .names
        .iter()
        .find(|n| ckpt.contains(n))
        .unwrap_or(&t.names[0]);
    let name = t.names[0].clone();
    let conversion = Conversion {
        dtype: t.kind.dtype(weights),
        fp8_block: cfg.fp8_block,
    };
    Ok(match t.kind {
        V4TensorKind::Matrix | V4TensorKind::Float => {
            vec![(name, ckpt.tensor(stored, &t.shape, &conversion)?)]
        }
        V4TensorKind::ExpertIds => vec![(name, ckpt.tensor_i32(stored, &t.shape)?)],
        V4TensorKind::Fp4 => {
            let (codes, scales) = ckpt.fp4(stored, [t.shape[0], t.shape[1]])?;
            vec![(scale_name(&name), scales), (name, codes)]
        }
    })
}

#[cfg(test)]
mod tests {
    // The V4 tensor table against fixtures/tiny-v4, whose names scripts/make_v4_fixture.py wrote
    // from its own table (derived from config.json alone) and checked by reloading the directory
    // in transformers 5.25; and a broken checkpoint named for what is broken.

    use std::path::{Path, PathBuf};

    use super::*;

    fn fixture_named(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join(name)
    }

    fn fixture() -> PathBuf {
        fixture_named("tiny-v4")
    }

    fn config_in(dir: &Path) -> V4Config {
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        V4Config::from_json_str(&text).unwrap()
    }

    fn config() -> V4Config {
        config_in(&fixture())
    }

    #[test]
    fn the_tiny_v4_fixture_holds_exactly_the_expected_tensors() {
        let cfg = config();
        let ckpt = Checkpoint::open(&fixture()).unwrap();
        assert_eq!(check(&cfg, &ckpt).unwrap(), 259);
        assert_eq!(ckpt.names().len(), 259);
        assert_eq!(
            ckpt.dtype_name("layers.0.ffn.gate.tid2eid").as_deref(),
            Some("I64")
        );
    }

    /// Edits of a checkpoint's tensors: (name, dtype, shape, bytes).
    type Tensors = Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>;

    /// Copies the fixture with its safetensors rewritten by `edit`.
    fn broken(edit: impl Fn(&mut Tensors)) -> tempfile::TempDir {
        broken_copy(&fixture(), edit)
    }

    /// Copies fixture `src` with its safetensors rewritten by `edit`.
    fn broken_copy(src: &Path, edit: impl Fn(&mut Tensors)) -> tempfile::TempDir {
        use safetensors::tensor::TensorView;
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
        let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<_> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
            .collect();
        edit(&mut tensors);
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        dir
    }

    fn error_of(dir: &tempfile::TempDir) -> String {
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        check(&config(), &ckpt).unwrap_err().to_string()
    }

    #[test]
    fn a_broken_v4_checkpoint_names_the_tensor() {
        let missing = broken(|t| t.retain(|(n, ..)| n != "layers.3.attn.indexer.compressor.ape"));
        let e = error_of(&missing);
        assert!(
            e.contains(
                "tensor `layers.3.attn.indexer.compressor.ape` is missing (expected shape [4, 32])"
            ),
            "{e}"
        );

        let misshapen = broken(|t| {
            for (n, _, shape, _) in t.iter_mut() {
                if n == "layers.1.attn.wo_a.weight" {
                    shape.reverse();
                }
            }
        });
        let e = error_of(&misshapen);
        assert!(
            e.contains("tensor `layers.1.attn.wo_a.weight` has shape [64, 32], expected [32, 64]"),
            "{e}"
        );

        let extra = broken(|t| {
            let (_, d, s, b) = t[0].clone();
            t.push(("layers.9.attn.wq_a.weight".into(), d, s, b));
        });
        let e = error_of(&extra);
        assert!(
            e.contains("tensor `layers.9.attn.wq_a.weight` is not a parameter"),
            "{e}"
        );

        let renamed = broken(|t| {
            for (n, ..) in t.iter_mut() {
                if n == "layers.2.attn.kv_norm.weight" {
                    *n = "layers.2.attn.norm.weight".into();
                }
            }
        });
        assert_eq!(
            check(&config(), &Checkpoint::open(renamed.path()).unwrap()).unwrap(),
            259
        );
    }

    /// The published FP8/FP4 form: every tensor and scale accounted for; an expert stored
    /// otherwise than `expert_dtype` says, a missing scale and an FP8 weight without a block
    /// size are named.
    #[test]
    fn the_fp8_and_fp4_checkpoint_is_checked_with_its_scales() {
        let src = fixture_named("tiny-v4-fp8");
        let cfg = config_in(&src);
        let ckpt = Checkpoint::open(&src).unwrap();
        assert_eq!(check(&cfg, &ckpt).unwrap(), 259);
        assert_eq!(ckpt.names().len(), 259 + 42 + 120);

        let err = |dir: &tempfile::TempDir, cfg: &V4Config| {
            let ckpt = Checkpoint::open(dir.path()).unwrap();
            check(cfg, &ckpt).unwrap_err().to_string()
        };
        let expert = "layers.2.ffn.experts.5.w3.weight";
        let as_bf16 = broken_copy(&src, |t| {
            for (n, d, shape, bytes) in t.iter_mut() {
                if n == expert {
                    // Its values' shape in bf16, as an unquantized checkpoint holds it.
                    *d = safetensors::Dtype::BF16;
                    shape[1] *= 2;
                    *bytes = vec![0; shape[0] * shape[1] * 2];
                }
            }
        });
        let e = err(&as_bf16, &cfg);
        assert!(e.contains(expert) && e.contains("expert_dtype"), "{e}");

        let scale = "layers.1.attn.wq_b.scale";
        let no_scale = broken_copy(&src, |t| t.retain(|(n, ..)| n != scale));
        let e = err(&no_scale, &cfg);
        assert!(e.contains(scale) && e.contains("missing"), "{e}");

        let no_block = V4Config {
            fp8_block: None,
            ..cfg.clone()
        };
        let e = check(&no_block, &ckpt).unwrap_err().to_string();
        assert!(e.contains("weight_block_size"), "{e}");
    }
}
