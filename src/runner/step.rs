//! A step's metadata: the host arrays a decode or prefill graph reads, padded to its bucket.
//!
//! Padding rows and tokens write their cache rows into the scratch block and attend only to
//! scratch, so they cannot disturb a live sequence; their outputs are ignored.

use crate::error::{Error, Result};
use crate::model::inputs;

/// The reserved cache block that padding writes go to; the block allocator never hands it out.
pub const SCRATCH_BLOCK: u32 = 0;

/// The slot of position `pos` of a sequence with block table `table`.
pub fn slot(table: &[u32], block_size: usize, pos: usize) -> Result<i32> {
    let block = table.get(pos / block_size).ok_or_else(|| {
        Error::Internal(format!("position {pos} is beyond the sequence's blocks"))
    })?;
    Ok((*block as usize * block_size + pos % block_size) as i32)
}

/// The name of a staged host array named `name`: a metadata input's
/// ([`inputs::by_name`]), or the hidden states a draft step reads
/// ([`crate::model::mtp::HIDDEN`], written from the host like metadata).
pub(crate) fn staged_name(name: &str) -> Option<&'static str> {
    use crate::model::mtp::HIDDEN;
    inputs::by_name(name).or((name == HIDDEN).then_some(HIDDEN))
}

/// Host data of one metadata input.
#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    /// i32 values.
    I32(Vec<i32>),
    /// f32 values.
    F32(Vec<f32>),
    /// u32 values.
    U32(Vec<u32>),
}

/// One metadata input: its graph input name, shape and values.
#[derive(Debug, Clone, PartialEq)]
pub struct HostArray {
    /// The graph input it binds.
    pub name: &'static str,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its values, row-major.
    pub data: HostData,
}

/// Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): dividing logits by a smaller
/// one can overflow f32 (a temperature of 1e-40 turns every logit into ±inf and the draw into
/// NaN), and at this one sampling is already greedy in all but ties.
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// How one sequence's next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Below [`MIN_TEMPERATURE`] (and `<= 0`): greedy.
    pub temperature: f32,
    /// `<= 0` for no top-k.
    pub top_k: i32,
    /// `>= 1` for no top-p.
    pub top_p: f32,
    /// Seed of the counter-based generator.
    pub seed: u32,
    /// Tokens less likely than `min_p` times the likeliest (after temperature) are dropped;
    /// 0 for none (vLLM's `min_p`).
    pub min_p: f32,
    /// Subtracted once from the logit of every token generated so far (OpenAI's
    /// `presence_penalty`).
    pub presence_penalty: f32,
    /// Subtracted from each token's logit once per time it was generated (OpenAI's
    /// `frequency_penalty`).
    pub frequency_penalty: f32,
    /// Divides positive and multiplies negative logits of every token in the prompt or
    /// generated so far; 1 for none (vLLM's `repetition_penalty`).
    pub repetition_penalty: f32,
}

impl SamplingParams {
    /// Greedy decoding.
    pub const GREEDY: SamplingParams = SamplingParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        min_p: 0.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        repetition_penalty: 1.0,
    };

    /// Whether the row is greedy with no penalty: its token is the argmax of its logits (after
    /// [`LogitControls`], if any).
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature < MIN_TEMPERATURE
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.repetition_penalty == 1.0
    }
}

/// Most `logit_bias` entries one row carries (the graph's `[rows, LOGIT_BIAS_SLOTS]` inputs).
pub const LOGIT_BIAS_SLOTS: usize = crate::model::logits::LOGIT_BIAS_SLOTS;

/// What a row's logits go through besides the sampler, beyond [`SamplingParams`]: where its
/// penalty counts live on the device, additive biases and an allowed-token mask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitControls<'a> {
    /// The sequence's row of the sampling-state root (see `model::logits`): the scheduler gives
    /// each running sequence its own; 0 is the scratch row padding uses.
    pub state_row: u32,
    /// Tokens of the sequence that are prompt (the rest are generated, and what presence and
    /// frequency penalties count).
    pub prompt_len: usize,
    /// `(token, bias)` added to the logits, at most [`LOGIT_BIAS_SLOTS`], distinct tokens
    /// (`-inf` forbids a token: `min_tokens` uses it for end-of-sequence tokens).
    pub bias: &'a [(u32, f32)],
    /// Allowed tokens as bits (token `32 w + j` is bit `j` of word `w`), `vocab.div_ceil(32)`
    /// words; `None` allows every token.
    pub allowed: Option<&'a [u32]>,
}

impl LogitControls<'_> {
    /// No state, bias or mask.
    pub const NONE: LogitControls<'static> = LogitControls {
        state_row: 0,
        prompt_len: 0,
        bias: &[],
        allowed: None,
    };

    /// Whether the logits go through unchanged (no bias, every token allowed).
    pub fn is_identity(&self) -> bool {
        self.bias.is_empty() && self.allowed.is_none()
    }
}

