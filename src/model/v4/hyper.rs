//! Manifold-constrained hyper-connections: the `hc_mult` residual streams, collapsed into each
//! block's input and expanded with its output through Sinkhorn-projected mixing matrices, and
//! the hyper-head that collapses them before the final norm. Per token, so the cache-free
//! forward and the cached step share them as they are.

use crate::config::v4::V4Config;
use crate::error::Result;
use crate::graph::Tensor;
use crate::model::ops;

use super::weights::Weights;

/// A hyper-connection (`{prefix}_fn`, `_base`, `_scale`) over `streams` (`[t, n, h]`): its
/// `post` (`[t, n]`) and Sinkhorn-projected `comb` (`[t, n, n]`) weights, and the block input
/// the `pre` weights collapse the streams to (`[t, h]`).
pub(super) fn hyper_connection(
    cfg: &V4Config,
    w: &Weights,
    prefix: &str,
    streams: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (t, n, h) = (streams.dim(0), cfg.hc_mult, cfg.hidden_size);
    let eps = cfg.hc_eps;
    let flat = ops::rms_norm_unweighted(&streams.reshape([t, n * h])?, cfg.rms_norm_eps)?;
    let mixes = flat.matmul(&w.get(&format!("{prefix}_fn"))?.t()?)?;
    let base = w.get(&format!("{prefix}_base"))?;
    let scale = w.get(&format!("{prefix}_scale"))?;
    let part = |start: usize, len: usize, s: usize| -> Result<Tensor> {
        mixes
            .narrow(1, start, len)?
            .broadcast_mul(&scale.narrow(0, s, 1)?.reshape([1, 1])?)?
            .broadcast_add(&base.narrow(0, start, len)?.reshape([1, len])?)
    };
    let pre = part(0, n, 0)?.sigmoid()?.affine(1.0, eps)?;
    let post = part(n, n, 1)?.sigmoid()?.affine(2.0, 0.0)?;
    let comb = ops::softmax(&part(2 * n, n * n, 2)?.reshape([t, n, n])?, 2)?.affine(1.0, eps)?;
    // Sinkhorn: columns, then rows and columns `iters - 1` times.
    let normalize = |x: &Tensor, dim: usize| -> Result<Tensor> {
        x.broadcast_div(&x.sum_keepdim(dim)?.affine(1.0, eps)?)
    };
    let mut comb = normalize(&comb, 1)?;
    for _ in 1..cfg.hc_sinkhorn_iters {
        comb = normalize(&normalize(&comb, 2)?, 1)?;
    }
    let collapsed = pre.unsqueeze(2)?.broadcast_mul(streams)?.sum(1)?;
    Ok((post, comb, collapsed))
}

/// The streams after a block: `post_k y + sum_j comb[j, k] x_j`.
pub(super) fn expand(post: &Tensor, comb: &Tensor, y: &Tensor, streams: &Tensor) -> Result<Tensor> {
    let (t, n, h) = (streams.dim(0), streams.dim(1), streams.dim(2));
    let out = post.unsqueeze(2)?.broadcast_mul(&y.unsqueeze(1)?)?;
    let mixed = comb.transpose(1, 2)?.matmul(streams)?;
    out.broadcast_as([t, n, h])?.add(&mixed)
}

/// The final collapse of the streams (`{prefix}_fn`, `_base`, `_scale`: a `pre` only), with
/// the main model's hyper-head (`hc_head`) or an MTP layer's own (`mtp.0.hc_head`).
pub(super) fn hyper_head(
    cfg: &V4Config,
    w: &Weights,
    prefix: &str,
    streams: &Tensor,
) -> Result<Tensor> {
    let (t, n, h) = (streams.dim(0), cfg.hc_mult, cfg.hidden_size);
    let flat = ops::rms_norm_unweighted(&streams.reshape([t, n * h])?, cfg.rms_norm_eps)?;
    let mixes = flat.matmul(&w.get(&format!("{prefix}_fn"))?.t()?)?;
    let pre = mixes
        .broadcast_mul(&w.get(&format!("{prefix}_scale"))?.reshape([1, 1])?)?
        .broadcast_add(&w.get(&format!("{prefix}_base"))?.reshape([1, n])?)?
        .sigmoid()?
        .affine(1.0, cfg.hc_eps)?;
    pre.unsqueeze(2)?.broadcast_mul(streams)?.sum(1)
}
