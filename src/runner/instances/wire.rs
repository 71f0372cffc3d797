//! The messages a leader and its followers exchange, and their bytes on the TCP stream.
//!
//! Every message is one frame: a little-endian `u32` length, then that many bytes, the first
//! of which is the message's tag. Numbers are little-endian, strings a `u32` length and UTF-8,
//! arrays their element count and raw values. A step's metadata is a few kilobytes (a
//! megabyte at most, for a constrained batch's allowed-token mask over a 129k vocabulary), so
//! the format favours being obvious over being compact; no general serializer is needed for
//! three kinds of array. The handshake's payloads are JSON (serde), read once per launch.

use std::borrow::Cow;
use std::io::{Read, Write};
use std::ops::Range;

use crate::deployment::StepKind;
use crate::error::{Error, Result};
use crate::runner::step::{HostArray, HostData};

/// Sent first by every frame's reader to bound what a broken or hostile peer can make it
/// allocate: a step's largest array is `rows x vocab / 32` words (1 MB at batch 64), and
/// returned logits at most `chunk x vocab / tp` f32 per rank.
const MAX_FRAME: usize = 1 << 30;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Tag {
    /// Leader to follower: the proof of the shared secret (hex), a newline, and the launch
    /// (JSON, [`super::Launch`]).
    Hello = 1,
    /// Follower to leader: what it will capture (JSON, [`super::Setup`]), before capturing.
    Welcome = 2,
    /// Leader to follower: run one step ([`StepMessage`]).
    Step = 3,
    /// Follower to leader: the step ran ([`Done`]).
    Done = 4,
    /// Leader to follower: no more steps; the follower releases its cores and ends.
    Bye = 5,
    /// Either way: the sender cannot go on; a UTF-8 reason.
    Failed = 6,
    /// Leader to follower: every setup agrees, capture now (the ranks of every instance must
    /// load at once: libnrt's collectives bootstrap waits for all of them).
    Capture = 7,
    /// Follower to leader: captured, ready for steps.
    Captured = 8,
    /// Follower to leader, first on every connection: a fresh random challenge (hex) the
    /// launch must prove the shared secret against ([`super::auth`]).
    Challenge = 9,
}

impl Tag {
    fn from_byte(b: u8) -> Result<Tag> {
        Ok(match b {
            1 => Tag::Hello,
            2 => Tag::Welcome,
            3 => Tag::Step,
            4 => Tag::Done,
            5 => Tag::Bye,
            6 => Tag::Failed,
            7 => Tag::Capture,
            8 => Tag::Captured,
            9 => Tag::Challenge,
            _ => return Err(malformed(format!("unknown message tag {b}"))),
        })
    }
}

fn malformed(msg: impl std::fmt::Display) -> Error {
    Error::InvalidInput(format!(
        "a malformed message from another instance ({msg}): are both running the same deepinfer?"
    ))
}

/// One step for a follower to run: the graph's key, the step's metadata, and which logits
/// rows (if any) it must send back.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StepMessage<'a> {
    pub kind: StepKind,
    pub rows: usize,
    pub seqs: usize,
    pub ctx: usize,
    /// The allowed-token array has every bit set (the runner may skip copying it).
    pub unmasked: bool,
    pub arrays: Cow<'a, [HostArray]>,
    /// Ranges of logits rows to return, in order; empty for none.
    pub logits_rows: Cow<'a, [Range<usize>]>,
}

/// A follower's answer to a step.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Done {
    /// The step ran on every rank of the follower; the logits asked for, rank after rank, row
    /// after row (empty when none were).
    Ran(Vec<f32>),
    /// It failed there; `collective` when the failure was a collective's (another rank's
    /// fault, seen from this one).
    Failed { message: String, collective: bool },
}

/// A frame under construction.
#[derive(Default)]
struct Out(Vec<u8>);

impl Out {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: usize) -> Result<()> {
        let v = u32::try_from(v).map_err(|_| Error::Internal(format!("{v} overflows a u32")))?;
        self.0.extend_from_slice(&v.to_le_bytes());
        Ok(())
    }
    fn str(&mut self, s: &str) -> Result<()> {
        self.u32(s.len())?;
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
    fn words<T: bytemuck::Pod>(&mut self, v: &[T]) -> Result<()> {
        self.u32(v.len())?;
        self.0.extend_from_slice(bytemuck::cast_slice(v));
        Ok(())
    }
}

/// A received frame being read.
struct In<'a>(&'a [u8]);

