//! The names of the step-metadata inputs every step graph declares: the one place they are
//! spelled. The model declares them ([`super::build_decode`], [`super::build_prefill`]), the
//! runner fills them each step (`runner::step`) and binds them on the device by these names.

/// Token ids fed this step, `[rows]` i32.
pub const INPUT_IDS: &str = "input_ids";
/// Position of each fed token in its sequence, `[rows]` i32.
pub const POSITIONS: &str = "positions";
/// Cache slot each fed token's latent is written to, `[rows]` i32.
pub const SLOT_MAPPING: &str = "slot_mapping";
/// Each sequence's block table cut to the context bucket, `[seqs, ctx / block_size]` i32.
pub const BLOCK_TABLES: &str = "block_tables";
/// Tokens each decoding sequence attends to (its position + 1), `[rows]` i32 (decode only).
pub const CONTEXT_LENS: &str = "context_lens";
/// Index of each chunk's last real token, `[seqs]` i32 (prefill only).
pub const LAST_INDEX: &str = "last_index";
/// Which chunk (row of `block_tables`) each fed token belongs to, `[rows]` i32 (packed prefill
/// only: a prefill graph of more than one sequence).
pub const SEQ_IDS: &str = "seq_ids";
/// Per-row sampling temperature, `[rows]` f32 (`<= 0` is greedy).
pub const TEMPERATURE: &str = "temperature";
/// Per-row top-k, `[rows]` i32 (`<= 0` disables it).
pub const TOP_K: &str = "top_k";
/// Per-row top-p, `[rows]` f32 (`>= 1` disables it).
pub const TOP_P: &str = "top_p";
/// Per-row seed of the counter-based generator, `[rows]` u32.
pub const SEEDS: &str = "seeds";

/// Every metadata input name, decode's and prefill's.
pub const ALL: [&str; 11] = [
    INPUT_IDS,
    POSITIONS,
    SLOT_MAPPING,
    BLOCK_TABLES,
    CONTEXT_LENS,
    LAST_INDEX,
    SEQ_IDS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    SEEDS,
];
