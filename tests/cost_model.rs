//! The cost model on the published DeepSeek-V2-Lite and V3 configs (config.json alone): decode
//! graphs read at most 1.15x the floor at batch 1 and 64.

use std::path::PathBuf;

use deepinfer::export::{lower, LowerOptions};
use deepinfer::model::{Dots, PrecisionChoice};

#[test]
fn decode_reads_stay_near_the_floor_on_published_configs() {
    for name in ["deepseek-v2-lite", "deepseek-v3"] {
        let dir =
            std::env::temp_dir().join(format!("deepinfer-cost-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("fixtures/configs/{name}.json"));
        std::fs::copy(src, dir.join("config.json")).unwrap();
        let opts = LowerOptions {
            batch_sizes: vec![1, 64],
            ctx: 1024,
            inputs_from_token_ids: None,
            precision: PrecisionChoice::default(),
            dots: Dots::DEVICE,
            split_sampler: false,
            speculative: false,
        };
        let m = lower(&dir, &dir.join("out"), &opts).unwrap();
        let floored: Vec<_> = m.costs.iter().filter(|c| c.floor.is_some()).collect();
        // One decode graph per batch size has a floor; none would make the loop below vacuous.
        assert_eq!(
            floored.len(),
            opts.batch_sizes.len(),
            "{name}: decode graphs with a floor"
        );
        for c in floored {
            let ratio = c.bytes_read() as f64 / c.floor.unwrap().total();
            eprintln!("{name} {}: read/floor = {ratio:.3}", c.name);
            assert!(ratio <= 1.15, "{name} {}: {ratio}", c.name);
            assert!(
                ratio >= 0.99,
                "{name} {}: reads less than the floor ({ratio})",
                c.name
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Weight bytes as stored, against an independent count from the published config.json values
/// (written out here, not read through our config code) and the model cards' parameter counts:
/// DeepSeek-V2-Lite 15.7B, DeepSeek-V3 671B (without its multi-token-prediction module).
#[test]
fn weight_bytes_agree_with_an_independent_count() {
    use deepinfer::config::ModelConfig;
    use deepinfer::graph::DType;
    use deepinfer::model::{Precision, Quantize, WeightSpecs};

    struct Published {
        name: &'static str,
        hidden: u64,
        layers: u64,
        dense_layers: u64,
        vocab: u64,
        heads: u64,
        q_lora: Option<u64>,
        dense_inter: u64,
        expert_inter: u64,
        experts: u64,
        shared: u64,
        card_params: f64,
    }
    let models = [
        Published {
            name: "deepseek-v2-lite",
            hidden: 2048,
            layers: 27,
            dense_layers: 1,
            vocab: 102400,
            heads: 16,
            q_lora: None,
            dense_inter: 10944,
            expert_inter: 1408,
            experts: 64,
            shared: 2,
            card_params: 15.7e9,
        },
        Published {
            name: "deepseek-v3",
            hidden: 7168,
            layers: 61,
            dense_layers: 3,
            vocab: 129280,
            heads: 128,
            q_lora: Some(1536),
            dense_inter: 18432,
            expert_inter: 2048,
            experts: 256,
            shared: 1,
            card_params: 671e9,
        },
    ];
    for m in models {
        // MLA: kv_lora_rank 512, rope 64, nope 128, v 128 in both.
        let (rank, rope, nope, v) = (512, 64, 128, 128);
        let h = m.hidden;
        let q = match m.q_lora {
            Some(r) => r * h + r + m.heads * (nope + rope) * r,
            None => m.heads * (nope + rope) * h,
        };
        let attn = q + (rank + rope) * h + rank + m.heads * (nope + v) * rank + h * m.heads * v;
        let norms = 2 * h;
        let dense_mlp = 3 * m.dense_inter * h;
        let routed = m.experts * 3 * m.expert_inter * h;
        let router = m.experts * h
            + if m.name == "deepseek-v3" {
                m.experts
            } else {
                0
            };
        let moe_rest = m.shared * 3 * m.expert_inter * h;
        let moe_layers = m.layers - m.dense_layers;
        let total = m.layers * (attn + norms)
            + m.dense_layers * dense_mlp
            + moe_layers * (routed + router + moe_rest)
            + 2 * m.vocab * h
            + h;
        let rel = (total as f64 - m.card_params).abs() / m.card_params;
        assert!(
            rel < 0.005,
            "{}: independent count {total} vs the card's {}",
            m.name,
            m.card_params
        );

        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join(format!("fixtures/configs/{}.json", m.name));
        let cfg = ModelConfig::from_file(&path).unwrap();
        let bf16 = WeightSpecs::new(&cfg, &Precision::all(DType::BF16));
        assert_eq!(bf16.param_count() as u64, total, "{}", m.name);
        // bf16 everywhere except the f32 router.
        let router_bytes = moe_layers * router * 4;
        assert_eq!(
            bf16.bytes(),
            (total - moe_layers * router) * 2 + router_bytes,
            "{}",
            m.name
        );
        // int8 experts: one byte a routed weight, plus an f32 scale per output channel.
        let int8 = WeightSpecs::new(
            &cfg,
            &Precision {
                quantize: Quantize::ExpertsInt8,
                ..Precision::all(DType::BF16)
            },
        );
        let scales = moe_layers * m.experts * (2 * m.expert_inter + h) * 4;
        let want = bf16.bytes() - moe_layers * routed + scales;
        assert_eq!(int8.bytes(), want, "{}", m.name);
        // int4 experts: half a byte a routed weight, plus an f32 scale per 128 inputs of each
        // output channel (gate/up read `hidden` inputs, down `expert_inter`).
        let int4 = WeightSpecs::new(
            &cfg,
            &Precision {
                quantize: Quantize::ExpertsInt4,
                ..Precision::all(DType::BF16)
            },
        );
        let groups = 2 * m.expert_inter * h.div_ceil(128) + h * m.expert_inter.div_ceil(128);
        let scales4 = moe_layers * m.experts * groups * 4;
        let want4 = bf16.bytes() - 2 * moe_layers * routed + moe_layers * routed / 2 + scales4;
        assert_eq!(int4.bytes(), want4, "{}", m.name);
        eprintln!(
            "{}: {:.2} B parameters; bf16 {:.2} GB, int8 experts {:.2} GB, int4 experts {:.2} GB",
            m.name,
            total as f64 / 1e9,
            bf16.bytes() as f64 / 1e9,
            int8.bytes() as f64 / 1e9,
            int4.bytes() as f64 / 1e9
        );
    }
}

/// A measurement for issue 42, item 5 (a cheaper path for all-greedy decode steps on the
/// device), not a check of a target: per decode bucket of `serve`'s defaults (`--max-batch
/// 32 --max-len 2048`), the instructions (the Neuron instruction estimate) the in-graph sampler
/// adds to the plain-argmax graph ([`Sampler::Greedy`], what the CPU runs for such steps), its
/// share of the whole graph, and the estimated compile minutes of one more NEFF without it.
/// Run with `cargo test --release --test cost_model -- --ignored --nocapture`; the figures are
/// in benches/README.md. It fails only if the greedy graph is not the smaller.
#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn the_samplers_share_of_each_decode_graph() {
    use deepinfer::backend::hlo::emit;
    use deepinfer::backend::neuron::{check::estimate, footprint};
    use deepinfer::config::ModelConfig;
    use deepinfer::deployment::Limits;
    use deepinfer::graph::DType;
    use deepinfer::model::{
        self, GraphSpec, LogitsOutput, MoeStrategy, Precision, Quantize, Sampler, WeightSpecs,
    };
    use deepinfer::plan::{neff, Instance};

    let deployments = [
        (
            "deepseek-v2-lite",
            1,
            Quantize::ExpertsInt4,
            Instance::Trn1_2xlarge,
        ),
        (
            "deepseek-v2-lite",
            2,
            Quantize::ExpertsInt8,
            Instance::Trn1_2xlarge,
        ),
        (
            "deepseek-v2",
            32,
            Quantize::ExpertsInt8,
            Instance::Trn1_32xlarge,
        ),
    ];
    for (name, tp, quantize, instance) in deployments {
        let path =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("fixtures/configs/{name}.json"));
        let cfg = ModelConfig::from_file(&path).unwrap();
        let mut limits = Limits::new(32, 2048);
        limits.tp = tp;
        let rc = limits.runner_config(&cfg).unwrap();
        let precision = Precision {
            quantize,
            dots: Dots::DEVICE,
            ..Precision::all(DType::BF16)
        };
        let est = neff::estimate(&cfg, &precision, &rc, instance, false).unwrap();
        // The sampler does not depend on the layers: measured on one dense and one MoE layer.
        let mut short = cfg.clone();
        short.num_hidden_layers = cfg.first_k_dense_replace + cfg.moe_layer_freq.max(1);
        let specs = WeightSpecs::sharded(&short, &precision, tp).unwrap();
        let layout = rc.cache_layout();
        let (mut all, mut greedy_neffs, mut kept) = (0.0, 0.0, Vec::new());
        for g in &est.graphs {
            let total = g.footprint.instructions;
            let minutes = estimate::compile_minutes(total, false);
            if g.name.starts_with("decode_greedy_b") {
                // A greedy NEFF the capture keeps (`deployment::keep_paying_greedy`).
                kept.push((g.name.clone(), minutes));
                continue;
            }
            all += minutes;
            let Some((b, c)) = g
                .name
                .strip_prefix("decode_b")
                .and_then(|r| r.split_once("_c"))
            else {
                continue;
            };
            let (rows, ctx): (usize, usize) = (b.parse().unwrap(), c.parse().unwrap());
            let routing = cfg.routing.as_ref().unwrap();
            let instructions = |sampler| {
                let spec = GraphSpec {
                    rows,
                    seqs: rows,
                    ctx,
                    logits: LogitsOutput::None,
                    moe: MoeStrategy::for_tokens(routing, rows, tp),
                    sampler,
                };
                let g = model::build_decode(&short, &specs, &layout, &spec).unwrap();
                footprint::of_module(&emit::emit(&g).unwrap()).instructions
            };
            let (full, greedy) = (instructions(Sampler::Full), instructions(Sampler::Greedy));
            assert!(
                greedy < full,
                "{name} tp {tp} {}: {greedy} vs {full}",
                g.name
            );
            let sampler = full - greedy;
            let minutes = estimate::compile_minutes(total - sampler, false);
            greedy_neffs += minutes;
            eprintln!(
                "{name} tp {tp} {}: {total} instructions, the sampler {sampler} ({:.1}%); a \
                 greedy NEFF ~{minutes:.0} min",
                g.name,
                100.0 * sampler as f64 / total as f64
            );
        }
        eprintln!(
            "{name} tp {tp}: every NEFF ~{all:.0} min; greedy decode NEFFs ~{greedy_neffs:.0} min more"
        );
        let kept_minutes = kept.iter().fold(0.0, |sum, (_, m)| sum + m);
        let names: Vec<&str> = kept.iter().map(|(n, _)| n.as_str()).collect();
        eprintln!(
            "{name} tp {tp}: the capture keeps {} greedy NEFFs (the sampler at least 10%), \
             ~{kept_minutes:.0} min more: {names:?}",
            kept.len()
        );
    }
}
