//! The MoE router's settings: method, groups and expert count checked against each other.
//!
//! Read only when the model has routed experts (`n_routed_experts` is not `null`); the groups
//! only when the method uses them.

use super::defaults::Defaults;
use super::messages::{invalid, missing, missing_because, unsupported};
use super::raw::RawConfig;
use super::{RoutingConfig, ScoringFunc, TopkMethod};
use crate::error::Result;

/// Resolves the router of a model with `n_routed_experts` experts.
pub(super) fn routing(
    raw: &RawConfig,
    defaults: &Defaults,
    n_routed_experts: usize,
) -> Result<RoutingConfig> {
    if n_routed_experts == 0 {
        return Err(invalid(
            "n_routed_experts",
            0,
            "must be at least 1, or null for a dense model",
        ));
    }
    let scoring_func = match raw.scoring_func.as_deref() {
        None => defaults.scoring_func,
        Some("softmax") => ScoringFunc::Softmax,
        Some("sigmoid") => ScoringFunc::Sigmoid,
        Some(other) => {
            return Err(unsupported(
                "scoring_func",
                format!("{other:?}"),
                "deepinfer implements \"softmax\" and \"sigmoid\"",
            ))
        }
    };
    let topk_method = match raw.topk_method.as_deref() {
        None => defaults.topk_method,
        // "gready" is the original remote code's default spelling.
        Some("greedy" | "gready") => TopkMethod::Greedy,
        Some("group_limited_greedy") => TopkMethod::GroupLimitedGreedy,
        Some("noaux_tc") => TopkMethod::NoauxTc,
        Some(other) => {
            return Err(unsupported(
                "topk_method",
                format!("{other:?}"),
                "deepinfer implements \"greedy\", \"group_limited_greedy\" and \"noaux_tc\"",
            ))
        }
    };
    if topk_method == TopkMethod::NoauxTc && scoring_func == ScoringFunc::Softmax {
        return Err(unsupported(
            "topk_method",
            "\"noaux_tc\" with scoring_func \"softmax\"",
            "noaux_tc is defined on sigmoid scores",
        ));
    }

    let num_experts_per_tok = match raw.num_experts_per_tok {
        Some(k) => k,
        None => defaults
            .num_experts_per_tok
            .ok_or_else(|| missing("num_experts_per_tok"))?,
    };
    if num_experts_per_tok == 0 || num_experts_per_tok > n_routed_experts {
        return Err(invalid(
            "num_experts_per_tok",
            num_experts_per_tok,
            &format!("must be between 1 and n_routed_experts ({n_routed_experts})"),
        ));
    }

    let (n_group, topk_group) = if topk_method == TopkMethod::Greedy {
        // Plain top-k ignores groups; RoutingConfig records "no grouping" as 1 / 1.
        (1, 1)
    } else {
        groups(
            raw,
            defaults,
            topk_method,
            n_routed_experts,
            num_experts_per_tok,
        )?
    };

    Ok(RoutingConfig {
        n_routed_experts,
        num_experts_per_tok,
        scoring_func,
        topk_method,
        n_group,
        topk_group,
        norm_topk_prob: raw.norm_topk_prob.unwrap_or(defaults.norm_topk_prob),
        routed_scaling_factor: raw
            .routed_scaling_factor
            .unwrap_or(defaults.routed_scaling_factor),
    })
}

/// `(n_group, topk_group)` of a method that selects groups before experts.
fn groups(
    raw: &RawConfig,
    defaults: &Defaults,
    topk_method: TopkMethod,
    n_routed_experts: usize,
    num_experts_per_tok: usize,
) -> Result<(usize, usize)> {
    let method = if topk_method == TopkMethod::NoauxTc {
        "noaux_tc"
    } else {
        "group_limited_greedy"
    };
    let default_group = |key: &str, pick: fn((usize, usize)) -> usize| {
        defaults.groups.map(pick).ok_or_else(|| {
            missing_because(key, &format!("topk_method {method:?} groups the experts"))
        })
    };
    let n_group = match raw.n_group {
        Some(g) => g,
        None => default_group("n_group", |g| g.0)?,
    };
    let topk_group = match raw.topk_group {
        Some(g) => g,
        None => default_group("topk_group", |g| g.1)?,
    };
    if n_group == 0 || !n_routed_experts.is_multiple_of(n_group) {
        return Err(invalid(
            "n_group",
            n_group,
            &format!("must divide n_routed_experts ({n_routed_experts})"),
        ));
    }
    if topk_group == 0 || topk_group > n_group {
        return Err(invalid(
            "topk_group",
            topk_group,
            &format!("must be between 1 and n_group ({n_group})"),
        ));
    }
    let group_size = n_routed_experts / n_group;
    if topk_method == TopkMethod::NoauxTc && group_size < 2 {
        return Err(invalid(
            "n_group",
            n_group,
            &format!(
                "noaux_tc scores a group by its top two experts, so each group needs at \
                 least 2 (n_routed_experts is {n_routed_experts})"
            ),
        ));
    }
    if num_experts_per_tok > topk_group * group_size {
        return Err(invalid(
            "num_experts_per_tok",
            num_experts_per_tok,
            &format!(
                "exceeds the {} experts in the topk_group ({topk_group}) groups it may \
                 choose from",
                topk_group * group_size
            ),
        ));
    }
    Ok((n_group, topk_group))
}