/// One decoding sequence in a batch.
#[derive(Debug, Clone)]
pub struct DecodeRow<'a> {
    /// The token being fed (the last one generated).
    pub token: u32,
    /// Its position (tokens before it in the sequence).
    pub position: usize,
    /// The sequence's block table (already grown to hold `position + 1` tokens).
    pub blocks: &'a [u32],
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Penalty state, bias and mask.
    pub controls: LogitControls<'a>,
}

impl DecodeRow<'_> {
    /// Whether a step of such rows only needs each row's argmax (`Sampler::Greedy`): greedy,
    /// with no logit controls.
    pub fn is_plain_greedy(&self) -> bool {
        self.sampling.is_plain_greedy() && self.controls.is_identity()
    }
}

/// One chunk of a sequence's prompt.
#[derive(Debug, Clone)]
pub struct PrefillChunk<'a> {
    /// The chunk's tokens.
    pub tokens: &'a [u32],
    /// Position of the first of them.
    pub start: usize,
    /// The sequence's block table (already grown to hold `start + tokens.len()` tokens).
    pub blocks: &'a [u32],
    /// Sampling parameters for the token after the chunk.
    pub sampling: SamplingParams,
    /// Penalty state, bias and mask for that token.
    pub controls: LogitControls<'a>,
}

/// One chunk of a draft step ([`super::Step::Draft`]): rows of one sequence at consecutive
/// positions for its MTP layer (see [`crate::model::mtp`]), each drafting from the token after
/// it and a hidden state the runner's previous step left.
#[derive(Debug, Clone)]
pub struct DraftChunk<'a> {
    /// Each row's next token: the token at the row's position plus one.
    pub next_tokens: &'a [u32],
    /// Position of the first row.
    pub start: usize,
    /// The sequence's block table (holding `start + next_tokens.len()` positions).
    pub blocks: &'a [u32],
    /// For each row, the row of the previous step's hidden states it drafts from: a target
    /// step's (the main model's last hidden state at that position) or, chaining, a draft
    /// step's own.
    pub hidden_rows: &'a [usize],
}

impl<'a> DraftChunk<'a> {
    /// The chunk as a greedy prefill chunk of its next tokens: the same metadata, which is what
    /// a draft graph reads (it samples nothing, so no controls).
    pub fn as_prefill(&self) -> PrefillChunk<'a> {
        PrefillChunk {
            tokens: self.next_tokens,
            start: self.start,
            blocks: self.blocks,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls::NONE,
        }
    }
}

/// Reusable host arrays of one kind of step. Each call overwrites them in place: after the
/// first step of a given bucket shape nothing is allocated, so a replay loop that keeps one
/// `StepArrays` allocates nothing on the host either.
#[derive(Debug, Clone, Default)]
pub struct StepArrays {
    arrays: Vec<HostArray>,
    unmasked: bool,
    /// Arrays a shorter fill left over, kept for the next longer one to refill (a decode
    /// step's after a verify step's chunk arrays or a draft step's hidden states).
    spare: Vec<HostArray>,
}

impl StepArrays {
    /// The current contents, one array per metadata input.
    pub fn arrays(&self) -> &[HostArray] {
        &self.arrays
    }

    /// Whether the last fill's allowed-token array ([`inputs::ALLOWED_TOKENS`]) has every bit
    /// set (no row under a constraint). It is the one large array of a step (`rows x vocab /
    /// 32` words: 1 MB at 64 rows of a 129k vocabulary), and nearly always all ones, so a fill
    /// keeps the array when the last one left it all ones, and the device runner skips copying
    /// it into a buffer that already holds all ones.
    pub fn allowed_tokens_unmasked(&self) -> bool {
        self.unmasked
    }

    /// Overwrites rows `rows` of the last fill's allowed-token array with `masks` (each row's
    /// words in turn): masks computed after the fill, while the step's forward pass ran (see
    /// `Runner::replay_with_masks`).
    pub(crate) fn set_allowed_rows(&mut self, rows: &[usize], masks: &[u32]) -> Result<()> {
        let array = self
            .arrays
            .iter_mut()
            .find(|a| a.name == inputs::ALLOWED_TOKENS);
        let Some(HostArray {
            shape,
            data: HostData::U32(v),
            ..
        }) = array
        else {
            return Err(Error::Internal("no allowed-token array was filled".into()));
        };
        let words = shape.get(1).copied().unwrap_or(0);
        if words == 0 || masks.len() != rows.len() * words {
            return Err(Error::Internal(format!(
                "{} mask words for {} rows of {words}",
                masks.len(),
                rows.len()
            )));
        }
        for (&r, mask) in rows.iter().zip(masks.chunks(words)) {
            let row = v.get_mut(r * words..(r + 1) * words).ok_or_else(|| {
                Error::Internal(format!("a mask for row {r} beyond the filled rows"))
            })?;
            row.copy_from_slice(mask);
        }
        self.unmasked &= rows.is_empty();
        Ok(())
    }

    /// Replaces the contents with `arrays` filled elsewhere (a follower's, by its leader), whose
    /// allowed-token array is `unmasked` when every bit is set.
    pub(crate) fn replace(&mut self, arrays: Vec<HostArray>, unmasked: bool) {
        self.arrays = arrays;
        self.unmasked = unmasked;
    }

