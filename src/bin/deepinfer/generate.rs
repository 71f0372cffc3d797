//! `deepinfer generate`: one prompt's continuation, without a server.

use anyhow::{bail, Result};
use clap::Args;
use deepinfer::deployment::Limits;
use deepinfer::engine::{self, StopConditions};
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
    let mut runner = args
        .model
        .open(&dir, &Limits::new(1, prompt.len() + args.max_tokens))?;
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
    let ids = engine::generate(&mut runner, &prompt, sampling, &stop)?;
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
