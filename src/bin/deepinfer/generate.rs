//! `deepinfer generate`: one prompt's continuation, without a server.

use anyhow::{bail, Result};
use clap::Args;
use deepinfer::deployment::Limits;
use deepinfer::engine::{self, Event, GenerationParams, Scheduler, StopConditions};
use deepinfer::runner::step::SamplingParams;
use deepinfer::tokenizer::ChatMessage;

use crate::{emit, ModelArgs};

#[derive(Args)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(
        long,
        conflicts_with = "token_ids",
        required_unless_present = "token_ids"
    )]
    prompt: Option<String>,
    /// The prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
    /// Wrap the prompt in the model's chat template as one user message.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass; 1 disables it.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Sample among the k most likely tokens; 0 disables it.
    #[arg(long, default_value_t = 0)]
    top_k: i32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u32,
    /// Tokens to draft a step with the model's multi-token-prediction layer and verify in one
    /// forward pass (speculative decoding: greedy, or sampled by rejection sampling; the CPU
    /// backend only); 0 off. Prints the acceptance to stderr.
    #[arg(long, default_value_t = 0)]
    speculative_tokens: usize,
    /// Print `{"token_ids": [...], "text": "..."}` instead of the text.
    #[arg(long)]
    json: bool,
}

/// Runs the command.
pub(crate) fn run(args: GenerateArgs) -> Result<()> {
    let dir = args.model.dir()?;
    let tokenizer = crate::tokenizer_of(&dir)?;
    let prompt = match (&args.prompt, &args.token_ids, &tokenizer) {
        (_, Some(ids), _) => ids.clone(),
        (Some(text), None, Some(tok)) if args.chat => {
            let msg = ChatMessage::text("user", text);
            tok.encode(&tok.apply_chat_template(&[msg], true)?, false)?
        }
        (Some(text), None, Some(tok)) => tok.encode(text, true)?,
        (Some(_), None, None) => bail!(
            "{} has no tokenizer.json: pass --token-ids instead of --prompt",
            dir.display()
        ),
        (None, None, _) => bail!("pass --prompt or --token-ids"),
    };
    // One sequence; with speculation a device verifies its last token and drafts as rows of
    // one decode graph, so the batch buckets reach that many rows.
    let limits = Limits {
        speculative_tokens: args.speculative_tokens,
        ..Limits::new(1 + args.speculative_tokens, prompt.len() + args.max_tokens)
    };
    let mut runner = args.model.open(&dir, &limits)?;
    let eos: Vec<u32> = match &tokenizer {
        Some(t) => t
            .eos_token_id()
            .into_iter()
            .chain(runner.config().eos_token_ids.iter().copied())
            .collect(),
        None => runner.config().eos_token_ids.clone(),
    };
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        ..deepinfer::runner::step::SamplingParams::GREEDY
    };
    let stop = StopConditions {
        max_tokens: args.max_tokens,
        stop_token_ids: eos,
    };
    let ids = match args.speculative_tokens {
        0 => engine::generate(&mut runner, &prompt, sampling, &stop)?,
        _ => speculate(runner, prompt, sampling, stop)?,
    };
    let text = match &tokenizer {
        Some(t) => t.decode_generated(&ids, true)?,
        None => String::new(),
    };
    if args.json {
        emit(&serde_json::json!({ "token_ids": ids, "text": text }).to_string())?;
    } else if tokenizer.is_some() {
        emit(&format!("{}{text}", args.prompt.as_deref().unwrap_or("")))?;
    } else {
        emit(
            &ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(","),
        )?;
    }
    Ok(())
}

/// [`engine::generate`] with speculative decoding: the one request through the scheduler,
/// which drafts and verifies; the acceptance goes to stderr.
fn speculate(
    runner: Box<dyn deepinfer::runner::Runner>,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    stop: StopConditions,
) -> Result<Vec<u32>> {
    let mut scheduler = Scheduler::new(runner, None, stop.stop_token_ids)?;
    let params = GenerationParams {
        sampling,
        ..GenerationParams::greedy(stop.max_tokens)
    };
    scheduler.add(0, prompt, params)?;
    let mut ids = Vec::new();
    while !scheduler.is_idle() {
        for o in scheduler.step() {
            match o.event {
                Event::Token(t) => ids.push(t.token),
                Event::Failed { message, .. } => bail!("{message}"),
                _ => {}
            }
        }
    }
    let s = scheduler.speculative_stats();
    eprintln!(
        "speculative decoding: {} of {} drafted tokens accepted ({:.1}%), {:.2} tokens per \
         verify step",
        s.accepted,
        s.drafted,
        100.0 * s.acceptance_rate(),
        s.tokens_per_row_step()
    );
    Ok(ids)
}