impl<'a> In<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(malformed("it ends early"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<usize> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    }
    fn str(&mut self) -> Result<String> {
        let n = self.u32()?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| malformed("a string is not UTF-8"))
    }
    fn words<T: bytemuck::Pod>(&mut self) -> Result<Vec<T>> {
        let n = self.u32()?;
        let size = n.checked_mul(std::mem::size_of::<T>());
        let bytes = self.take(size.ok_or_else(|| malformed("array size"))?)?;
        // Frames are byte-aligned: copy rather than cast in place.
        Ok(bytes
            .chunks_exact(std::mem::size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect())
    }
    fn end(&self) -> Result<()> {
        match self.0.is_empty() {
            true => Ok(()),
            false => Err(malformed("trailing bytes")),
        }
    }
}

/// Writes one frame: `tag` and `body`.
fn write_frame(w: &mut impl Write, tag: Tag, body: &[u8]) -> std::io::Result<()> {
    let len = (body.len() + 1) as u32;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(&[tag as u8])?;
    w.write_all(body)?;
    w.flush()
}

/// Reads one frame; an I/O error (a closed or timed-out stream) is returned as such, for the
/// caller to name the peer.
pub(crate) fn read_frame(r: &mut impl Read) -> std::io::Result<Result<(Tag, Vec<u8>)>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Ok(Err(malformed(format!("a frame of {len} bytes"))));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(Tag::from_byte(buf[0]).map(|t| (t, buf.split_off(1))))
}

/// Writes a message whose body is text (the handshake's JSON, a failure's reason).
pub(crate) fn write_text(w: &mut impl Write, tag: Tag, text: &str) -> std::io::Result<()> {
    write_frame(w, tag, text.as_bytes())
}

/// The text of a [`write_text`] frame.
pub(crate) fn text(body: Vec<u8>) -> Result<String> {
    String::from_utf8(body).map_err(|_| malformed("text that is not UTF-8"))
}

impl StepMessage<'_> {
    /// Writes this step as one [`Tag::Step`] frame.
    pub fn write(&self, w: &mut impl Write) -> Result<std::io::Result<()>> {
        let mut o = Out::default();
        o.u8(match self.kind {
            StepKind::Decode => 0,
            StepKind::Prefill => 1,
            StepKind::Sample => 2,
            StepKind::Greedy => 3,
            StepKind::Argmax => 4,
            StepKind::Draft => 5,
            StepKind::Verify => 6,
            StepKind::DecodeDraft => 7,
        });
        o.u32(self.rows)?;
        o.u32(self.seqs)?;
        o.u32(self.ctx)?;
        o.u8(self.unmasked as u8);
        o.u32(self.arrays.len())?;
        for a in self.arrays.iter() {
            o.str(a.name)?;
            o.u32(a.shape.len())?;
            for &d in &a.shape {
                o.u32(d)?;
            }
            match &a.data {
                HostData::I32(v) => {
                    o.u8(0);
                    o.words(v)?
                }
                HostData::F32(v) => {
                    o.u8(1);
                    o.words(v)?
                }
                HostData::U32(v) => {
                    o.u8(2);
                    o.words(v)?
                }
            }
        }
        o.u32(self.logits_rows.len())?;
        for r in self.logits_rows.iter() {
            o.u32(r.start)?;
            o.u32(r.end)?;
        }
        Ok(write_frame(w, Tag::Step, &o.0))
    }

    /// Reads a [`Tag::Step`] frame's body.
    pub fn read(body: &[u8]) -> Result<StepMessage<'static>> {
        let mut i = In(body);
        let kind = match i.u8()? {
            0 => StepKind::Decode,
            1 => StepKind::Prefill,
            2 => StepKind::Sample,
            3 => StepKind::Greedy,
            4 => StepKind::Argmax,
            5 => StepKind::Draft,
            6 => StepKind::Verify,
            7 => StepKind::DecodeDraft,
            k => return Err(malformed(format!("step kind {k}"))),
        };
        let (rows, seqs, ctx) = (i.u32()?, i.u32()?, i.u32()?);
        let unmasked = i.u8()? != 0;
        let n = i.u32()?;
        let mut arrays = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            let name = i.str()?;
            let name = super::super::step::staged_name(&name)
                .ok_or_else(|| malformed(format!("no metadata input is named `{name}`")))?;
            let dims = i.u32()?;
            let shape = (0..dims).map(|_| i.u32()).collect::<Result<Vec<_>>>()?;
            let data = match i.u8()? {
                0 => HostData::I32(i.words()?),
                1 => HostData::F32(i.words()?),
                2 => HostData::U32(i.words()?),
                t => return Err(malformed(format!("array type {t}"))),
            };
            arrays.push(HostArray { name, shape, data });
        }
        let n = i.u32()?;
        let logits_rows = (0..n)
            .map(|_| Ok(i.u32()?..i.u32()?))
            .collect::<Result<Vec<_>>>()?;
        i.end()?;
        Ok(StepMessage {
            kind,
            rows,
            seqs,
            ctx,
            unmasked,
            arrays: Cow::Owned(arrays),
            logits_rows: Cow::Owned(logits_rows),
        })
    }
}