    /// Keeps the first `n` arrays, setting the others aside for a later fill.
    fn truncate(&mut self, n: usize) {
        while self.arrays.len() > n {
            if let Some(a) = self.arrays.pop() {
                self.spare.push(a);
            }
        }
    }

    /// Array `i`, named `name` with `shape`, emptied and typed like `empty`, ready to be filled.
    fn slot(
        &mut self,
        i: usize,
        name: &'static str,
        shape: &[usize],
        empty: HostData,
    ) -> &mut HostData {
        if self.arrays.len() <= i {
            let array = self.spare.pop().unwrap_or_else(|| HostArray {
                name,
                shape: Vec::new(),
                data: empty.clone(),
            });
            self.arrays.push(array);
        }
        let a = &mut self.arrays[i];
        a.name = name;
        a.shape.clear();
        a.shape.extend_from_slice(shape);
        match (&mut a.data, &empty) {
            (HostData::I32(v), HostData::I32(_)) => v.clear(),
            (HostData::F32(v), HostData::F32(_)) => v.clear(),
            (HostData::U32(v), HostData::U32(_)) => v.clear(),
            (d, _) => *d = empty,
        }
        &mut a.data
    }

    fn i32s(
        &mut self,
        i: usize,
        name: &'static str,
        shape: &[usize],
        values: impl Iterator<Item = i32>,
    ) {
        if let HostData::I32(v) = self.slot(i, name, shape, HostData::I32(Vec::new())) {
            v.extend(values);
        }
    }

    fn f32s(
        &mut self,
        i: usize,
        name: &'static str,
        shape: &[usize],
        values: impl Iterator<Item = f32>,
    ) {
        if let HostData::F32(v) = self.slot(i, name, shape, HostData::F32(Vec::new())) {
            v.extend(values);
        }
    }

    fn u32s(
        &mut self,
        i: usize,
        name: &'static str,
        shape: &[usize],
        values: impl Iterator<Item = u32>,
    ) {
        if let HostData::U32(v) = self.slot(i, name, shape, HostData::U32(Vec::new())) {
            v.extend(values);
        }
    }

    /// The per-row sampling inputs, at array indices `first..first + 8`.
    fn sampling(&mut self, first: usize, params: impl Iterator<Item = SamplingParams> + Clone) {
        let n = [params.clone().count()];
        self.f32s(
            first,
            inputs::TEMPERATURE,
            &n,
            params.clone().map(|p| {
                if p.temperature < MIN_TEMPERATURE {
                    0.0
                } else {
                    p.temperature
                }
            }),
        );
        self.i32s(
            first + 1,
            inputs::TOP_K,
            &n,
            params.clone().map(|p| p.top_k),
        );
        self.f32s(
            first + 2,
            inputs::TOP_P,
            &n,
            params.clone().map(|p| p.top_p),
        );
        self.u32s(first + 3, inputs::SEEDS, &n, params.clone().map(|p| p.seed));
        self.f32s(
            first + 4,
            inputs::MIN_P,
            &n,
            params.clone().map(|p| p.min_p),
        );
        self.f32s(
            first + 5,
            inputs::PRESENCE_PENALTY,
            &n,
            params.clone().map(|p| p.presence_penalty),
        );
        self.f32s(
            first + 6,
            inputs::FREQUENCY_PENALTY,
            &n,
            params.clone().map(|p| p.frequency_penalty),
        );
        self.f32s(
            first + 7,
            inputs::REPETITION_PENALTY,
            &n,
            params.map(|p| p.repetition_penalty),
        );
    }

