//! `deepinfer lower` for a DeepSeek-V4 model: its step graphs ([`crate::model::v4::step`]) in
//! the layout MLA models lower to (see [`super`]): the unpacked prefill chunk, a packed prefill
//! of two sequences, and a decode graph per batch size, each with the inputs and CPU-backend
//! outputs of one real step when token ids are given, so that `scripts/xla_check.py` runs them
//! in XLA and checks their logits against transformers'. V4 graphs hold their matrices in
//! `--dtype` (f32 or bf16), multiply them as `--dots` says, return every fed token's logits
//! and end in the full sampler, as the runners' do; with `--split-sampler`, each decode graph
//! ends at the logits and is followed by its sampling graph, as a split capture compiles
//! them. A decode step's rows all feed sequence A (so each row's logits are transformers'),
//! row 0 greedy and the others through the sampler's filters, biases and masks. Under `--tp N`
//! each rank's inputs are its cut of the weights ([`crate::model::v4::shard`]), as for MLA
//! models.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor as CTensor};

use crate::backend::cpu::{self, Group, DEFAULT_COLLECTIVE_TIMEOUT};
use crate::config::v4::V4Config;
use crate::deployment::RunnerConfig;
use crate::error::{Error, Result};
use crate::host::candle_dtype;
use crate::model::v4::step::{build_step, cache_roots, V4Step};
use crate::model::v4::{shard, tensors};
use crate::model::{self, CacheLayout, LogitsOutput, MoeStrategy, Sampler, WeightSpecs};
use crate::runner::step::{self, DecodeRow, LogitControls, PrefillChunk, SamplingParams};
use crate::weights::Checkpoint;

use super::{
    bind, carried_logits, io_err, probe_controls, probe_mask, probe_sampling, write_graph,
    write_manifest, write_step, LowerOptions, Manifest, PACKED_SEQS,
};

