//! A follower's side of one model over several instances (`deepinfer follow`): waits for its
//! leader, opens its ranks within the leader's launch, and runs the steps the leader sends. The
//! protocol and the leader's side are in [`super::instances`]; this module opens a device runner
//! ([`prepare_device`]), so it sits above both the instances protocol and the device runner.

use std::io::ErrorKind as IoKind;
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use super::instances::wire::{read_frame, text, write_text, Done, StepMessage, Tag};
use super::instances::{lost, Launch, Setup};
use super::open::prepare_device;
use super::{Backend, Runner};
use crate::deployment::secret::{self, InstanceSecret, ENV_SECRET};
use crate::deployment::RankSpan;
use crate::error::{Error, Result};

/// How long a follower waits for a connection's launch before refusing it: a leader sends
/// it at once; a stranger that sends nothing must not hold the port.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// The follower's half of the handshake on a new connection: sends a fresh challenge, reads
/// the launch and checks its proof of `secret`. The launch, or why the peer is refused.
fn authenticate(stream: &mut TcpStream, peer: &str, secret: &InstanceSecret) -> Result<Launch> {
    stream
        .set_nodelay(true)
        .and_then(|()| stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)))
        .map_err(|e| lost(peer, "configuring the connection", e))?;
    let challenge = secret::challenge()?;
    write_text(stream, Tag::Challenge, &secret::to_hex(&challenge))
        .map_err(|e| lost(peer, "sending the challenge", e))?;
    let body = match read_frame(stream) {
        Ok(Ok((Tag::Hello, body))) => text(body)?,
        Ok(Ok((tag, _))) => return Err(lost(peer, "expected the launch, got", tag as u8)),
        Ok(Err(e)) => return Err(e),
        Err(e) => return Err(lost(peer, "reading the launch", e)),
    };
    let (proof, json) = body.split_once('\n').unwrap_or(("", body.as_str()));
    if !secret.verify(&challenge, json, proof) {
        return Err(lost(
            peer,
            "authentication failed",
            format!("the launch does not prove {ENV_SECRET}: is it the same on both sides?"),
        ));
    }
    serde_json::from_str(json).map_err(|e| lost(peer, "reading the launch", e))
}

/// Runs a follower (`deepinfer follow`): waits on `listener` for its leader (the first
/// connection whose launch proves `secret`; others are refused and logged), opens the model at
/// `model` on `backend` for global ranks `ranks` within the leader's launch, captures, and runs
/// every step the leader sends until it says goodbye. `ready` is told once the runner is
/// captured. Returns when the leader ends (or an error when it vanishes mid-step, or the
/// launch cannot be served here: a failure the leader is also told of).
pub fn follow(
    backend: Backend,
    model: &Path,
    ranks: RankSpan,
    listener: TcpListener,
    secret: &InstanceSecret,
    ready: impl FnOnce(&Setup),
) -> Result<()> {
    let (mut stream, peer, launch) = loop {
        let (mut stream, peer) = listener
            .accept()
            .map_err(|e| Error::Unavailable(format!("waiting for the leader: {e}")))?;
        let peer = peer.to_string();
        match authenticate(&mut stream, &peer, secret) {
            Ok(launch) => break (stream, peer, launch),
            Err(e) => {
                // Refused before it could send a step or read an output; keep waiting.
                let _ = write_text(&mut stream, Tag::Failed, &e.to_string());
                tracing::warn!("refused a connection from {peer}: {e}");
            }
        }
    };
    stream
        .set_read_timeout(None)
        .map_err(|e| lost(&peer, "configuring the connection", e))?;
    let opened = launch
        .limits(ranks)
        .and_then(|limits| prepare_device(backend, model, &limits));
    let mut runner = match opened {
        Ok(r) => r,
        Err(e) => {
            let _ = write_text(&mut stream, Tag::Failed, &e.to_string());
            return Err(e);
        }
    };
    let setup = runner.setup();
    let json = serde_json::to_string(&setup).map_err(|e| Error::Internal(format!("setup: {e}")))?;
    write_text(&mut stream, Tag::Welcome, &json)
        .map_err(|e| lost(&peer, "answering the launch", e))?;
    // Capture only when the leader has checked every setup (see "Launch").
    match read_frame(&mut stream) {
        Ok(Ok((Tag::Capture, _))) => {}
        Ok(Ok((Tag::Failed, body))) => return Err(lost(&peer, "not captured", text(body)?)),
        Ok(Ok((tag, _))) => return Err(lost(&peer, "expected the go-ahead, got", tag as u8)),
        Ok(Err(e)) => return Err(e),
        Err(e) => return Err(lost(&peer, "waiting for the go-ahead", e)),
    }
    let buckets = runner.runner_config().buckets.clone();
    if let Err(e) = runner.capture(&buckets) {
        let _ = write_text(&mut stream, Tag::Failed, &e.to_string());
        return Err(e);
    }
    write_text(&mut stream, Tag::Captured, "")
        .map_err(|e| lost(&peer, "saying it is captured", e))?;
    ready(&setup);
    loop {
        let body = match read_frame(&mut stream) {
            Ok(Ok((Tag::Step, body))) => body,
            Ok(Ok((Tag::Bye, _))) => return Ok(()),
            Ok(Ok((tag, _))) => return Err(lost(&peer, "expected a step, got", tag as u8)),
            Ok(Err(e)) => return Err(e),
            Err(e) if e.kind() == IoKind::UnexpectedEof => {
                return Err(lost(&peer, "the leader went away", e))
            }
            Err(e) => return Err(lost(&peer, "reading a step", e)),
        };
        let done = match StepMessage::read(&body).and_then(|s| runner.run_followed(s)) {
            Ok(logits) => Done::Ran(logits),
            Err(e) => Done::Failed {
                collective: e.is_collective_failure(),
                message: e.to_string(),
            },
        };
        if let Err(e) = done.write(&mut stream)? {
            return Err(lost(&peer, "answering a step", e));
        }
    }
}
