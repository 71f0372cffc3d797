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

/// Each sampled row's row of the sampling-state root, `[rows]` i32 (see `model::logits`).
pub const STATE_ROWS: &str = "state_rows";
/// Each chunk's sequence's prompt length, `[seqs]` i32 (prefill only): fed tokens at or past
/// it are generated ones, which the presence and frequency penalties count.
pub const PROMPT_LENS: &str = "prompt_lens";
/// Per-row `min_p`, `[rows]` f32 (0: off).
pub const MIN_P: &str = "min_p";
/// Per-row presence penalty, `[rows]` f32.
pub const PRESENCE_PENALTY: &str = "presence_penalty";
/// Per-row frequency penalty, `[rows]` f32.
pub const FREQUENCY_PENALTY: &str = "frequency_penalty";
/// Per-row repetition penalty, `[rows]` f32 (1: off).
pub const REPETITION_PENALTY: &str = "repetition_penalty";
/// Where each `logit_bias` entry lands in the flattened bias, `[rows * LOGIT_BIAS_SLOTS]` i32.
pub const LOGIT_BIAS_INDEX: &str = "logit_bias_index";
/// The `logit_bias` values, `[rows * LOGIT_BIAS_SLOTS]` f32.
pub const LOGIT_BIAS_VALUES: &str = "logit_bias_values";
/// Allowed-token bits per row, `[rows, vocab.div_ceil(32)]` u32 (structured outputs).
pub const ALLOWED_TOKENS: &str = "allowed_tokens";

/// Every metadata input name, decode's and prefill's.
pub const ALL: [&str; 20] = [
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
    STATE_ROWS,
    PROMPT_LENS,
    MIN_P,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    REPETITION_PENALTY,
    LOGIT_BIAS_INDEX,
    LOGIT_BIAS_VALUES,
    ALLOWED_TOKENS,
];

/// The `'static` name of the metadata input called `name` (one of [`ALL`]), for code that
/// reads names at run time (a loaded model's bindings, a leader's step message).
pub fn by_name(name: &str) -> Option<&'static str> {
    ALL.into_iter().find(|n| *n == name)
}
