//! Driving a runner for one sequence: chunked prefill, then decode until a stop.
//!
//! These single-sequence drivers serve the CLI's `generate` and `score`; the server's
//! [`super::Scheduler`] makes the same runner calls for many sequences at once.

use crate::error::{Error, Result};
use crate::model::LogitsOutput;
use crate::runner::step::{DecodeRow, PrefillChunk, SamplingParams};
use crate::runner::{Runner, Step, StepOutput};

use super::BlockAllocator;

/// When generation stops.
#[derive(Debug, Clone, Default)]
pub struct StopConditions {
    /// Generate at most this many tokens.
    pub max_tokens: usize,
    /// Stop after producing any of these (it is included in the output).
    pub stop_token_ids: Vec<u32>,
}

fn check_prompt<R: Runner + ?Sized>(runner: &R, prompt: &[u32], extra: usize) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::InvalidInput("the prompt is empty".into()));
    }
    let max_len = runner.runner_config().buckets.max_len();
    if prompt.len() + extra > max_len {
        return Err(Error::InvalidInput(format!(
            "the prompt ({} tokens) plus {extra} new tokens exceeds the context of {max_len} tokens",
            prompt.len()
        )));
    }
    Ok(())
}

/// A block allocator over the runner's whole cache: one sequence owns all of it.
fn allocator<R: Runner + ?Sized>(runner: &R) -> Result<BlockAllocator> {
    let rc = runner.runner_config();
    BlockAllocator::new(rc.num_blocks, rc.block_size)
}

/// Prefills `prompt` chunk by chunk into `blocks`; returns every chunk's output.
fn prefill<R: Runner + ?Sized>(
    runner: &mut R,
    alloc: &mut BlockAllocator,
    prompt: &[u32],
    blocks: &mut Vec<u32>,
    sampling: SamplingParams,
    logits: LogitsOutput,
) -> Result<Vec<StepOutput>> {
    let chunk_size = runner.runner_config().buckets.prefill_chunk;
    alloc.grow(blocks, prompt.len())?;
    let mut outs = Vec::new();
    for (i, tokens) in prompt.chunks(chunk_size).enumerate() {
        let chunk = PrefillChunk {
            tokens,
            start: i * chunk_size,
            blocks,
            sampling,
            controls: crate::runner::step::LogitControls::NONE,
        };
        outs.push(runner.replay(&Step::Prefill {
            chunks: &[chunk],
            logits,
        })?);
    }
    Ok(outs)
}

/// Generates up to `stop.max_tokens` tokens after `prompt`, on any [`Runner`]. The sequence
/// may use the runner's whole cache.
pub fn generate<R: Runner + ?Sized>(
    runner: &mut R,
    prompt: &[u32],
    sampling: SamplingParams,
    stop: &StopConditions,
) -> Result<Vec<u32>> {
    check_prompt(runner, prompt, stop.max_tokens)?;
    let mut alloc = allocator(runner)?;
    let mut blocks = Vec::new();
    generate_into(runner, &mut alloc, prompt, sampling, stop, &mut blocks)
}

fn generate_into<R: Runner + ?Sized>(
    runner: &mut R,
    alloc: &mut BlockAllocator,
    prompt: &[u32],
    sampling: SamplingParams,
    stop: &StopConditions,
    blocks: &mut Vec<u32>,
) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    if stop.max_tokens == 0 {
        return Ok(out);
    }
    let first = prefill(runner, alloc, prompt, blocks, sampling, LogitsOutput::None)?;
    let mut token = sampled(first.last())?;
    loop {
        out.push(token);
        if out.len() >= stop.max_tokens || stop.stop_token_ids.contains(&token) {
            return Ok(out);
        }
        let position = prompt.len() + out.len() - 1;
        alloc.grow(blocks, position + 1)?;
        let step = runner.replay(&Step::Decode {
            rows: &[DecodeRow {
                token,
                position,
                blocks,
                sampling,
                controls: crate::runner::step::LogitControls::NONE,
            }],
            logits: LogitsOutput::None,
        })?;
        token = sampled(Some(&step))?;
    }
}

/// The token a step sampled for its single row.
fn sampled(step: Option<&StepOutput>) -> Result<u32> {
    step.and_then(|o| o.next_tokens.first().copied())
        .ok_or_else(|| Error::Internal("the step returned no sampled token".into()))
}

/// The logits of every position of `tokens` (`[len][vocab]`), through prefill graphs.
pub fn score<R: Runner + ?Sized>(runner: &mut R, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
    check_prompt(runner, tokens, 0)?;
    let mut alloc = allocator(runner)?;
    let mut blocks = Vec::new();
    let outs = prefill(
        runner,
        &mut alloc,
        tokens,
        &mut blocks,
        SamplingParams::GREEDY,
        LogitsOutput::AllPositions,
    )?;
    Ok(outs
        .into_iter()
        .flat_map(|o| o.logits.unwrap_or_default())
        .collect())
}
