//! Which graph input or output each tensor a loaded NEFF reports stands for.
//!
//! libnrt binds purely by name (`nrt_add_tensor_to_tensor_set` files a tensor under a NEFF I/O
//! name, `nrt_execute` looks the names up), and the names are the compiler's, not ours: which
//! ones a NEFF ends up with depends on the toolchain. So the device runner reads them back from
//! every loaded model (`nrt_get_model_tensor_info`) and maps them onto the graph's roles by rule,
//! first match wins:
//!
//! 1. **The exact name**: the graph's name (`kv_cache`, `logits`), or the name the emitter wrote
//!    for it (`kv_cache.must_alias_input` for an aliased input, see
//!    [`crate::backend::hlo::MUST_ALIAS_SUFFIX`]).
//! 2. **`NAME.must_alias_input`** for an input some output must alias, where `NAME` is either of
//!    those names: the convention of AWS's HLO emitter, whose docs say the Neuron compiler
//!    appends the suffix to mutated parameters (aws-neuron/nkipy `core/trace.py`
//!    `_mark_hlo_outputs`, `core/backend/hlo.py` `HLOModule.inputs`). Accepting the suffix on the
//!    emitted name too covers a compiler that appends it although it is already there.
//! 3. **`input{i}` / `output{i}` by position** (parameter number, result index): the names
//!    torch-neuronx and transformers-neuronx bind (transformers-neuronx `compiler.py`), the
//!    fallback when a NEFF reports no name of ours.
//!
//! Every NEFF tensor must match exactly one graph input or output and every graph input and
//! output exactly one NEFF tensor; anything else is an error listing both sides, at capture,
//! instead of a failed execution at the first replay.

use crate::backend::hlo::{neff_input_name, MUST_ALIAS_SUFFIX};
use crate::error::{Error, Result};
use crate::graph::Graph;

/// The NEFF name of every graph input and output (indexed like the graph's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeffBinding {
    /// Per graph input, the NEFF input name it is bound under.
    pub inputs: Vec<String>,
    /// Per graph output, the NEFF output name it is bound under.
    pub outputs: Vec<String>,
}

impl NeffBinding {
    /// The names our emitter writes into the HLO: what a NEFF reports when the compiler keeps
    /// them. Used when the runtime lacks `nrt_get_model_tensor_info`.
    pub fn emitted(graph: &Graph) -> NeffBinding {
        let aliased = aliased_inputs(graph);
        NeffBinding {
            inputs: graph
                .inputs()
                .iter()
                .zip(&aliased)
                .map(|(d, &a)| neff_input_name(&d.name, a))
                .collect(),
            outputs: graph.outputs().iter().map(|o| o.name.clone()).collect(),
        }
    }
}

fn aliased_inputs(graph: &Graph) -> Vec<bool> {
    let mut aliased = vec![false; graph.inputs().len()];
    for o in graph.outputs() {
        if let Some(slot) = o.aliases.and_then(|k| aliased.get_mut(k)) {
            *slot = true;
        }
    }
    aliased
}

/// Which graph item (by index) a NEFF name stands for under the rules, or `None`.
fn match_one(
    name: &str,
    ours: &[String],
    emitted: &[String],
    aliased: &[bool],
    prefix: &str,
) -> Option<usize> {
    let n = ours.len();
    (0..n)
        .find(|&i| name == ours[i] || name == emitted[i])
        .or_else(|| {
            let base = name.strip_suffix(MUST_ALIAS_SUFFIX)?;
            (0..n).find(|&i| aliased[i] && (base == ours[i] || base == emitted[i]))
        })
        .or_else(|| {
            let i: usize = name.strip_prefix(prefix)?.parse().ok()?;
            // `input01` is not position 1.
            (i < n && name == format!("{prefix}{i}")).then_some(i)
        })
}

/// Maps one direction; `what` is `input` or `output`.
fn bind_direction(
    graph: &Graph,
    what: &str,
    neff: &[String],
    ours: &[String],
    emitted: &[String],
    aliased: &[bool],
) -> Result<Vec<String>> {
    let mut bound: Vec<Option<String>> = vec![None; ours.len()];
    let mut unmatched = Vec::new();
    for name in neff {
        match match_one(name, ours, emitted, aliased, what) {
            Some(i) if bound[i].is_none() => bound[i] = Some(name.clone()),
            Some(i) => {
                return Err(Error::Binding {
                    name: ours[i].clone(),
                    msg: format!(
                        "graph `{}`: NEFF {what}s `{}` and `{name}` both stand for it \
                         (NEFF {what}s: {neff:?}; graph {what}s: {ours:?})",
                        graph.name(),
                        bound[i].as_deref().unwrap_or_default(),
                    ),
                })
            }
            None => unmatched.push(name.clone()),
        }
    }
    let missing: Vec<&String> = ours
        .iter()
        .zip(&bound)
        .filter(|(_, b)| b.is_none())
        .map(|(o, _)| o)
        .collect();
    if !unmatched.is_empty() || !missing.is_empty() {
        return Err(Error::Binding {
            name: unmatched
                .first()
                .or(missing.first().copied())
                .cloned()
                .unwrap_or_default(),
            msg: format!(
                "graph `{}`: the NEFF's {what}s do not match the graph's: NEFF {what}s with no \
                 graph {what} {unmatched:?}, graph {what}s with no NEFF {what} {missing:?} (the \
                 NEFF reports {neff:?}; the graph has {ours:?}; a name binds if it is the \
                 graph's, the emitted one, NAME{MUST_ALIAS_SUFFIX} for an aliased input, or \
                 {what}{{i}} by position)",
                graph.name()
            ),
        });
    }
    Ok(bound.into_iter().flatten().collect())
}

