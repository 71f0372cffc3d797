//! DeepSeek-V4's forward pass over one whole sequence with no cache: transformers' stateless
//! mode (`cache=None`), every compressed entry pooled from the sequence itself. Checked against
//! transformers on `fixtures/tiny-v4`, it is the reference the cached step graphs
//! ([`super::step`]) are checked against too.
//!
//! Weights are inputs under their published names ([`super::tensors`]), in f32; `tid2eid`
//! as i32. The one metadata input is `input_ids` (`[t]` i32); positions are `0..t`. The
//! output is `logits` (`[t, vocab]`).

use crate::config::v4::{V4Attention, V4Config};
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, GraphBuilder, InputRole, Literal, Tensor};
use crate::model::precision::Dots;
use crate::model::MoeStrategy;

use super::attention::{self as attn, and, Keys};
use super::weights::{Rope, Weights};

/// The graph of a cache-free forward over `t` tokens.
pub fn build_stateless(cfg: &V4Config, t: usize) -> Result<Graph> {
    let b = GraphBuilder::new(format!("v4_stateless_t{t}"));
    let w = Weights::declare(&b, cfg, 1, DType::F32, Dots::Widen)?;
    let ids = b.input("input_ids", InputRole::Metadata, [t], DType::I32)?;
    let positions = b.iota([t], DType::I32, 0)?;
    let main = Rope::new(cfg.rope_dim, &cfg.main_rope, &positions)?;
    let compress = Rope::new(cfg.rope_dim, &cfg.compress_rope, &positions)?;
    let x = super::hidden(cfg, &w, &ids, MoeStrategy::Gather, |l, x| {
        attention(cfg, &w, l, x, &main, &compress)
    })?;
    b.output("logits", &super::head(&w, &x)?)?;
    b.finish()
}

/// The graph of a cache-free forward over `t` tokens and of the MTP layer over its first
/// `t - 1` positions (`cfg` with its MTP layer in use: [`V4Config::with_draft_layer`]): row `i`
/// reads the main model's streams at `i` and the token at `i + 1`, at position `i`, attending
/// to rows `0..=i` within the window, and predicts the token at `i + 2` (teacher forcing, the
/// reference the MTP step graphs are checked against). Outputs `logits` (`[t, vocab]`),
/// `draft_logits` (`[t - 1, vocab]`) and `draft_streams` (`[t - 1, hc_mult * hidden]`, the
/// block's output streams, what chaining reads).
pub fn build_stateless_draft(cfg: &V4Config, t: usize) -> Result<Graph> {
    if t < 2 {
        return Err(Error::shape(
            "tokens",
            format!("an MTP forward needs 2 or more tokens, not {t}"),
        ));
    }
    let b = GraphBuilder::new(format!("v4_stateless_draft_t{t}"));
    let w = Weights::declare(&b, cfg, 1, DType::F32, Dots::Widen)?;
    let ids = b.input("input_ids", InputRole::Metadata, [t], DType::I32)?;
    let ropes = |n: usize| -> Result<(Rope, Rope)> {
        let positions = b.iota([n], DType::I32, 0)?;
        Ok((
            Rope::new(cfg.rope_dim, &cfg.main_rope, &positions)?,
            Rope::new(cfg.rope_dim, &cfg.compress_rope, &positions)?,
        ))
    };
    let (main, compress) = ropes(t)?;
    let streams = super::streams(cfg, &w, &ids, MoeStrategy::Gather, |l, x| {
        attention(cfg, &w, l, x, &main, &compress)
    })?;
    b.output(
        "logits",
        &super::head(&w, &super::collapse(cfg, &w, &streams)?)?,
    )?;
    let (main, compress) = ropes(t - 1)?;
    let (normed, out) = super::mtp::draft(
        cfg,
        &w,
        &streams.narrow(0, 0, t - 1)?,
        &ids.narrow(0, 1, t - 1)?,
        MoeStrategy::Gather,
        |l, x| attention(cfg, &w, l, x, &main, &compress),
    )?;
    b.output("draft_logits", &super::head(&w, &normed)?)?;
    b.output(
        "draft_streams",
        &out.reshape([t - 1, cfg.hc_mult * cfg.hidden_size])?,
    )?;
    b.finish()
}

/// One layer's attention over the whole sequence (`x`: `[t, h]`, normalised).
fn attention(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    x: &Tensor,
    main: &Rope,
    compress: &Rope,
) -> Result<Tensor> {
    let b = x.builder();
    let t = x.dim(0);
    let rope = match cfg.attention[l] {
        V4Attention::Sliding => main,
        _ => compress,
    };
    let (q_res, q) = attn::queries(cfg, w, l, x, rope)?;
    let kv = attn::key_value(cfg, w, l, x, rope)?;
    // The window: query i sees keys j with i - W < j <= i.
    let i = b.iota([t, t], DType::I32, 0)?;
    let j = b.iota([t, t], DType::I32, 1)?;
    let oldest = i.sub(&i.full_like(cfg.sliding_window as f64)?)?;
    let mut sets = vec![(Keys::Shared(kv), and(&j.le(&i)?, &j.gt(&oldest)?)?)];
    if cfg.attention[l] != V4Attention::Sliding {
        if let Some(set) = compressed(cfg, w, l, x, &q_res, compress)? {
            sets.push(set);
        }
    }
    let out = attn::attend(cfg, w, l, &q, &sets)?;
    attn::output(cfg, w, l, &out, rope)
}

