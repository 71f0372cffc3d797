//! The secret a model's instances share ([`InstanceSecret`]), and the handshake proof that
//! keeps anything but the leader off a follower's port.
//!
//! A follower runs whatever steps its leader sends and answers with logits: a stranger that
//! could connect first would drive its NeuronCores and read outputs. So the leader proves it
//! knows a secret both sides were given in the environment ([`ENV_SECRET`]), without sending
//! it: on each connection the follower sends a fresh random challenge, and the leader's launch
//! carries HMAC-SHA256(secret, challenge ‖ launch). The follower checks it in constant time
//! before reading anything else; a connection that fails is answered `Failed`, closed and
//! logged, and the follower goes on waiting for its leader. A fresh challenge per connection
//! means a recorded handshake cannot be replayed. This authenticates the handshake only: the
//! steps that follow are not encrypted, so the network should still be the cluster's own (as
//! libnrt's collectives' is).

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

/// The variable holding the secret, the same on the leader and every follower.
pub const ENV_SECRET: &str = "DEEPINFER_INSTANCE_SECRET";

/// Bytes of a challenge.
pub(crate) const CHALLENGE_BYTES: usize = 32;

/// The fewest characters a secret may have: short ones can be guessed offline from one
/// recorded handshake.
const MIN_SECRET_CHARS: usize = 16;

/// The shared secret of a leader and its followers. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct InstanceSecret(Vec<u8>);

impl std::fmt::Debug for InstanceSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InstanceSecret(..)")
    }
}

impl InstanceSecret {
    /// A secret of at least 16 characters.
    pub fn new(secret: &str) -> Result<Self> {
        if secret.chars().count() < MIN_SECRET_CHARS {
            return Err(Error::InvalidInput(format!(
                "{ENV_SECRET} has {} characters; use at least {MIN_SECRET_CHARS} (for example \
                 the output of `openssl rand -hex 32`), the same on the leader and every \
                 follower",
                secret.chars().count()
            )));
        }
        Ok(InstanceSecret(secret.as_bytes().to_vec()))
    }

    /// The secret in [`ENV_SECRET`], `None` when it is unset or empty.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(ENV_SECRET) {
            Ok(s) if !s.is_empty() => Self::new(&s).map(Some),
            Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(Error::InvalidInput(format!(
                "{ENV_SECRET} is not valid UTF-8"
            ))),
        }
    }

    /// The error for a leader or follower started without a secret.
    pub fn missing(role: &str) -> Error {
        Error::InvalidInput(format!(
            "{role} needs {ENV_SECRET}: the same secret (at least {MIN_SECRET_CHARS} \
             characters, e.g. `openssl rand -hex 32`) on the leader and every follower, so that \
             only the leader can drive a follower"
        ))
    }

    fn mac(&self, challenge: &[u8], launch: &str) -> Result<Hmac<Sha256>> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0)
            .map_err(|e| Error::Internal(format!("HMAC key: {e}")))?;
        mac.update(challenge);
        mac.update(launch.as_bytes());
        Ok(mac)
    }

    /// The leader's proof for `challenge` and the launch it sends (`launch`, its JSON): hex.
    pub(crate) fn prove(&self, challenge: &[u8], launch: &str) -> Result<String> {
        let tag = self.mac(challenge, launch)?.finalize().into_bytes();
        Ok(tag.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Whether `proof` (hex) is the leader's for `challenge` and `launch`, compared in
    /// constant time.
    pub(crate) fn verify(&self, challenge: &[u8], launch: &str, proof: &str) -> bool {
        let Some(bytes) = from_hex(proof) else {
            return false;
        };
        self.mac(challenge, launch)
            .is_ok_and(|m| m.verify_slice(&bytes).is_ok())
    }
}

/// A fresh random challenge, from the operating system's generator.
pub(crate) fn challenge() -> Result<[u8; CHALLENGE_BYTES]> {
    let mut c = [0u8; CHALLENGE_BYTES];
    getrandom::fill(&mut c)
        .map_err(|e| Error::Unavailable(format!("no random bytes for a challenge: {e}")))?;
    Ok(c)
}

/// Bytes of a hex string, `None` if it is not one.
pub(crate) fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Hex of `bytes`.
pub(crate) fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_verifies_only_for_its_secret_challenge_and_launch() {
        let s = InstanceSecret::new("0123456789abcdef-secret").unwrap();
        let c = challenge().unwrap();
        let p = s.prove(&c, "{\"tp\":4}").unwrap();
        assert!(s.verify(&c, "{\"tp\":4}", &p));
        assert!(!s.verify(&c, "{\"tp\":8}", &p), "another launch");
        let other = challenge().unwrap();
        assert_ne!(c, other);
        assert!(
            !s.verify(&other, "{\"tp\":4}", &p),
            "a replay on a fresh challenge"
        );
        let wrong = InstanceSecret::new("another-secret-of-16").unwrap();
        assert!(!wrong.verify(&c, "{\"tp\":4}", &p), "another secret");
        assert!(!s.verify(&c, "{\"tp\":4}", "zz"), "not hex");
        assert!(!s.verify(&c, "{\"tp\":4}", ""), "empty");
    }

    #[test]
    fn a_short_secret_is_refused_and_debug_hides_it() {
        let e = InstanceSecret::new("short").unwrap_err().to_string();
        assert!(e.contains("at least 16"), "{e}");
        let s = InstanceSecret::new("a-long-enough-secret").unwrap();
        assert!(!format!("{s:?}").contains("enough"));
        assert_eq!(
            from_hex(&to_hex(&[0, 1, 254, 255])),
            Some(vec![0, 1, 254, 255])
        );
    }
}