impl Done {
    /// Writes this answer as one [`Tag::Done`] frame.
    pub fn write(&self, w: &mut impl Write) -> Result<std::io::Result<()>> {
        let mut o = Out::default();
        match self {
            Done::Ran(logits) => {
                o.u8(0);
                o.words(logits)?;
            }
            Done::Failed {
                message,
                collective,
            } => {
                o.u8(1 + *collective as u8);
                o.str(message)?;
            }
        }
        Ok(write_frame(w, Tag::Done, &o.0))
    }

    /// Reads a [`Tag::Done`] frame's body.
    pub fn read(body: &[u8]) -> Result<Done> {
        let mut i = In(body);
        let done = match i.u8()? {
            0 => Done::Ran(i.words()?),
            s @ (1 | 2) => Done::Failed {
                message: i.str()?,
                collective: s == 2,
            },
            s => return Err(malformed(format!("step status {s}"))),
        };
        i.end()?;
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step() -> StepMessage<'static> {
        StepMessage {
            kind: StepKind::Prefill,
            rows: 64,
            seqs: 2,
            ctx: 256,
            unmasked: true,
            arrays: Cow::Owned(vec![
                HostArray {
                    name: crate::model::inputs::INPUT_IDS,
                    shape: vec![64],
                    data: HostData::I32((0..64).map(|v| v - 3).collect()),
                },
                HostArray {
                    name: crate::model::inputs::ALLOWED_TOKENS,
                    shape: vec![2, 3],
                    data: HostData::U32(vec![u32::MAX, 0, 7, 1 << 31, 5, 6]),
                },
                HostArray {
                    name: crate::model::inputs::TEMPERATURE,
                    shape: vec![2],
                    data: HostData::F32(vec![0.7, f32::MIN_POSITIVE]),
                },
            ]),
            logits_rows: Cow::Owned(vec![3..4, 9..12]),
        }
    }

    fn frame_of(write: impl FnOnce(&mut Vec<u8>)) -> (Tag, Vec<u8>) {
        let mut bytes = Vec::new();
        write(&mut bytes);
        read_frame(&mut bytes.as_slice()).unwrap().unwrap()
    }

    #[test]
    fn a_step_reads_back_as_written() {
        let s = step();
        let (tag, body) = frame_of(|b| s.write(b).unwrap().unwrap());
        assert_eq!(tag, Tag::Step);
        assert_eq!(StepMessage::read(&body).unwrap(), s);
    }

    #[test]
    fn answers_read_back_as_written() {
        for d in [
            Done::Ran(vec![1.5, -0.0, f32::MAX]),
            Done::Ran(Vec::new()),
            Done::Failed {
                message: "graph `decode_b1_c64`: NRT_FAILURE".into(),
                collective: true,
            },
        ] {
            let (tag, body) = frame_of(|b| d.write(b).unwrap().unwrap());
            assert_eq!(tag, Tag::Done);
            assert_eq!(Done::read(&body).unwrap(), d);
        }
    }

    #[test]
    fn damaged_frames_are_errors_not_panics() {
        let s = step();
        let (_, body) = frame_of(|b| s.write(b).unwrap().unwrap());
        for cut in [0, 1, 5, body.len() / 2, body.len() - 1] {
            let e = StepMessage::read(&body[..cut]).unwrap_err().to_string();
            assert!(e.contains("malformed"), "{e}");
        }
        let mut longer = body.clone();
        longer.push(0);
        assert!(StepMessage::read(&longer).is_err());
        let mut renamed = body;
        renamed[22] = b'!'; // the first array name's first byte
        let e = StepMessage::read(&renamed).unwrap_err().to_string();
        assert!(e.contains("no metadata input"), "{e}");
        // A frame longer than any step, or of an unknown tag.
        let huge = (u32::MAX).to_le_bytes();
        assert!(read_frame(&mut huge.as_slice()).unwrap().is_err());
        let odd = [1, 0, 0, 0, 99];
        assert!(read_frame(&mut odd.as_slice()).unwrap().is_err());
        // A stream that ends mid-frame is an I/O error, for the caller to name the peer.
        let short = [9, 0, 0, 0, 3, 1];
        assert!(read_frame(&mut short.as_slice()).is_err());
    }
}