    /// The per-row logit controls at array indices `first..first + 4`: state rows, the bias
    /// entries (see `model::logits::LogitInputs::bias_index`), and the allowed-token bits (all
    /// set without a mask). Fails on a row
    /// with more bias entries than [`LOGIT_BIAS_SLOTS`], a biased token outside the vocabulary
    /// or a mask of the wrong length.
    fn controls<'c>(
        &mut self,
        first: usize,
        controls: impl Iterator<Item = LogitControls<'c>> + Clone,
        vocab: usize,
    ) -> Result<()> {
        let rows = controls.clone().count();
        let words = vocab.div_ceil(32);
        for c in controls.clone() {
            if c.bias.len() > LOGIT_BIAS_SLOTS || c.bias.iter().any(|&(t, _)| t as usize >= vocab) {
                return Err(Error::Internal(format!(
                    "a row's logit bias has {} entries (at most {LOGIT_BIAS_SLOTS}, tokens below \
                     {vocab})",
                    c.bias.len()
                )));
            }
            if c.allowed.is_some_and(|m| m.len() != words) {
                return Err(Error::Internal(format!(
                    "an allowed-token mask must have {words} words"
                )));
            }
        }
        self.i32s(
            first,
            inputs::STATE_ROWS,
            &[rows],
            controls.clone().map(|c| c.state_row as i32),
        );
        let k = LOGIT_BIAS_SLOTS;
        let width = vocab + k;
        self.i32s(
            first + 1,
            inputs::LOGIT_BIAS_INDEX,
            &[rows * k],
            controls.clone().enumerate().flat_map(|(r, c)| {
                (0..k).map(move |j| match c.bias.get(j) {
                    Some(&(t, _)) => (r * width + t as usize) as i32,
                    None => (r * width + vocab + j) as i32,
                })
            }),
        );
        self.f32s(
            first + 2,
            inputs::LOGIT_BIAS_VALUES,
            &[rows * k],
            controls
                .clone()
                .flat_map(|c| (0..k).map(move |j| c.bias.get(j).map_or(0.0, |&(_, v)| v))),
        );
        let i = first + 3;
        let unmasked = controls.clone().all(|c| c.allowed.is_none());
        // Still all ones from the last fill, which wrote this array (nothing after it did)?
        let kept = unmasked
            && self.unmasked
            && self
                .arrays
                .get(i)
                .is_some_and(|a| a.name == inputs::ALLOWED_TOKENS && a.shape == [rows, words]);
        self.unmasked = unmasked;
        if kept {
            return Ok(());
        }
        // A row at a time (a copy or a fill), not a word at a time: 1 MB a step at 64 rows of
        // a 129k vocabulary.
        let slot = self.slot(
            i,
            inputs::ALLOWED_TOKENS,
            &[rows, words],
            HostData::U32(Vec::new()),
        );
        if let HostData::U32(v) = slot {
            v.reserve(rows * words);
            for c in controls {
                match c.allowed {
                    Some(m) => v.extend_from_slice(m),
                    None => v.resize(v.len() + words, u32::MAX),
                }
            }
        }
        Ok(())
    }

    /// Appends, after a fill of a draft step's rows, the [`crate::model::mtp::HIDDEN`] input of
    /// `chunks` padded to `t` rows: each row's hidden state from `last`, the hidden states
    /// (`width` wide, row-major) the runner's previous step returned (`None`: it returned
    /// none); zeros for padding.
    pub fn push_draft_hidden(
        &mut self,
        last: Option<&[f32]>,
        width: usize,
        chunks: &[DraftChunk<'_>],
        t: usize,
    ) -> Result<()> {
        let Some(last) = last else {
            return Err(Error::InvalidInput(
                "a draft step needs the hidden states of a step before it, and the runner's \
                 last step returned none (is the model loaded with its MTP layer?)"
                    .into(),
            ));
        };
        let rows = last.len() / width.max(1);
        if let Some(c) = chunks
            .iter()
            .find(|c| c.hidden_rows.len() != c.next_tokens.len())
        {
            return Err(Error::InvalidInput(format!(
                "a draft chunk of {} rows names {} hidden rows",
                c.next_tokens.len(),
                c.hidden_rows.len()
            )));
        }
        let wanted = || chunks.iter().flat_map(|c| c.hidden_rows.iter().copied());
        let n = wanted().count();
        if n > t {
            return Err(Error::Internal(format!(
                "{n} draft rows do not fit a step of {t}"
            )));
        }
        if let Some(r) = wanted().find(|&r| r >= rows) {
            return Err(Error::InvalidInput(format!(
                "a draft row reads hidden row {r} of a step that returned {rows}"
            )));
        }
        let i = self.arrays.len();
        let hidden = crate::model::mtp::HIDDEN;
        if let HostData::F32(v) = self.slot(i, hidden, &[t, width], HostData::F32(Vec::new())) {
            v.reserve(t * width);
            for r in wanted() {
                v.extend_from_slice(&last[r * width..(r + 1) * width]);
            }
            v.resize(t * width, 0.0);
        }
        Ok(())
    }

    /// Appends, after a decode fill of a verify step's rows ([`verify_rows`]), the chunk
    /// arrays a decode-shaped verify graph reads (`model::Sampler::Rejection` in
    /// `model::build_decode`): `seq_ids`, each row's chunk, and `last_index`, each chunk's last
    /// row, for chunks of `lens` positions padded to `batch` rows. Each padding row is a chunk
    /// of its own, so it verifies nothing.
    pub fn push_chunks(&mut self, lens: &[usize], batch: usize) -> Result<()> {
        let n: usize = lens.iter().sum();
        if n > batch || lens.contains(&0) {
            return Err(Error::Internal(format!(
                "verify chunks of {lens:?} positions do not fit a batch of {batch}"
            )));
        }
        let i = self.arrays.len();
        let chunks = lens.len();
        self.i32s(
            i,
            inputs::SEQ_IDS,
            &[batch],
            lens.iter()
                .enumerate()
                .flat_map(|(c, &len)| std::iter::repeat_n(c as i32, len))
                .chain((chunks..chunks + batch - n).map(|c| c as i32)),
        );
        self.i32s(
            i + 1,
            inputs::LAST_INDEX,
            &[batch],
            lens.iter()
                .scan(0i32, |end, &len| {
                    *end += len as i32;
                    Some(*end - 1)
                })
                .chain((n..batch).map(|r| r as i32))
                .chain(std::iter::repeat_n(0, n - chunks)),
        );
        Ok(())
    }

    /// Fills the metadata of a decode step for `rows`, padded to `batch` rows and a context of
    /// `ctx`. On error the arrays are left unspecified.
    pub fn fill_decode(
        &mut self,
        rows: &[DecodeRow<'_>],
        batch: usize,
        ctx: usize,
        block_size: usize,
        vocab: usize,
    ) -> Result<()> {
        if rows.len() > batch {
            return Err(Error::Internal(format!(
                "{} rows do not fit a batch of {batch}",
                rows.len()
            )));
        }
        for r in rows {
            if r.position >= ctx {
                return Err(Error::Internal(format!(
                    "position {} is beyond the context bucket {ctx}",
                    r.position
                )));
            }
            // Checked before anything is written, so a bad row fails the whole step.
            slot(r.blocks, block_size, r.position)?;
        }
        let width = ctx / block_size;
        let pad = batch - rows.len();
        let scratch = (SCRATCH_BLOCK as usize * block_size) as i32;
        let b = [batch];
        self.i32s(
            0,
            inputs::INPUT_IDS,
            &b,
            rows.iter()
                .map(|r| r.token as i32)
                .chain(std::iter::repeat_n(0, pad)),
        );
        self.i32s(
            1,
            inputs::POSITIONS,
            &b,
            rows.iter()
                .map(|r| r.position as i32)
                .chain(std::iter::repeat_n(0, pad)),
        );
        self.i32s(
            2,
            inputs::SLOT_MAPPING,
            &b,
            rows.iter()
                .map(|r| slot(r.blocks, block_size, r.position).unwrap_or(scratch))
                .chain(std::iter::repeat_n(scratch, pad)),
        );
        self.i32s(
            3,
            inputs::BLOCK_TABLES,
            &[batch, width],
            rows.iter()
                .flat_map(|r| block_row(r.blocks, width))
                .chain(std::iter::repeat_n(SCRATCH_BLOCK as i32, pad * width)),
        );
        self.i32s(
            4,
            inputs::CONTEXT_LENS,
            &b,
            rows.iter()
                .map(|r| r.position as i32 + 1)
                .chain(std::iter::repeat_n(1, pad)),
        );
        self.sampling(
            5,
            rows.iter()
                .map(|r| r.sampling)
                .chain(std::iter::repeat_n(SamplingParams::GREEDY, pad)),
        );
        self.controls(
            13,
            rows.iter()
                .map(|r| r.controls)
                .chain(std::iter::repeat_n(LogitControls::NONE, pad)),
            vocab,
        )?;
        self.truncate(17);
        Ok(())
    }

    /// The arrays of a prefill-shaped step that describe its tokens and sequences (token ids,
    /// positions, slots, block tables, last indices and, with `seqs > 1`, sequence ids), after
    /// checking the chunks fit; returns the index of the next array.
    fn fill_prefill_rows(
        &mut self,
        chunks: &[PrefillChunk<'_>],
        t: usize,
        seqs: usize,
        ctx: usize,
        block_size: usize,
    ) -> Result<usize> {
        let n: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        if chunks.is_empty() || chunks.len() > seqs || n > t {
            return Err(Error::Internal(format!(
                "{} chunks of {n} tokens in all do not fit a prefill of {seqs} sequences and {t} \
                 tokens",
                chunks.len()
            )));
        }
        for c in chunks {
            if c.tokens.is_empty() || c.start + c.tokens.len() > ctx {
                return Err(Error::Internal(format!(
                    "a chunk of {} tokens at position {} does not fit a context of {ctx}",
                    c.tokens.len(),
                    c.start
                )));
            }
            for p in c.start..c.start + c.tokens.len() {
                slot(c.blocks, block_size, p)?;
            }
        }
        let width = ctx / block_size;
        let pad = t - n;
        let base = SCRATCH_BLOCK as usize * block_size;
        let positions = || {
            chunks
                .iter()
                .flat_map(|c| c.start..c.start + c.tokens.len())
        };
        let tt = [t];
        self.i32s(
            0,
            inputs::INPUT_IDS,
            &tt,
            chunks
                .iter()
                .flat_map(|c| c.tokens.iter().map(|&x| x as i32))
                .chain(std::iter::repeat_n(0, pad)),
        );
        self.i32s(
            1,
            inputs::POSITIONS,
            &tt,
            positions()
                .map(|p| p as i32)
                .chain(std::iter::repeat_n(0, pad)),
        );
        self.i32s(
            2,
            inputs::SLOT_MAPPING,
            &tt,
            chunks
                .iter()
                .flat_map(|c| {
                    (c.start..c.start + c.tokens.len())
                        .map(|p| slot(c.blocks, block_size, p).unwrap_or(base as i32))
                })
                .chain((n..t).map(|i| (base + i % block_size) as i32)),
        );
        let spare = seqs - chunks.len();
        self.i32s(
            3,
            inputs::BLOCK_TABLES,
            &[seqs, width],
            chunks
                .iter()
                .flat_map(|c| block_row(c.blocks, width))
                .chain(std::iter::repeat_n(SCRATCH_BLOCK as i32, spare * width)),
        );
        self.i32s(
            4,
            inputs::LAST_INDEX,
            &[seqs],
            chunks
                .iter()
                .scan(0i32, |end, c| {
                    *end += c.tokens.len() as i32;
                    Some(*end - 1)
                })
                .chain(std::iter::repeat_n(0, spare)),
        );
        let mut next = 5;
        if seqs > 1 {
            self.i32s(
                5,
                inputs::SEQ_IDS,
                &tt,
                chunks
                    .iter()
                    .enumerate()
                    .flat_map(|(i, c)| std::iter::repeat_n(i as i32, c.tokens.len()))
                    .chain(std::iter::repeat_n(0, pad)),
            );
            next = 6;
        }
        Ok(next)
    }

    /// Fills the metadata of a prefill step for `chunks` (each of a different sequence), packed
    /// in order and padded to `t` tokens, `seqs` sequences and a context of `ctx`. With
    /// `seqs == 1` (one chunk) there is no `seq_ids` array: the unpacked graph has no such input.
    /// On error the arrays are left unspecified.
    pub fn fill_prefill(
        &mut self,
        chunks: &[PrefillChunk<'_>],
        t: usize,
        seqs: usize,
        ctx: usize,
        block_size: usize,
        vocab: usize,
    ) -> Result<()> {
        let next = self.fill_prefill_rows(chunks, t, seqs, ctx, block_size)?;
        let spare = seqs - chunks.len();
        self.sampling(
            next,
            chunks
                .iter()
                .map(|c| c.sampling)
                .chain(std::iter::repeat_n(SamplingParams::GREEDY, spare)),
        );
        self.i32s(
            next + 8,
            inputs::PROMPT_LENS,
            &[seqs],
            chunks
                .iter()
                .map(|c| c.controls.prompt_len as i32)
                .chain(std::iter::repeat_n(0, spare)),
        );
        self.controls(
            next + 9,
            chunks
                .iter()
                .map(|c| c.controls)
                .chain(std::iter::repeat_n(LogitControls::NONE, spare)),
            vocab,
        )?;
        self.truncate(next + 13);
        Ok(())
    }

    /// Fills the metadata of a verify step ([`super::Step::Verify`]) for `chunks`: a
    /// prefill's (see [`StepArrays::fill_prefill`]), with the sampling parameters and logit
    /// controls given per position, each chunk's repeated over its tokens (its mask, if any,
    /// holds one per position, one after another) and padding greedy without controls, as the
    /// rejection sampler (`model::Sampler::Rejection`) reads them.
    pub fn fill_verify<'a>(
        &mut self,
        chunks: &[PrefillChunk<'a>],
        t: usize,
        seqs: usize,
        ctx: usize,
        block_size: usize,
        vocab: usize,
    ) -> Result<()> {
        let words = vocab.div_ceil(32);
        if let Some(c) = chunks.iter().find(|c| {
            c.controls
                .allowed
                .is_some_and(|m| m.len() != c.tokens.len() * words)
        }) {
            return Err(Error::Internal(format!(
                "a verify chunk of {} positions needs a mask of {words} words each",
                c.tokens.len()
            )));
        }
        let next = self.fill_prefill_rows(chunks, t, seqs, ctx, block_size)?;
        let pad = t - chunks.iter().map(|c| c.tokens.len()).sum::<usize>();
        self.sampling(
            next,
            chunks
                .iter()
                .flat_map(|c| std::iter::repeat_n(c.sampling, c.tokens.len()))
                .chain(std::iter::repeat_n(SamplingParams::GREEDY, pad)),
        );
        // Each position's controls: its chunk's, with its own mask.
        let per_position = |c: &PrefillChunk<'a>| {
            let controls = c.controls;
            (0..c.tokens.len()).map(move |j| LogitControls {
                allowed: controls.allowed.map(|m| &m[j * words..(j + 1) * words]),
                ..controls
            })
        };
        self.controls(
            next + 8,
            chunks
                .iter()
                .flat_map(per_position)
                .chain(std::iter::repeat_n(LogitControls::NONE, pad)),
            vocab,
        )?;
        self.truncate(next + 12);
        Ok(())
    }
}

/// A sequence's block table cut or padded (with the scratch block) to `width` entries. Blocks
/// past the context bucket hold no position the step can see (positions are checked against the
/// bucket by the callers), so they are left out.
fn block_row(blocks: &[u32], width: usize) -> impl Iterator<Item = i32> + '_ {
    blocks
        .iter()
        .take(width)
        .map(|&b| b as i32)
        .chain(std::iter::repeat_n(
            SCRATCH_BLOCK as i32,
            width.saturating_sub(blocks.len()),
        ))
}

/// A verify step's chunks as decode rows, one per position, chunk after chunk: each with its
/// chunk's sampling and controls and its own mask (a chunk's mask holds one per position). A
/// device verifies on a decode bucket's graph (see `StepKind::Verify`): rows of one sequence at
/// consecutive positions attend as its chunk would.
pub fn verify_rows<'a>(chunks: &[PrefillChunk<'a>], vocab: usize) -> Result<Vec<DecodeRow<'a>>> {
    let words = vocab.div_ceil(32);
    let mut rows = Vec::with_capacity(chunks.iter().map(|c| c.tokens.len()).sum());
    for c in chunks {
        if c.controls
            .allowed
            .is_some_and(|m| m.len() != c.tokens.len() * words)
        {
            return Err(Error::Internal(format!(
                "a verify chunk of {} positions needs a mask of {words} words each",
                c.tokens.len()
            )));
        }
        rows.extend(c.tokens.iter().enumerate().map(|(j, &token)| DecodeRow {
            token,
            position: c.start + j,
            blocks: c.blocks,
            sampling: c.sampling,
            controls: LogitControls {
                allowed: c.controls.allowed.map(|m| &m[j * words..(j + 1) * words]),
                ..c.controls
            },
        }));
    }
    Ok(rows)
}

