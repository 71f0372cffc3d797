//! What neuronx-cc is known to accept, and the documented limits the check enforces: the one
//! place these facts and their sources live.
//!
//! There is no published operator table for neuronx-cc (the only AWS "supported XLA operators"
//! page is for the archived Inf1 `neuron-cc`); the authoritative list is what
//! `neuronx-cc list-operators --framework XLA` prints on an installed compiler. So an opcode is
//! listed here only with public evidence that neuronx-cc compiles it, named per entry by
//! [`Source`]. An opcode missing from the list is not known to fail: it is unknown, and the
//! check reports it so that someone verifies it (with `list-operators` on a Neuron host) before
//! it reaches a device, then adds it here with its source.

/// Where the evidence that neuronx-cc accepts an opcode comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// AWS's own HLO emitter writes it for neuronx-cc: aws-neuron/nkipy
    /// `nkipy/src/nkipy/core/backend/hlo.py` and `core/ops/_hlo_impls.py`.
    Nkipy,
    /// The neuronx-cc release notes announce support: 2.2.0.73 (`not`, `atan2`,
    /// `dynamic-update-slice` with constant indices), 2.3.0.4 (`reverse`).
    ReleaseNotes,
    /// An AWS error code documents a limit of the op, so the op itself compiles
    /// (aws-neuron-sdk `compiler/error-codes/`: EVRF022 shifts on 32-bit types, EVRF016 scatter,
    /// EVRF019 reduce-window, EVRF006 rng).
    ErrorCodes,
    /// GitHub issues in aws-neuron/aws-neuron-sdk: `sort` unsupported in 2024 and confirmed
    /// working on neuronx-cc 2.18.121.0 (#868); neuronx-cc rewrites a sort + slice into its
    /// `AwsNeuronTopK` (#1339).
    Issues,
    /// torch-xla lowers `torch.rsqrt`, `torch.sigmoid` and `torch.remainder` to these opcodes,
    /// and torch-neuronx compiles them through neuronx-cc. Inferred from torch-xla's lowering,
    /// not from an AWS document.
    TorchXla,
    /// Structural: every module has them (entry parameters, literals, tuple roots).
    Structural,
}

/// Every opcode neuronx-cc is known to accept, with the evidence.
pub const OPCODES: &[(&str, Source)] = &[
    ("parameter", Source::Structural),
    ("constant", Source::Structural),
    ("tuple", Source::Structural),
    ("get-tuple-element", Source::Structural),
    // Elementwise.
    ("add", Source::Nkipy),
    ("subtract", Source::Nkipy),
    ("multiply", Source::Nkipy),
    ("divide", Source::Nkipy),
    ("power", Source::Nkipy),
    ("maximum", Source::Nkipy),
    ("minimum", Source::Nkipy),
    ("and", Source::Nkipy),
    ("or", Source::Nkipy),
    ("xor", Source::Nkipy),
    ("compare", Source::Nkipy),
    ("abs", Source::Nkipy),
    ("exponential", Source::Nkipy),
    ("log", Source::Nkipy),
    ("sqrt", Source::Nkipy),
    ("sine", Source::Nkipy),
    ("cosine", Source::Nkipy),
    ("tanh", Source::Nkipy),
    ("negate", Source::Nkipy),
    ("ceil", Source::Nkipy),
    ("floor", Source::Nkipy),
    ("sign", Source::Nkipy),
    ("not", Source::ReleaseNotes),
    ("atan2", Source::ReleaseNotes),
    ("select", Source::Nkipy),
    ("convert", Source::Nkipy),
    ("rsqrt", Source::TorchXla),
    ("logistic", Source::TorchXla),
    ("remainder", Source::TorchXla),
    ("shift-left", Source::ErrorCodes),
    ("shift-right-logical", Source::ErrorCodes),
    ("shift-right-arithmetic", Source::ErrorCodes),
    // Shape and data movement.
    ("broadcast", Source::Nkipy),
    ("reshape", Source::Nkipy),
    ("transpose", Source::Nkipy),
    ("slice", Source::Nkipy),
    ("concatenate", Source::Nkipy),
    ("pad", Source::Nkipy),
    ("iota", Source::Nkipy),
    ("copy", Source::Nkipy),
    ("reverse", Source::ReleaseNotes),
    ("dynamic-update-slice", Source::ReleaseNotes),
    // Compute.
    ("dot", Source::Nkipy),
    ("reduce", Source::Nkipy),
    ("gather", Source::Nkipy),
    ("scatter", Source::Nkipy),
    ("convolution", Source::Nkipy),
    ("reduce-window", Source::ErrorCodes),
    ("sort", Source::Issues),
    // Collectives.
    ("all-gather", Source::Nkipy),
    ("all-reduce", Source::Nkipy),
    ("reduce-scatter", Source::Nkipy),
    ("all-to-all", Source::Nkipy),
    // Checked against CUSTOM_CALL_TARGETS.
    ("custom-call", Source::Nkipy),
];

