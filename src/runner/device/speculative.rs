//! Speculative decoding's steps on a device: verify and draft steps on the captured graphs.
//!
//! A NeuronCore replays only the NEFFs compiled at capture, so a speculative step must take a
//! bucket's shape. A verify step (each sequence's last token and its drafts) runs on a decode
//! bucket: every position becomes a row with its sequence's block table and a context that
//! ends at it, so the rows of one sequence attend as its chunk would (each row's cache row is
//! written before any row reads the cache). Plain greedy rows then need only each row's argmax,
//! which the bucket's `Decode` (or `Greedy`) graph already returns; other rows run the bucket's
//! `Verify` graph, the decode graph with the rejection sampler (`model::Sampler::Rejection`).
//! A draft step runs the MTP layer on a decode bucket's `DecodeDraft` graph, or, when its rows
//! outnumber the largest decode batch (a prefilled chunk's positions), on a prefill bucket's
//! `Draft` graph.
//!
//! A step holds at most the largest live decode batch of positions. A verify or draft step
//! with more is run as several, each with whole sequences (their order kept): sequences do not
//! see each other, so the split changes no token. The scheduler keeps every sequence's drafts
//! within one graph (`Runner::live_buckets`).
//!
//! Hidden states go through the host: after every step of a drafting model the runner reads
//! the rows' hidden states back from the first rank (every rank holds the same), and a draft
//! step writes those its rows draft from into every rank's hidden-state buffer, as the CPU
//! runner does. That costs a step `rows x hidden x 4` bytes each way (28 KB a row for
//! DeepSeek-V3); gathering them on the device instead is left for later.

use std::ops::Range;

use super::{DeviceRunner, MetaWrites};
use crate::deployment::StepKind;
use crate::error::{Error, Result};
use crate::model::LogitsOutput;
use crate::runner::step::{self, DecodeRow, DraftChunk, PrefillChunk};
use crate::runner::StepOutput;