/// Binds the NEFF's reported input and output names to `graph`'s inputs and outputs by the
/// rules of the module docs; an error lists both sides when they do not match one to one.
pub fn bind(graph: &Graph, neff_inputs: &[String], neff_outputs: &[String]) -> Result<NeffBinding> {
    let emitted = NeffBinding::emitted(graph);
    let aliased = aliased_inputs(graph);
    let ours_in: Vec<String> = graph.inputs().iter().map(|d| d.name.clone()).collect();
    let ours_out: Vec<String> = graph.outputs().iter().map(|o| o.name.clone()).collect();
    let no_alias = vec![false; ours_out.len()];
    Ok(NeffBinding {
        inputs: bind_direction(
            graph,
            "input",
            neff_inputs,
            &ours_in,
            &emitted.inputs,
            &aliased,
        )?,
        outputs: bind_direction(
            graph,
            "output",
            neff_outputs,
            &ours_out,
            &emitted.outputs,
            &no_alias,
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{DType, GraphBuilder, InputRole};

    /// Inputs `w`, `kv_cache` (aliased by output `kv_cache`), `ids`; outputs `next`, `kv_cache`.
    fn graph() -> Graph {
        let b = GraphBuilder::new("g");
        let w = b
            .input("w", InputRole::Weight, vec![2], DType::F32)
            .unwrap();
        let kv = b
            .input("kv_cache", InputRole::CacheRoot, vec![2], DType::F32)
            .unwrap();
        let ids = b
            .input("ids", InputRole::Metadata, vec![2], DType::F32)
            .unwrap();
        let next = w.add(&ids).unwrap();
        let kv2 = kv.add(&w).unwrap();
        b.output("next", &next).unwrap();
        b.output_aliased("kv_cache", &kv2, &kv).unwrap();
        b.finish().unwrap()
    }

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn each_convention_binds_every_role() {
        let g = graph();
        let want_in = |kv: &str, pos: bool| {
            if pos {
                v(&["input0", "input1", "input2"])
            } else {
                v(&["w", kv, "ids"])
            }
        };
        // Ours, old style (both named kv_cache): exact names.
        let b = bind(&g, &v(&["w", "kv_cache", "ids"]), &v(&["next", "kv_cache"])).unwrap();
        assert_eq!(b.inputs, want_in("kv_cache", false));
        // The emitted names, in another order: by name, not position.
        let b = bind(
            &g,
            &v(&["ids", "kv_cache.must_alias_input", "w"]),
            &v(&["kv_cache", "next"]),
        )
        .unwrap();
        assert_eq!(b.inputs, want_in("kv_cache.must_alias_input", false));
        assert_eq!(b.outputs, v(&["next", "kv_cache"]));
        // The suffix appended to the emitted name once more.
        let b = bind(
            &g,
            &v(&["w", "kv_cache.must_alias_input.must_alias_input", "ids"]),
            &v(&["next", "kv_cache"]),
        )
        .unwrap();
        assert_eq!(b.inputs[1], "kv_cache.must_alias_input.must_alias_input");
        // Positional.
        let b = bind(
            &g,
            &v(&["input2", "input0", "input1"]),
            &v(&["output1", "output0"]),
        )
        .unwrap();
        assert_eq!(b.inputs, want_in("", true));
        assert_eq!(b.outputs, v(&["output0", "output1"]));
        assert_eq!(b, bind(&g, &b.inputs, &b.outputs).unwrap());
    }

    #[test]
    fn unmatched_names_fail_listing_both_sides() {
        let g = graph();
        // The suffix on a parameter nothing aliases does not bind.
        let e = bind(
            &g,
            &v(&["w.must_alias_input", "kv_cache", "ids"]),
            &v(&["next", "kv_cache"]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("[\"w.must_alias_input\"]"), "{e}");
        assert!(e.contains("graph inputs with no NEFF input [\"w\"]"), "{e}");
        assert!(
            e.contains("the graph has [\"w\", \"kv_cache\", \"ids\"]"),
            "{e}"
        );
        // An unknown output, an out-of-range position, a zero-padded position.
        for outs in [
            v(&["next", "cache"]),
            v(&["output0", "output2"]),
            v(&["output00", "output1"]),
        ] {
            let e = bind(&g, &v(&["w", "kv_cache", "ids"]), &outs)
                .unwrap_err()
                .to_string();
            assert!(e.contains("NEFF outputs with no graph output"), "{e}");
            assert!(e.contains(&format!("{outs:?}")), "{e}");
        }
        // A NEFF tensor missing: the graph side is listed.
        let e = bind(&g, &v(&["w", "kv_cache"]), &v(&["next", "kv_cache"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("graph inputs with no NEFF input [\"ids\"]"),
            "{e}"
        );
        // Two NEFF names for one input.
        let e = bind(
            &g,
            &v(&["w", "kv_cache", "input1", "ids"]),
            &v(&["next", "kv_cache"]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("both stand for it"), "{e}");
    }
}