/// The custom-call targets neuronx-cc recognises; any other fails with NCC_EHCA005 / EVRF015
/// (aws-neuron-sdk `compiler/error-codes/EHCA005.rst`).
pub const CUSTOM_CALL_TARGETS: &[&str] = &[
    "AwsNeuronErf",
    "AwsNeuronGelu",
    "AwsNeuronGeluApprxTanh",
    "AwsNeuronGeluBackward",
    "AwsNeuronSilu",
    "AwsNeuronSiluBackward",
    "AwsNeuronRmsNorm",
    "AwsNeuronSoftmax",
    "AwsNeuronSoftmaxBackward",
    "AwsNeuronCollectiveMatmul",
    "AwsNeuronIntMatmult",
    "AwsNeuronArgMax",
    "AwsNeuronArgMin",
    "AwsNeuronTopK",
    "AwsNeuronDropoutMaskV1",
    "AwsNeuronCustomNativeKernel",
    "AwsNeuronCustomOp",
    "AwsNeuronDevicePrint",
    "ResizeNearest",
    "ResizeBilinear",
    "ResizeNearestGrad",
    "AwsNeuronLNCShardingConstraint",
    "AwsNeuronTransferWithStaticRing",
    "AwsNeuronModuleMarkerStart-Forward",
    "AwsNeuronModuleMarkerStart-Backward",
    "AwsNeuronModuleMarkerEnd-Forward",
    "AwsNeuronModuleMarkerEnd-Backward",
    "NeuronBoundaryMarker-Start",
    "NeuronBoundaryMarker-End",
];

/// The custom-call target neuronx-cc rewrites a sort + slice into, and whose `k` is limited.
pub const TOPK_TARGET: &str = "AwsNeuronTopK";

/// The widest sort neuronx-cc compiles: it rewrites a sort followed by a slice into
/// `AwsNeuronTopK` with k = the sorted dimension's length, and fails with `NCC_EVRF014 TopK
/// custom operation does not support k values larger than 16384` (aws-neuron-sdk#1339, open on
/// 2.31).
pub const MAX_SORT_WIDTH: u64 = 16_384;

/// Tensors of this many bytes or more need Neuron runtime library 2.30.50.0 (Neuron SDK 2.28.0,
/// "Added support for tensors larger than 4GB with 64-bit addressing"); before it the
/// runtime's known issues say `nrt_tensor_allocate` sizes >= 4 GB overflow "leading to undefined
/// behavior" (aws-neuron-sdk `release-notes/components/runtime.rst`).
pub const LARGE_TENSOR_BYTES: u64 = 1 << 32;

/// The first runtime library (libnrt, as `nrt_get_version` reports it) with tensors of
/// [`LARGE_TENSOR_BYTES`] or more: 2.30.50.0, released with Neuron SDK 2.28.0 (2026-02-26).
pub const LARGE_TENSOR_RUNTIME: (u64, u64, u64) = (2, 30, 50);

/// The most instructions neuronx-cc generates for one graph before it refuses it: "\[XTP002\]
/// Number of instructions (8658944) is over the threshold (5000000)" (aws-neuron-sdk#987,
/// #819), "\[XTP003\] ... Operators are too large ... use tensor parallelism" (#1003).
pub const INSTRUCTION_BUDGET: u64 = 5_000_000;

/// The evidence for `opcode`, when neuronx-cc is known to accept it.
pub fn accepted(opcode: &str) -> Option<Source> {
    OPCODES.iter().find(|(o, _)| *o == opcode).map(|&(_, s)| s)
}

/// Whether neuronx-cc recognises the custom-call `target`.
pub fn known_custom_call(target: &str) -> bool {
    CUSTOM_CALL_TARGETS.contains(&target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_opcode_is_listed_once() {
        for (i, (o, _)) in OPCODES.iter().enumerate() {
            assert!(
                OPCODES[i + 1..].iter().all(|(p, _)| p != o),
                "{o} listed twice"
            );
        }
        assert_eq!(accepted("dot"), Some(Source::Nkipy));
        assert_eq!(accepted("while"), None);
        assert_eq!(accepted("conditional"), None);
        assert!(known_custom_call(TOPK_TARGET));
        assert!(!known_custom_call("MyKernel"));
    }
}
