//! `deepinfer score`: the logits of every position of a token sequence.

use anyhow::Result;
use clap::Args;
use deepinfer::deployment::Limits;
use deepinfer::engine;

use crate::{emit, ModelArgs};

#[derive(Args)]
pub(crate) struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The tokens, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    token_ids: Vec<u32>,
}

/// Runs the command.
pub(crate) fn run(args: ScoreArgs) -> Result<()> {
    let dir = args.model.dir()?;
    let mut runner = args
        .model
        .open(&dir, &Limits::new(1, args.token_ids.len()))?;
    let logits = engine::score(&mut runner, &args.token_ids)?;
    emit(&serde_json::json!({ "logits": logits }).to_string())?;
    Ok(())
}
