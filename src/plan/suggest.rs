//! The smallest change that makes a plan fit.
//!
//! On the instance asked for, the answer is one set of flags: the smallest `--tp` (of
//! [`TP_CHOICES`](super::TP_CHOICES) that shard the model and fit the cores) in the precision
//! asked for, else the smallest with `--quantize experts-int8`: more cores before lower
//! precision, because the cores of the instance are there anyway and quantization changes the
//! outputs. A plan whose cache is what does not fit is offered `--kv-blocks auto` (fewer
//! resident sequences) only after both.
//!
//! When nothing fits one instance, every alternative that would is listed, cheapest hardware
//! first: more instances of the same type (the ranks spanning them through the runtime's
//! collectives), one larger instance type, and 4-bit experts (`--quantize experts-int4`) on the
//! instance asked for: the cheapest hardware, at the largest change to the outputs.

use crate::config::ModelConfig;
use crate::error::Result;

use super::{gib, valid_tps, Experts, Instance, KvBlocks, Plan, PlanOptions, WeightFormat};

/// One way to make the plan fit.
#[derive(Debug, Clone, PartialEq)]
pub struct Suggestion {
    /// The instance type.
    pub instance: Instance,
    /// How many of them.
    pub instances: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Routed experts' storage.
    pub experts: Experts,
    /// `Auto` when it fits only with fewer KV blocks than the default.
    pub kv_blocks: KvBlocks,
    /// The KV blocks of the fitting plan.
    pub kv_block_count: usize,
    /// Tokens those blocks hold.
    pub kv_tokens: usize,
    /// The fullest rank's bytes.
    pub max_core_total: u64,
    /// The budget per core.
    pub budget_per_core: u64,
}

impl Suggestion {
    fn from_plan(plan: &Plan, kv_blocks: KvBlocks) -> Self {
        Suggestion {
            instance: plan.instance,
            instances: plan.instances,
            tp: plan.tp,
            experts: plan.experts,
            kv_blocks,
            kv_block_count: plan.kv_blocks,
            kv_tokens: plan.kv_blocks.saturating_sub(1) * plan.block_size,
            max_core_total: plan.max_core_total(),
            budget_per_core: plan.budget_per_core,
        }
    }

    /// The `deepinfer plan` flags that reproduce it.
    pub fn flags(&self) -> String {
        let mut f = format!("--instance {} ", self.instance);
        if self.instances > 1 {
            f += &format!("--instances {} ", self.instances);
        }
        f += &format!("--tp {}", self.tp);
        match self.experts {
            Experts::AsWeights | Experts::Fp4 => {}
            Experts::Int8 => f += " --quantize experts-int8",
            Experts::Int4 => f += " --quantize experts-int4",
        }
        if self.kv_blocks == KvBlocks::Auto {
            f += &format!(
                " --kv-blocks auto ({} blocks, {} tokens)",
                self.kv_block_count, self.kv_tokens
            );
        }
        f
    }

    /// One line: the flags and the fullest rank against the budget.
    pub fn describe(&self) -> String {
        let on = if self.instances > 1 {
            format!("{} x {}", self.instances, self.instance)
        } else {
            format!("one {}", self.instance)
        };
        format!(
            "{on}: {} (fullest rank {} of {})",
            self.flags(),
            gib(self.max_core_total),
            gib(self.budget_per_core)
        )
    }
}

/// What would make `opts` fit: empty when it fits as asked; one suggestion when a change of
/// `--tp` / `--quantize` (/ `--kv-blocks auto`) on the same instances does; otherwise every
/// alternative of the module docs that fits.
pub fn suggest(cfg: &ModelConfig, opts: &PlanOptions) -> Result<Vec<Suggestion>> {
    // The graphs are built only when the plan without them fits (see `fitting`).
    let asked = Plan::lower_bound(cfg, opts)?;
    if asked.fits() && Plan::compute(cfg, opts)?.fits() {
        return Ok(Vec::new());
    }
    let mut experts = vec![opts.experts];
    if opts.experts == Experts::AsWeights && cfg.routing.is_some() {
        // int8 helps float weights; fp8 experts are already one byte.
        if !matches!(asked.weights, WeightFormat::Fp8Block(_)) {
            experts.push(Experts::Int8);
        }
    }
    if let Some(s) = first_fit(cfg, opts, opts.instance, opts.instances, &experts)? {
        return Ok(vec![s]);
    }
    let mut out = Vec::new();
    let cores = opts.instance.cores();
    let most = super::TP_CHOICES[super::TP_CHOICES.len() - 1];
    let mut m = opts.instances * 2;
    while m * cores <= most {
        if let Some(s) = first_fit(cfg, opts, opts.instance, m, &experts)? {
            out.push(s);
            break;
        }
        m *= 2;
    }
    let hbm = |i: Instance| i.hbm_per_core() * i.cores() as u64;
    for bigger in Instance::ALL
        .into_iter()
        .filter(|&i| hbm(i) > hbm(opts.instance) * opts.instances as u64)
    {
        if let Some(s) = first_fit(cfg, opts, bigger, 1, &experts)? {
            out.push(s);
            break;
        }
    }
    if cfg.routing.is_some() && opts.experts != Experts::Int4 {
        if let Some(s) = first_fit(cfg, opts, opts.instance, opts.instances, &[Experts::Int4])? {
            out.push(s);
        }
    }
    Ok(out)
}

