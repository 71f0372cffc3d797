//! `deepinfer follow`: run some ranks of a model split over several instances, for a leader
//! (`deepinfer serve --ranks 0..K --followers ...`) elsewhere.

use std::net::TcpListener;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use deepinfer::deployment::{InstanceSecret, RankSpan};
use deepinfer::runner::{self, Backend};

#[derive(Args)]
pub(crate) struct FollowArgs {
    /// Checkpoint directory: the same model as the leader's (checked when it connects).
    #[arg(long)]
    model: PathBuf,
    /// Where graphs run: neuron (sim for a rehearsal on one machine).
    #[arg(long, default_value = "neuron")]
    backend: Backend,
    /// The global ranks this instance runs, FIRST..END: the next ones after the leader's (or
    /// the follower listed before this one), such as 32..64 for the second trn1.32xlarge of
    /// a --tp 64 model.
    #[arg(long, value_name = "FIRST..END")]
    ranks: RankSpan,
    /// Address to wait for the leader on (the one it lists in --followers). Only a leader that
    /// proves DEEPINFER_INSTANCE_SECRET (the same on both sides) is answered; the steps are not
    /// encrypted: bind the cluster's private network.
    #[arg(long, default_value = "0.0.0.0:7400")]
    listen: String,
}

/// Runs the command: one leader, then exits when it ends.
pub(crate) fn run(args: FollowArgs) -> Result<()> {
    if args.backend == Backend::Cpu {
        anyhow::bail!(
            "--backend cpu: a follower runs NeuronCores (on the CPU, --tp runs every rank in one \
             process)"
        );
    }
    let listener = TcpListener::bind(&args.listen)
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let secret =
        InstanceSecret::from_env()?.ok_or_else(|| InstanceSecret::missing("deepinfer follow"))?;
    let addr = listener.local_addr()?;
    eprintln!(
        "deepinfer: follower for ranks {} waiting for its leader on {addr}",
        args.ranks
    );
    runner::follow(
        args.backend,
        &args.model,
        args.ranks,
        listener,
        &secret,
        |setup| {
            eprintln!(
                "deepinfer: ranks {}..{} captured; running the leader's steps",
                setup.first,
                setup.first + setup.count
            )
        },
    )?;
    eprintln!("deepinfer: the leader ended; follower done");
    Ok(())
}
