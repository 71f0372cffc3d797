//! The device memory the compiled graphs themselves take on each core, from the graphs: every
//! bucket's graph is built as a capture would build it, lowered to HLO, and measured by
//! [`footprint`] (code and DMA rings from the instruction estimate, the largest set of live
//! intermediates, collectives buffers), the figure nrt-sim charges each load. Per core:
//!
//! `code = 96 MiB x physical cores per rank + the sum of every NEFF's private bytes`
//!
//! `scratchpad = the largest NEFF's scratch` (shared by the core's NEFFs since runtime 2.33)
//!
//! What is computed and what is guessed is said in [`footprint`]: the scratchpad is computed
//! from the graph (an upper bound under the stated assumptions); bytes per instruction and the
//! collectives buffers are guesses; the first-contact report measures the real NEFF sizes.
//!
//! # Layers by extrapolation
//!
//! A plan is made for many configurations (`suggest` tries each `--tp` and quantization), and
//! a 61-layer V3 graph per bucket each time would take minutes. Every MoE layer of a model is
//! the same graph, so each bucket's graph is built with the dense layers and one and two MoE
//! periods (`first_k_dense_replace + moe_layer_freq` and `+ 2 x moe_layer_freq` layers), and
//! the code and instructions are extrapolated linearly to the model's layers; the scratchpad
//! (one layer's intermediates at a time) and the collectives buffers (the largest collective)
//! do not grow with layers and are taken from the larger build. A model with no more layers
//! than that is built whole. DeepSeek-V4's layers differ (sliding, CSA and HCA attention; hash
//! and scored routing), so its period is where their kinds start repeating (V4-Flash: five
//! layers, then CSA and HCA alternating; a 43-layer plan went from minutes to seconds, with the
//! same figures).

use crate::backend::hlo::emit;
use crate::backend::neuron::footprint::{self, NeffFootprint, MICROCODE_PER_PHYSICAL_CORE};
use crate::config::ModelConfig;
use crate::deployment::{self, RunnerConfig, StepKind};
use crate::error::Result;
use crate::model::{GraphSpec, Precision, WeightSpecs};

use super::instance::Instance;

/// One bucket's graph and what its NEFF takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphFootprint {
    /// The graph's name (`decode_b8_c2048`).
    pub name: String,
    /// Its footprint (extrapolated to the model's layers, see the module docs).
    pub footprint: NeffFootprint,
}

/// The estimate for one core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeffEstimate {
    /// Code, DMA rings and collectives buffers of every NEFF loaded on the core, and the
    /// runtime's micro-code.
    pub code: u64,
    /// The shared scratchpad: the largest NEFF's.
    pub scratchpad: u64,
    /// Per graph, in the order a capture builds them.
    pub graphs: Vec<GraphFootprint>,
}

/// The footprint of one bucket's graph of `cfg` (whole, at whatever layer count it has).
fn footprint_of(
    cfg: &ModelConfig,
    precision: &Precision,
    rc: &RunnerConfig,
    kind: StepKind,
    spec: &GraphSpec,
) -> Result<(String, NeffFootprint)> {
    let specs = WeightSpecs::sharded(cfg, precision, rc.tp)?;
    let layout = rc.cache_layout();
    let g = kind.build(cfg, &specs, &layout, spec)?;
    Ok((g.name().to_string(), footprint::of_module(&emit::emit(&g)?)))
}