/// The plan of `opts` when it fits; its graphs are built only when the plan without them
/// fits ([`Plan::lower_bound`]).
fn fitting(cfg: &ModelConfig, opts: &PlanOptions) -> Result<Option<Plan>> {
    if !Plan::lower_bound(cfg, opts)?.fits() {
        return Ok(None);
    }
    let plan = Plan::compute(cfg, opts)?;
    Ok(plan.fits().then_some(plan))
}

/// The first plan that fits on `instances` x `instance`: KV as asked before `--kv-blocks auto`,
/// then `experts` in order, then the smallest `--tp` (one rank past the instances before them).
fn first_fit(
    cfg: &ModelConfig,
    opts: &PlanOptions,
    instance: Instance,
    instances: usize,
    experts: &[Experts],
) -> Result<Option<Suggestion>> {
    let mut kvs = vec![opts.kv_blocks];
    if opts.kv_blocks != KvBlocks::Auto {
        kvs.push(KvBlocks::Auto);
    }
    let fewer = (instances - 1) * instance.cores();
    let tps: Vec<usize> = valid_tps(cfg, instances * instance.cores())
        .into_iter()
        .filter(|&t| t > fewer)
        .collect();
    for &kv_blocks in &kvs {
        for &e in experts {
            for &tp in &tps {
                let o = PlanOptions {
                    instance,
                    instances,
                    tp,
                    experts: e,
                    kv_blocks,
                    ..opts.clone()
                };
                if let Some(plan) = fitting(cfg, &o)? {
                    return Ok(Some(Suggestion::from_plan(&plan, kv_blocks)));
                }
            }
        }
    }
    Ok(None)
}

/// The one-line suggestion `deepinfer plan` prints for a model of `cfg` planned with `opts`:
/// `None` when the plan fits.
pub fn summary(
    cfg: &ModelConfig,
    opts: &PlanOptions,
    fits: bool,
    suggestions: &[Suggestion],
) -> Option<String> {
    if fits {
        return None;
    }
    // What [`suggest`] tried: `--quantize` only for a model whose routed experts it applies to
    // (not DeepSeek-V4's, read as published).
    let (tried, others) = match cfg.routing.is_some() {
        true => (
            ", with or without experts-int8",
            "more instances, a larger instance type, 4-bit experts",
        ),
        false => ("", "more instances, a larger instance type"),
    };
    let on = if opts.instances > 1 {
        format!("{} x {}", opts.instances, opts.instance)
    } else {
        format!("one {}", opts.instance)
    };
    Some(match suggestions {
        [s] if s.instance == opts.instance && s.instances == opts.instances => {
            format!("fits {on} with {}", s.describe_flags_only())
        }
        [] => format!(
            "does not fit {on} at any --tp{tried}, and no alternative planned here fits \
             ({others})"
        ),
        alternatives => format!(
            "does not fit {on} at any --tp{tried}; it would fit {}",
            alternatives
                .iter()
                .map(Suggestion::describe)
                .collect::<Vec<_>>()
                .join("; or ")
        ),
    })
}

impl Suggestion {
    /// The flags that change on the same instances, and the fullest rank against the budget.
    fn describe_flags_only(&self) -> String {
        let flags = self.flags();
        let flags = flags
            .split_once(" --tp ")
            .map(|(_, rest)| format!("--tp {rest}"))
            .unwrap_or(flags);
        format!(
            "{flags} (fullest rank {} of {})",
            gib(self.max_core_total),
            gib(self.budget_per_core)
        )
    }
}