/// A draft step's chunks as decode rows, one per row: each row's next token at the row's own
/// position, greedy without controls (a draft graph samples nothing).
pub fn draft_rows<'a>(chunks: &[DraftChunk<'a>]) -> Vec<DecodeRow<'a>> {
    chunks
        .iter()
        .flat_map(|c| {
            c.next_tokens
                .iter()
                .enumerate()
                .map(|(j, &token)| DecodeRow {
                    token,
                    position: c.start + j,
                    blocks: c.blocks,
                    sampling: SamplingParams::GREEDY,
                    controls: LogitControls::NONE,
                })
        })
        .collect()
}

/// The metadata of a decode step for `rows`, padded to `batch` rows and a context of `ctx`.
pub fn decode_step(
    rows: &[DecodeRow<'_>],
    batch: usize,
    ctx: usize,
    block_size: usize,
    vocab: usize,
) -> Result<Vec<HostArray>> {
    let mut s = StepArrays::default();
    s.fill_decode(rows, batch, ctx, block_size, vocab)?;
    Ok(s.arrays)
}

/// The metadata of a prefill step for `chunks`, padded to `t` tokens, `seqs` sequences and a
/// context of `ctx`.
pub fn prefill_step(
    chunks: &[PrefillChunk<'_>],
    t: usize,
    seqs: usize,
    ctx: usize,
    block_size: usize,
    vocab: usize,
) -> Result<Vec<HostArray>> {
    let mut s = StepArrays::default();
    s.fill_prefill(chunks, t, seqs, ctx, block_size, vocab)?;
    Ok(s.arrays)
}

/// The metadata of a verify step for `chunks` (see [`StepArrays::fill_verify`]), padded to
/// `t` tokens, `seqs` sequences and a context of `ctx`.
pub fn verify_step(
    chunks: &[PrefillChunk<'_>],
    t: usize,
    seqs: usize,
    ctx: usize,
    block_size: usize,
    vocab: usize,
) -> Result<Vec<HostArray>> {
    let mut s = StepArrays::default();
    s.fill_verify(chunks, t, seqs, ctx, block_size, vocab)?;
    Ok(s.arrays)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ptrs(s: &StepArrays) -> Vec<usize> {
        s.arrays()
            .iter()
            .map(|a| match &a.data {
                HostData::I32(v) => v.as_ptr() as usize,
                HostData::F32(v) => v.as_ptr() as usize,
                HostData::U32(v) => v.as_ptr() as usize,
            })
            .collect()
    }

    #[test]
    fn refilling_reuses_the_buffers_and_pads_to_scratch() {
        let blocks = [3u32, 4];
        let row = |token, position| DecodeRow {
            token,
            position,
            blocks: &blocks,
            sampling: SamplingParams::GREEDY,
            controls: crate::runner::step::LogitControls::NONE,
        };
        let mut s = StepArrays::default();
        s.fill_decode(&[row(7, 5), row(8, 17)], 4, 32, 16, 64)
            .unwrap();
        let first = ptrs(&s);
        s.fill_decode(&[row(9, 6)], 4, 32, 16, 64).unwrap();
        assert_eq!(
            ptrs(&s),
            first,
            "a second step of the same bucket must not reallocate"
        );
        let a = s.arrays();
        assert_eq!(a[0].data, HostData::I32(vec![9, 0, 0, 0]));
        assert_eq!(
            a[2].data,
            HostData::I32(vec![3 * 16 + 6, 0, 0, 0]),
            "padding writes the scratch slot"
        );
        assert_eq!(a[3].data, HostData::I32(vec![3, 4, 0, 0, 0, 0, 0, 0]));
        assert_eq!(a[4].data, HostData::I32(vec![7, 1, 1, 1]));
        assert!(
            s.fill_decode(&[row(1, 40)], 4, 32, 16, 64).is_err(),
            "beyond the context bucket"
        );
    }

    /// A draft step's hidden states: the rows each draft row names, zeros for padding, in
    /// the buffer the last such step used (a decode fill in between sets it aside, it is not
    /// dropped).
    #[test]
    fn draft_hidden_states_are_the_named_rows_in_a_kept_buffer() {
        let blocks = [3u32];
        let last = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let chunk = DraftChunk {
            next_tokens: &[7, 8],
            start: 4,
            blocks: &blocks,
            hidden_rows: &[2, 0],
        };
        let rows = draft_rows(std::slice::from_ref(&chunk));
        let mut s = StepArrays::default();
        let fill = |s: &mut StepArrays| {
            s.fill_decode(&rows, 4, 32, 16, 64).unwrap();
            s.push_draft_hidden(Some(&last), 2, std::slice::from_ref(&chunk), 4)
                .unwrap();
            s.arrays().last().cloned().unwrap()
        };
        let first = fill(&mut s);
        let ptr = |s: &StepArrays| ptrs(s).last().copied();
        let at = ptr(&s);
        assert_eq!(first.name, crate::model::mtp::HIDDEN);
        assert_eq!(first.shape, [4, 2]);
        assert_eq!(
            first.data,
            HostData::F32(vec![5.0, 6.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0])
        );
        s.fill_decode(&rows, 4, 32, 16, 64).unwrap();
        assert_eq!(s.arrays().len(), 17, "a decode fill has no hidden states");
        assert_eq!(fill(&mut s), first);
        assert_eq!(ptr(&s), at, "the hidden-state buffer is reused");
        let far = DraftChunk {
            hidden_rows: &[3, 0],
            ..chunk.clone()
        };
        assert!(s.push_draft_hidden(Some(&last), 2, &[far], 4).is_err());
        assert!(s.push_draft_hidden(None, 2, &[chunk], 4).is_err());
    }

    /// A decode-shaped verify step's chunk arrays: each row's chunk, each chunk's last row,
    /// and every padding row a chunk of its own that ends at itself.
    #[test]
    fn verify_chunks_name_each_rows_chunk_and_each_chunks_last_row() {
        let mut s = StepArrays::default();
        s.push_chunks(&[3, 1, 2], 8).unwrap();
        let a = s.arrays();
        assert_eq!(a[0].name, inputs::SEQ_IDS);
        assert_eq!(a[0].data, HostData::I32(vec![0, 0, 0, 1, 2, 2, 3, 4]));
        assert_eq!(a[1].name, inputs::LAST_INDEX);
        assert_eq!(a[1].data, HostData::I32(vec![2, 3, 5, 6, 7, 0, 0, 0]));
        assert!(
            s.push_chunks(&[3, 6], 8).is_err(),
            "more rows than the batch"
        );
        assert!(s.push_chunks(&[2, 0], 8).is_err(), "an empty chunk");
    }

    /// A verify chunk's positions as rows: consecutive positions, each with its own mask.
    #[test]
    fn verify_rows_give_each_position_its_own_mask() {
        let blocks = [3u32];
        let mask = [1u32, 2, 3, 4];
        let chunk = PrefillChunk {
            tokens: &[7, 8],
            start: 5,
            blocks: &blocks,
            sampling: SamplingParams::GREEDY,
            controls: LogitControls {
                allowed: Some(&mask),
                ..LogitControls::NONE
            },
        };
        let rows = verify_rows(std::slice::from_ref(&chunk), 64).unwrap();
        let got: Vec<_> = rows
            .iter()
            .map(|r| (r.token, r.position, r.controls.allowed))
            .collect();
        assert_eq!(
            got,
            [(7, 5, Some(&mask[..2])), (8, 6, Some(&mask[2..]))],
            "64 tokens are two mask words"
        );
        let short = PrefillChunk {
            controls: LogitControls {
                allowed: Some(&mask[..2]),
                ..LogitControls::NONE
            },
            ..chunk
        };
        assert!(
            verify_rows(&[short], 64).is_err(),
            "one mask for two positions"
        );
    }

    /// A refill keeps an all-ones allowed-token array only while it is one: whatever the
    /// order of masked and unmasked decode and prefill steps, the staging arrays equal a fresh
    /// fill's.
    #[test]
    fn kept_allowed_tokens_are_what_a_fresh_fill_writes() {
        let blocks = [3u32, 4];
        let mask = [0b1010u32, 0];
        let controls = |masked: bool| LogitControls {
            allowed: masked.then_some(&mask[..]),
            ..LogitControls::NONE
        };
        let row = |masked| DecodeRow {
            token: 7,
            position: 5,
            blocks: &blocks,
            sampling: SamplingParams::GREEDY,
            controls: controls(masked),
        };
        let chunk = |masked| PrefillChunk {
            tokens: &[1, 2, 3],
            start: 0,
            blocks: &blocks,
            sampling: SamplingParams::GREEDY,
            controls: controls(masked),
        };
        let mut s = StepArrays::default();
        let steps = [
            (false, false),
            (false, false),
            (false, true),
            (false, false),
            (true, false),
            (false, false),
            (true, true),
            (false, false),
            (false, false),
        ];
        for (prefill, masked) in steps {
            let fresh = if prefill {
                s.fill_prefill(&[chunk(masked)], 16, 1, 32, 16, 64).unwrap();
                prefill_step(&[chunk(masked)], 16, 1, 32, 16, 64).unwrap()
            } else {
                s.fill_decode(&[row(masked), row(false)], 2, 32, 16, 64)
                    .unwrap();
                decode_step(&[row(masked), row(false)], 2, 32, 16, 64).unwrap()
            };
            assert_eq!(s.arrays(), fresh, "prefill {prefill}, masked {masked}");
            assert_eq!(s.allowed_tokens_unmasked(), !masked);
        }
    }
}