/// The estimate for one rank of a capture of `rc` (its buckets, cache geometry and `tp`) of
/// `cfg` in `precision` on `instance` (see the module docs).
pub fn estimate(
    cfg: &ModelConfig,
    precision: &Precision,
    rc: &RunnerConfig,
    instance: Instance,
    split_sampler: bool,
) -> Result<NeffEstimate> {
    let layers = cfg.num_hidden_layers;
    // Graphs of `one` and `two` layers, the rest extrapolated by whole periods (module docs):
    // MLA's dense prefix then its MoE period; V4's per-layer kinds once they repeat.
    let (one, period) = match &cfg.v4 {
        Some(v4) => v4_period(v4).unwrap_or((layers, 1)),
        None if cfg.routing.is_none() => (layers, 1),
        None => {
            let period = cfg.moe_layer_freq.max(1);
            (cfg.first_k_dense_replace + period, period)
        }
    };
    let two = one + period;
    let mut built = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (kind, spec) in rc.buckets.capture_specs(cfg, rc.tp, split_sampler) {
        // A sampling graph is one NEFF shared by every context bucket.
        if matches!(kind, StepKind::Sample | StepKind::Argmax) && !seen.insert((kind, spec.rows)) {
            continue;
        }
        let (name, fp) = if layers <= two {
            footprint_of(cfg, precision, rc, kind, &spec)?
        } else {
            let with = |n| footprint_of(&first_layers(cfg, n), precision, rc, kind, &spec);
            let (name, a) = with(one)?;
            let (_, b) = with(two)?;
            let periods = (layers - one) as f64 / period as f64;
            let grow = |x: u64, y: u64| x + (y.saturating_sub(x) as f64 * periods).round() as u64;
            let instructions = grow(a.instructions, b.instructions);
            let fp = NeffFootprint {
                instructions,
                code: grow(a.code, b.code),
                scratch: a.scratch.max(b.scratch),
                collectives: a.collectives.max(b.collectives),
            };
            (name, fp)
        };
        built.push((
            kind,
            spec,
            GraphFootprint {
                name,
                footprint: fp,
            },
        ));
    }
    deployment::keep_paying_greedy(&mut built, |g| Ok(g.footprint.instructions))?;
    let graphs: Vec<GraphFootprint> = built.into_iter().map(|(_, _, g)| g).collect();
    let code = MICROCODE_PER_PHYSICAL_CORE * instance.physical_per_core()
        + graphs.iter().map(|g| g.footprint.private()).sum::<u64>();
    let scratchpad = graphs
        .iter()
        .map(|g| g.footprint.scratch)
        .max()
        .unwrap_or(0);
    Ok(NeffEstimate {
        code,
        scratchpad,
        graphs,
    })
}

/// The first `n` layers of `cfg` as a model of their own.
fn first_layers(cfg: &ModelConfig, n: usize) -> ModelConfig {
    let mut c = cfg.clone();
    c.num_hidden_layers = n;
    if let Some(v4) = &cfg.v4 {
        let mut v = (**v4).clone();
        v.num_hidden_layers = n;
        v.attention.truncate(n);
        v.routing.truncate(n);
        c.v4 = Some(std::sync::Arc::new(v));
    }
    c
}

/// Where a DeepSeek-V4 model's layers start repeating: `(one, period)` such that from layer
/// `one - period` on, every layer's kind (attention and routing) is the kind `period` layers
/// before it, and the layers after `one` are whole periods (V4-Flash: two sliding layers,
/// three hash-routed ones, then CSA and HCA alternating: `(5, 2)`). `None` when no period of 1
/// or 2 does.
fn v4_period(v4: &crate::config::v4::V4Config) -> Option<(usize, usize)> {
    let kind = |l: usize| (v4.attention[l], v4.routing[l]);
    let layers = v4.num_hidden_layers;
    (1..=2).find_map(|period| {
        let start = (period..layers)
            .rev()
            .take_while(|&l| kind(l) == kind(l - period))
            .last()
            .map_or(layers, |l| l - period);
        let one = start + period;
        (one <= layers && (layers - one).is_multiple_of(period)).then_some((one, period))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::v4::V4Config;

    fn v4(file: &str) -> V4Config {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
        V4Config::from_json_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap()
    }

    /// V4-Flash repeats from its fifth layer in periods of two; tiny-v4's five layers of three
    /// kinds never repeat, so it is built whole.
    #[test]
    fn v4_layers_repeat_where_their_kinds_do() {
        assert_eq!(
            v4_period(&v4("configs/deepseek-v4-flash.json")),
            Some((5, 2))
        );
        assert_eq!(v4_period(&v4("tiny-v4/config.json")), None);
    }
}