impl DeviceRunner {
    /// Fails unless the model drafts and the runner stages metadata on the host (speculative
    /// steps write hidden states and chunk arrays the host computes).
    fn speculating(&self) -> Result<()> {
        self.captured()?;
        if self.cfg.draft_layers == 0 {
            return Err(Error::InvalidInput(
                "a verify or draft step needs the model loaded with its MTP layer \
                 (--speculative-tokens)"
                    .into(),
            ));
        }
        if self.opts.metadata != super::MetadataSource::Host {
            return Err(Error::InvalidInput(
                "speculative steps need the step metadata on the host (MetadataSource::Host)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// After a step of `rows` real rows (tokens, for a prefill) of a drafting model, reads
    /// their hidden states back from the first rank, appended to those kept when `append` (a
    /// step run as several graphs) or in their place.
    pub(super) fn keep_hidden(&mut self, rows: usize, append: bool) -> Result<()> {
        if self.cfg.draft_layers == 0 {
            return Ok(());
        }
        // The last step's buffer, refilled in place.
        let mut kept = self.hidden.take().unwrap_or_default();
        if !append {
            kept.clear();
        }
        let st = self.captured()?;
        let out = st.first.hidden_out.as_ref().ok_or_else(|| {
            Error::Internal("a drafting model's runner without a hidden-state output".into())
        })?;
        let width = self.cfg.hidden_size;
        let at = kept.len();
        kept.resize(at + rows * width, 0.0);
        out.read(0, bytemuck::cast_slice_mut(&mut kept[at..]))
            .map_err(super::dev("hidden"))?;
        self.hidden = Some(kept);
        Ok(())
    }

    /// The chunks (by index range) of each graph a step of chunks of `lens` rows runs as: in
    /// order, each group within the largest live decode batch.
    fn groups(&self, lens: &[usize]) -> Result<Vec<Range<usize>>> {
        let cap = self.live.max_decode_batch();
        if let Some(&len) = lens.iter().find(|&&l| l > cap) {
            return Err(Error::InvalidInput(format!(
                "a sequence's {len} positions exceed the largest decode batch live ({cap}): \
                 --speculative-tokens must stay below it"
            )));
        }
        let mut out = Vec::new();
        let (mut start, mut rows) = (0, 0);
        for (i, &len) in lens.iter().enumerate() {
            if rows + len > cap {
                out.push(start..i);
                (start, rows) = (i, 0);
            }
            rows += len;
        }
        if start < lens.len() {
            out.push(start..lens.len());
        }
        Ok(out)
    }

    /// Runs a verify step (see `Step::Verify` and the module docs): every position's token,
    /// and every position's logits unless `logits` is `None`.
    pub(super) fn replay_verify(
        &mut self,
        chunks: &[PrefillChunk<'_>],
        logits: LogitsOutput,
    ) -> Result<StepOutput> {
        self.speculating()?;
        let vocab = self.cfg.vocab_size;
        let rows = step::verify_rows(chunks, vocab)?;
        let lens: Vec<usize> = chunks.iter().map(|c| c.tokens.len()).collect();
        let want = match logits {
            LogitsOutput::None => LogitsOutput::None,
            _ => LogitsOutput::Sampled,
        };
        let mut out = StepOutput {
            next_tokens: Vec::with_capacity(rows.len()),
            logits: (want != LogitsOutput::None).then(Vec::new),
        };
        let mut at = 0;
        for (g, group) in self.groups(&lens)?.into_iter().enumerate() {
            let n: usize = lens[group.clone()].iter().sum();
            let part = self.verify_group(&rows[at..at + n], &lens[group], want)?;
            at += n;
            out.next_tokens.extend(part.next_tokens);
            if let (Some(all), Some(l)) = (out.logits.as_mut(), part.logits) {
                all.extend(l);
            }
            self.keep_hidden(n, g > 0)?;
        }
        Ok(out)
    }

    /// One graph of a verify step: `rows`, chunks of `lens` positions.
    fn verify_group(
        &mut self,
        rows: &[DecodeRow<'_>],
        lens: &[usize],
        want: LogitsOutput,
    ) -> Result<StepOutput> {
        // Greedy rows without controls: each row's argmax is its verified token.
        if rows.iter().all(DecodeRow::is_plain_greedy) {
            return self.replay_decode(rows, want);
        }
        let vocab = self.cfg.vocab_size;
        let (batch, ctx) = self.live.decode_bucket(rows, vocab)?;
        let block_size = self.layout.block_size;
        self.staging
            .fill_decode(rows, batch, ctx, block_size, vocab)?;
        self.staging.push_chunks(lens, batch)?;
        let wanted = super::decode_logits_rows(rows.len(), want);
        let key = (StepKind::Verify, batch, batch, ctx);
        self.finish_step(key, wanted.as_slice(), rows.len(), MetaWrites::All)
    }

    /// Runs a draft step (see `Step::Draft` and the module docs): each chunk's proposal, its
    /// last row's. A device's draft graphs return no logits.
    pub(super) fn replay_draft(
        &mut self,
        chunks: &[DraftChunk<'_>],
        logits: LogitsOutput,
    ) -> Result<StepOutput> {
        self.speculating()?;
        if logits != LogitsOutput::None {
            return Err(Error::InvalidInput(
                "a device's draft steps return proposals only, no logits".into(),
            ));
        }
        let last = self.hidden.take();
        let lens: Vec<usize> = chunks.iter().map(|c| c.next_tokens.len()).collect();
        let total: usize = lens.iter().sum();
        let prefill: Vec<PrefillChunk<'_>> = chunks.iter().map(DraftChunk::as_prefill).collect();
        let end = chunks
            .iter()
            .map(|c| c.start + c.next_tokens.len())
            .max()
            .unwrap_or(1);
        let prefill_shaped = total > self.live.max_decode_batch()
            && self.live.prefill_fits(chunks.len(), total, end);
        if prefill_shaped {
            return self.draft_prefill_shaped(chunks, &prefill, last.as_deref(), total);
        }
        let mut next_tokens = Vec::with_capacity(chunks.len());
        for (g, group) in self.groups(&lens)?.into_iter().enumerate() {
            let part = &chunks[group.clone()];
            let rows = step::draft_rows(part);
            let vocab = self.cfg.vocab_size;
            let (batch, ctx) = self.live.decode_bucket(&rows, vocab)?;
            let width = self.cfg.hidden_size;
            self.staging
                .fill_decode(&rows, batch, ctx, self.layout.block_size, vocab)?;
            self.staging
                .push_draft_hidden(last.as_deref(), width, part, batch)?;
            let key = (StepKind::DecodeDraft, batch, batch, ctx);
            let proposals = self.finish_step(key, &[], rows.len(), MetaWrites::All)?;
            // Each chunk's proposal is its last row's.
            let mut row = 0;
            for len in &lens[group] {
                row += len;
                next_tokens.push(proposals.next_tokens[row - 1]);
            }
            self.keep_hidden(rows.len(), g > 0)?;
        }
        Ok(StepOutput {
            next_tokens,
            logits: None,
        })
    }

    /// A draft step of `total` rows on a prefill bucket's `Draft` graph.
    fn draft_prefill_shaped(
        &mut self,
        chunks: &[DraftChunk<'_>],
        prefill: &[PrefillChunk<'_>],
        last: Option<&[f32]>,
        total: usize,
    ) -> Result<StepOutput> {
        let vocab = self.cfg.vocab_size;
        let (t, seqs, ctx) = self.live.prefill_bucket(prefill, vocab)?;
        self.staging
            .fill_prefill(prefill, t, seqs, ctx, self.layout.block_size, vocab)?;
        self.staging
            .push_draft_hidden(last, self.cfg.hidden_size, chunks, t)?;
        let key = (StepKind::Draft, t, seqs, ctx);
        let out = self.finish_step(key, &[], chunks.len(), MetaWrites::All)?;
        self.keep_hidden(total, false)?;
        Ok(out)
    }
}