/// Lowers V4 model `cfg` (from `model_dir`) into `out`.
pub(super) fn lower(
    cfg: &V4Config,
    model_dir: &Path,
    out: &Path,
    opts: &LowerOptions,
    ranks: usize,
) -> Result<Manifest> {
    if let Some(why) = shard::indivisible(cfg, ranks) {
        return Err(Error::InvalidInput(why));
    }
    // The checkpoint when inputs are written (`auto` follows what it saved), else config.json.
    let checkpoint = match &opts.inputs_from_token_ids {
        Some(_) => Some(Checkpoint::open(model_dir)?),
        None => None,
    };
    let saved = checkpoint.as_ref().and_then(Checkpoint::float_dtype);
    let precision = opts.precision.v4(saved.or(cfg.saved_dtype))?;
    let max_batch = opts.batch_sizes.iter().copied().max().unwrap_or(1);
    let rc = RunnerConfig::for_limits(max_batch, opts.ctx);
    let block = rc.block_size;
    if rc.buckets.max_len() != opts.ctx {
        return Err(Error::InvalidInput(format!(
            "--ctx {} must be a multiple of the block size {block}",
            opts.ctx
        )));
    }
    // The scratch block and two sequences at full length (the packed prefill's inputs).
    let blocks = 2 * (opts.ctx / block) + 1;
    let layout = CacheLayout::new(block, blocks, precision.kv_cache, max_batch);
    std::fs::create_dir_all(out).map_err(io_err(out))?;
    let t = rc.buckets.prefill_chunk;
    let mut graphs = Vec::new();
    for seqs in [1, PACKED_SEQS] {
        let spec = V4Step {
            rows: t,
            seqs,
            ctx: opts.ctx,
            decode: false,
            ranks,
            logits: LogitsOutput::AllPositions,
            sampler: Sampler::Full,
            moe: MoeStrategy::Gather,
            weights: precision.weights,
            dots: opts.dots,
        };
        graphs.push((build_step(cfg, &layout, &spec)?, "prefill", t, seqs));
    }
    // A split decode step's sampling graph is every model's ([`model::build_sample`]): it
    // reads only the carried logits and the sampling inputs.
    let model_cfg = cfg.clone().into_model_config();
    let specs = WeightSpecs::sharded(&model_cfg, &precision.with_dots(opts.dots), ranks)?;
    for &b in &opts.batch_sizes {
        let spec = V4Step {
            rows: b,
            seqs: b,
            ctx: opts.ctx,
            decode: true,
            ranks,
            logits: LogitsOutput::AllPositions,
            sampler: match opts.split_sampler {
                true => Sampler::Deferred,
                false => Sampler::Full,
            },
            moe: MoeStrategy::Gather,
            weights: precision.weights,
            dots: opts.dots,
        };
        graphs.push((build_step(cfg, &layout, &spec)?, "decode", b, b));
        if opts.split_sampler {
            let sample = model::build_sample(&model_cfg, &specs, &layout, b)?;
            graphs.push((sample, "sample", b, b));
        }
    }
    let mut manifest = Manifest::new(ranks, cfg.vocab_size);
    for (g, kind, rows, seqs) in &graphs {
        write_graph(g, kind, *rows, *seqs, opts.ctx, None, out, &mut manifest)?;
    }
    let (Some(tokens), Some(checkpoint)) = (&opts.inputs_from_token_ids, &checkpoint) else {
        return write_manifest(out, manifest);
    };
    if tokens.len() < 2 || tokens.len() > opts.ctx.min(t + 1) {
        return Err(Error::InvalidInput(format!(
            "--inputs-from-token-ids needs 2 to {} tokens (one prefill chunk, then one decode step)",
            opts.ctx.min(t + 1)
        )));
    }
    let full = tensors::load(cfg, checkpoint, precision.weights)?;
    let weights = (0..ranks)
        .map(|r| shard::rank_weights(cfg, &full, ranks, r))
        .collect::<Result<Vec<_>>>()?;
    let empty = cache_roots(cfg, &layout)?
        .into_iter()
        .map(|r| {
            let zeros = CTensor::zeros(r.shape().to_vec(), candle_dtype(r.dtype), &Device::Cpu);
            Ok((r.name, zeros?))
        })
        .collect::<Result<Vec<_>>>()?;
    let (prompt, last) = tokens.split_at(tokens.len() - 1);
    // Sequence A (the unpacked prefill, then decode) in the blocks after the scratch block,
    // sequence B (the packed prefill's second chunk) in the ones after those.
    let per_seq = (opts.ctx / block) as u32;
    let first = step::SCRATCH_BLOCK + 1;
    let a: Vec<u32> = (first..first + per_seq).collect();
    let b: Vec<u32> = (first + per_seq..first + 2 * per_seq).collect();
    let vocab = cfg.vocab_size;
    let meta = |chunks: &[PrefillChunk<'_>], seqs| {
        step::prefill_step(chunks, t, seqs, opts.ctx, block, vocab)
    };
    // The packed step continues B, whose first half an unwritten step cached, beside A's
    // first half from scratch: both chunks' rows predict known positions of the prompt.
    let half = prompt.len().div_ceil(2);
    let (unpacked, _, _, _) = &graphs[0];
    let prep = meta(&[chunk(&prompt[..half], 0, &b, B_STATE)], 1)?;
    let inputs = (0..ranks)
        .map(|r| Ok(bind(unpacked, &weights[r], &prep, &empty, r, ranks)?.0))
        .collect::<Result<Vec<_>>>()?;
    let group = Group::new(ranks, DEFAULT_COLLECTIVE_TIMEOUT);
    let outs: HashMap<String, CTensor> = unpacked
        .outputs()
        .iter()
        .map(|o| o.name.clone())
        .zip(cpu::run_group(unpacked, &inputs, &group, 0)?.swap_remove(0))
        .collect();
    let half_root = named_roots(&empty, &outs)?;
    let mut after_prompt = None;
    // A split decode step's logits, from its forward graph to its sampling graph.
    let mut carried: Option<CTensor> = None;
    let allowed = probe_mask(vocab);
    for ((g, kind, rows, seqs), entry) in graphs.iter().zip(manifest.graphs.iter_mut()) {
        let pad = |real: Vec<Option<usize>>| {
            let n = real.len();
            real.into_iter()
                .chain(std::iter::repeat_n(None, rows - n))
                .collect()
        };
        match (*kind, *seqs) {
            ("prefill", 1) => {
                entry.reference_positions = Some(pad((0..prompt.len()).map(Some).collect()));
                let m = meta(&[chunk(prompt, 0, &a, A_STATE)], 1)?;
                let outs = write_step(g, &weights, &m, &empty, out, entry)?;
                after_prompt = Some(named_roots(&empty, &outs)?);
            }
            ("prefill", _) => {
                entry.reference_positions = Some(pad((0..prompt.len()).map(Some).collect()));
                let chunks = [
                    chunk(&prompt[..half], 0, &a, A_STATE),
                    chunk(&prompt[half..], half, &b, B_STATE),
                ];
                write_step(g, &weights, &meta(&chunks, *seqs)?, &half_root, out, entry)?;
            }
            _ => {
                // Every row feeds the prompt's next token to sequence A: the same values to
                // the same slots, so each row's logits are transformers' at that position.
                // Row 0 is greedy; the others draw through the sampler's filters, biases and
                // masks (its logits output is before them).
                let root = after_prompt.as_ref().ok_or_else(|| {
                    Error::Internal("the decode graphs come after the prefill".into())
                })?;
                let rows_in: Vec<DecodeRow> = (0..*rows)
                    .map(|i| DecodeRow {
                        token: last[0],
                        position: prompt.len(),
                        blocks: &a,
                        sampling: probe_sampling(i),
                        controls: LogitControls {
                            state_row: A_STATE,
                            ..probe_controls(i, prompt.len(), &allowed)
                        },
                    })
                    .collect();
                let mut m = step::decode_step(&rows_in, *rows, opts.ctx, block, vocab)?;
                if *kind == "sample" {
                    m.push(carried_logits(g, carried.take())?);
                    write_step(g, &weights, &m, root, out, entry)?;
                    continue;
                }
                entry.reference_positions = Some(vec![Some(prompt.len()); *rows]);
                let outs = write_step(g, &weights, &m, root, out, entry)?;
                carried = outs.get(model::STEP_LOGITS).cloned();
            }
        }
    }
    write_manifest(out, manifest)
}

/// The state rows (of the rings) of sequence A, which the unpacked prefill and the decode
/// steps feed, and of sequence B, the packed prefill's second chunk.
const A_STATE: u32 = 1;
const B_STATE: u32 = 2;

/// A greedy prefill chunk of `tokens` from position `start`, in `blocks` and state row `state`.
fn chunk<'a>(tokens: &'a [u32], start: usize, blocks: &'a [u32], state: u32) -> PrefillChunk<'a> {
    PrefillChunk {
        tokens,
        start,
        blocks,
        sampling: SamplingParams::GREEDY,
        controls: LogitControls {
            state_row: state,
            ..LogitControls::NONE
        },
    }
}

/// The roots named in `template` with their values in `outputs` (a step's outputs by name).
fn named_roots(
    template: &[(&'static str, CTensor)],
    outputs: &HashMap<String, CTensor>,
) -> Result<Vec<(&'static str, CTensor)>> {
    template
        .iter()
        .map(|(name, _)| {
            let t = outputs
                .get(*name)
                .ok_or_else(|| Error::Internal(format!("a V4 step returned no `{name}` root")))?;
            Ok((*name, t.clone()))
        })
        .collect()
}