/// A layer's compressed entries (`[windows, d]`; `None` when the sequence completes no window)
/// and which of them each query sees (`[t, windows]` bool): every completed window before it
/// (HCA), or those the lightning indexer selects among them (CSA).
fn compressed(
    cfg: &V4Config,
    w: &Weights,
    l: usize,
    x: &Tensor,
    q_res: &Tensor,
    rope: &Rope,
) -> Result<Option<(Keys, Tensor)>> {
    let b = x.builder();
    let t = x.dim(0);
    let a = attn::prefix(cfg, l);
    let csa = cfg.attention[l] == V4Attention::CompressedSparse;
    let rate = if csa { cfg.csa_rate } else { cfg.hca_rate };
    let windows = t / rate;
    if windows == 0 {
        return Ok(None);
    }
    let starts: Vec<i32> = (0..windows).map(|w| (w * rate) as i32).collect();
    let at_start = Rope::new(
        cfg.rope_dim,
        &cfg.compress_rope,
        &b.constant(Literal::I32(starts), [windows])?,
    )?;
    let entries = pool(
        cfg,
        w,
        &format!("{a}.compressor"),
        x,
        cfg.head_dim,
        rate,
        csa,
        &at_start,
    )?;
    // Query i sees window w when w < (i + 1) / rate.
    let qi = b.iota([t, windows], DType::I32, 0)?;
    let wi = b.iota([t, windows], DType::I32, 1)?;
    let ready = wi.lt(&qi.affine(1.0, 1.0)?.div(&qi.full_like(rate as f64)?)?)?;
    if !csa {
        return Ok(Some((Keys::Shared(entries), ready)));
    }
    let ix = cfg.indexer.map(|ix| ix.head_dim).unwrap_or_default();
    let keys = pool(
        cfg,
        w,
        &format!("{a}.indexer.compressor"),
        x,
        ix,
        rate,
        true,
        &at_start,
    )?;
    let scores = attn::index_scores(cfg, w, l, x, q_res, rope, &Keys::Shared(keys))?;
    let chosen = attn::select(cfg, &scores, &ready)?;
    Ok(Some((Keys::Shared(entries), chosen)))
}

/// A compressor's entries (`[windows, width]`): each window's tokens (CSA: the previous
/// window's first series and this window's second, over `2 x rate` slots) pooled by
/// [`attn::pool`].
#[allow(clippy::too_many_arguments)]
fn pool(
    cfg: &V4Config,
    w: &Weights,
    prefix: &str,
    x: &Tensor,
    width: usize,
    rate: usize,
    overlap: bool,
    at_start: &Rope,
) -> Result<Tensor> {
    let b = x.builder();
    let windows = x.dim(0) / rate;
    let used = windows * rate;
    let series = if overlap { 2 } else { 1 };
    let kv = w
        .linear(x, &format!("{prefix}.wkv.weight"))?
        .narrow(0, 0, used)?;
    let gate = w
        .linear(x, &format!("{prefix}.wgate.weight"))?
        .narrow(0, 0, used)?;
    let kv = kv.reshape([windows, rate, series * width])?;
    let gate = gate
        .reshape([windows, rate, series * width])?
        .broadcast_add(&w.get(&format!("{prefix}.ape"))?.unsqueeze(0)?)?;
    let (kv, gate) = match overlap {
        false => (kv, gate),
        true => {
            // Slots 0..rate: the previous window's first series (none before window 0: a zero
            // value with a -inf gate); slots rate..2 rate: this window's second series.
            let first = |x: &Tensor, fill: f64| -> Result<Tensor> {
                let own = x.narrow(2, 0, width)?;
                let pad = b.full(fill, [1, rate, width], DType::F32)?;
                match windows {
                    1 => Ok(pad),
                    _ => b.cat(&[&pad, &own.narrow(0, 0, windows - 1)?], 0),
                }
            };
            let kv2 = b.cat(&[&first(&kv, 0.0)?, &kv.narrow(2, width, width)?], 1)?;
            let gate2 = b.cat(
                &[
                    &first(&gate, f64::NEG_INFINITY)?,
                    &gate.narrow(2, width, width)?,
                ],
                1,
            )?;
            (kv2, gate2)
        }
    };
    attn::pool(cfg, w, prefix, &kv, &gate, at_start)
}
