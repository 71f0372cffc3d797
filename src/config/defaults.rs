//! transformers 5.24's class defaults for the keys whose default depends on `model_type`.
//!
//! The table in [`super`]'s docs is the reference, with where transformers says so; the
//! defaults shared by both generations (`rms_norm_eps`, `moe_layer_freq`, ...) are written where
//! they are applied.

use super::{Architecture, ScoringFunc, TopkMethod};

/// The defaults of one `model_type`.
pub(super) struct Defaults {
    pub scoring_func: ScoringFunc,
    pub topk_method: TopkMethod,
    /// `(n_group, topk_group)`; `None` where HF's default is `None`.
    pub groups: Option<(usize, usize)>,
    pub num_experts_per_tok: Option<usize>,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    pub first_k_dense_replace: usize,
    pub max_position_embeddings: usize,
}

impl Defaults {
    /// The defaults of `architecture`'s `model_type`.
    pub fn of(architecture: Architecture) -> Self {
        match architecture {
            // configuration_deepseek_v2.py: topk_method="greedy", n_group=None, topk_group=None,
            // num_experts_per_tok=None, norm_topk_prob=False, routed_scaling_factor=1.0,
            // first_k_dense_replace=0, max_position_embeddings=2048; the router is softmax.
            Architecture::DeepseekV2 => Defaults {
                scoring_func: ScoringFunc::Softmax,
                topk_method: TopkMethod::Greedy,
                groups: None,
                num_experts_per_tok: None,
                norm_topk_prob: false,
                routed_scaling_factor: 1.0,
                first_k_dense_replace: 0,
                max_position_embeddings: 2048,
            },
            // configuration_deepseek_v3.py: n_group=8, topk_group=4, num_experts_per_tok=8,
            // norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3,
            // max_position_embeddings=4096; the router is sigmoid + noaux_tc.
            // configuration_deepseek_v32.py: as V3, but max_position_embeddings=163840.
            // V4's keys are read by `config::v4`, never through these defaults; its routing
            // is V3's family.
            Architecture::DeepseekV4 => Self::of(Architecture::DeepseekV3),
            Architecture::DeepseekV32 => Defaults {
                max_position_embeddings: 163840,
                ..Self::of(Architecture::DeepseekV3)
            },
            Architecture::DeepseekV3 => Defaults {
                scoring_func: ScoringFunc::Sigmoid,
                topk_method: TopkMethod::NoauxTc,
                groups: Some((8, 4)),
                num_experts_per_tok: Some(8),
                norm_topk_prob: true,
                routed_scaling_factor: 2.5,
                first_k_dense_replace: 3,
                max_position_embeddings: 4096,
            },
        }
    }
}
