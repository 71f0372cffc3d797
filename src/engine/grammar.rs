//! Structured outputs: from an OpenAI `response_format` to each step's allowed-token bitmask.
//!
//! The device applies a per-row bitmask (32 tokens per word, bit `j` of word `w` allows token
//! `32 * w + j`) before greedy and sampling; this module computes it on the host, with
//! [llguidance](https://github.com/guidance-ai/llguidance) (the grammar engine vLLM and
//! mistral.rs use): a JSON schema compiles to a grammar, and for each step llguidance walks the
//! tokenizer's token trie (`toktrie`) against the grammar's lexer to find every token that
//! keeps the output a prefix of some valid document.
//!
//! - [`ResponseFormat::from_openai`] parses the request's `response_format`.
//! - [`GrammarCompiler`] (one per tokenizer, shared behind an `Arc`) holds the token trie and
//!   llguidance's parser factory; [`GrammarCompiler::matcher`] compiles a format into a
//!   [`Constraint`], caching compiled grammars by their schema text.
//! - [`Constraint`] (one per sequence) writes the mask ([`Constraint::fill_mask`]) and follows
//!   the sampled tokens ([`Constraint::accept`]); [`fill_masks`] and [`advance_all`] do a
//!   step's rows on several threads.
//!
//! # When the masks are computed
//!
//! A row's mask depends on the token the previous step sampled for it, and only the step's
//! sampler needs it, not its forward pass. The scheduler hands a decode step's masks to the
//! runner as a callback (`runner::LateMasks`): a device runner that splits its decode steps
//! (`--split-sampler`, see `runner::device`, "Split sampling") computes them on another thread
//! while the forward pass runs on the device, and only what outlasts the forward pass delays
//! the step; other runners compute them first. Prefill steps compute them first too (the masks
//! of their last positions only). Either way the rows' grammars are independent, so
//! [`fill_masks`] and [`advance_all`] spread a step's rows over threads (see "Costs";
//! `benches/host_work.rs` measures 64 rows, alone and through a device step).
//!
//! # Tokens
//!
//! The trie holds each token's bytes: byte-level BPE vocabulary strings (GPT-2's byte-to-unicode
//! mapping, what DeepSeek's tokenizers use) are mapped back to bytes. Added tokens that are
//! marked special, or look like control tokens (`<...>`, as toktrie's own HF adapter treats
//! them), are special to llguidance: the grammar never allows them, except the tokenizer's
//! end-of-sequence token, which the mask allows exactly when the document is complete (and,
//! once it is finished, alone). Their text can still be spelled out of ordinary tokens when a
//! string calls for it. Token ids the tokenizer does not know (a model whose embedding is wider
//! than its tokenizer) are never allowed.
//!
//! # JSON defaults: no extra properties, compact whitespace
//!
//! Where a schema leaves something open, the output is held to less than JSON Schema allows,
//! as OpenAI's strict mode holds it (and, for properties, xgrammar, vLLM's default engine, and
//! outlines); the server's flags restore JSON Schema's reading ([`JsonOptions`],
//! `docs/structured-outputs-defaults.md`):
//!
//! - An object schema that lists `properties` (or `patternProperties`) and says nothing of
//!   `additionalProperties` admits no other keys ([`JsonOptions::additional_properties`]
//!   false): otherwise a model may add keys until `max_tokens`, as the default model did.
//!   Properties come in the order the schema lists them, the required ones always, the
//!   optional ones or not (llguidance's order; xgrammar's too).
//! - No whitespace between JSON tokens ([`JsonWhitespace::Compact`]: `{"a":1,"b":[2,3]}`, the
//!   way OpenAI's structured outputs and tool arguments come), or, flexible, a bounded run
//!   at each place JSON allows one ([`FLEXIBLE_WHITESPACE_PATTERN`]): llguidance's own default,
//!   any run, let a small model loop on newlines until `max_tokens`. None before the first
//!   token or after the last either way.
//!
//! A schema that sets llguidance's options itself (a top-level `"x-guidance"` object) keeps
//! them as given, whitespace included.
//!
//! # What callers must know
//!
//! - The constraint starts at the first generated token: the output is the document and
//!   nothing else. A model that reasons first (`<think>...</think>`) must have thinking off,
//!   or the caller must start feeding the constraint after the reasoning.
//! - Where the grammar leaves one way forward (a required key's name, an enum's only
//!   remaining value), the mask holds only the tokenizer's own tokenization of that text,
//!   as llguidance forces it.
//! - A request with `ignore_eos` cannot go on once [`Constraint::is_finished`]: end it.
//!
//! # Shared lexers
//!
//! llguidance's lexer is a DFA built lazily, a state at a time, as documents reach new lexer
//! states; building a state (regex derivatives) costs far more than following one. A deep copy
//! of a compiled grammar has its own, empty DFA; a shallow copy shares the DFA of the copy it
//! came from (behind a mutex, held while a mask is computed or a token taken). So each
//! compiled grammar keeps a few *lexer families* (a few per rayon thread), and every sequence
//! gets a shallow copy of one of them in turn: the DFA a family has built serves all its later
//! sequences, and [`fill_masks`] and [`advance_all`] run each family's rows one after another
//! on one thread (they would wait on its mutex anyway) and different families in parallel.
//! A family is replaced by a fresh deep copy after [`FAMILY_SEQUENCES`] sequences, or once its
//! sequences have spent [`FAMILY_LEXER_FUEL`] of llguidance's lexer fuel (the work of building
//! DFA states, so a bound on the states it holds, at 1 to 2 kB each), so a DFA that grew with
//! unusual documents does not stay large (or near llguidance's cap on lexer states, which would
//! fail every sequence sharing it) for good: the old one is freed when its last sequence ends.
//!
//! # Costs
//!
//! On a shared 2-core machine (`tests/grammar.rs`, `benches/host_work.rs`): building a
//! [`GrammarCompiler`] for a 129k-token vocabulary takes about 0.4 s; compiling a small schema
//! under 1 ms, and a cached one's copy about 10 µs. At 129k tokens a mask between JSON tokens
//! takes a few microseconds once its lexer family has built the states; inside a string with
//! `maxLength`, near the bound, 0.4 to 2 ms: each position is a lexer state of its own, and
//! llguidance's precomputed token slices (strings of up to 10 and 30 characters) no longer fit,
//! so it walks the whole token trie. That walk, not the DFA, is what a step's masks cost there.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
// toktrie through llguidance's re-export: always the version llguidance was built with.
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Map, Value};

use crate::error::ErrorKind;
use crate::tokenizer::Tokenizer;

/// The whitespace flexible JSON ([`JsonWhitespace::Flexible`]) allows at each place JSON
/// allows whitespace: at most one line break and 12 spaces or tabs after it, enough for
/// documents pretty-printed three levels deep, and bounded so a model cannot loop on blank
/// lines until `max_tokens` (a run of 32 newlines per place, the first bound tried, let the
/// default model fill 200 tokens with a three-key object).
pub const FLEXIBLE_WHITESPACE_PATTERN: &str = r"[\x20\x09]{1,12}|\x0A[\x20\x09]{0,12}";

/// Whitespace between JSON tokens (`--json-whitespace`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JsonWhitespace {
    /// None at all: `{"a":1,"b":[2,3]}`, as OpenAI writes structured outputs and tool
    /// arguments. The default: whitespace is what an untrained model spends tokens on, and
    /// programs read these documents.
    #[default]
    Compact,
    /// A bounded run ([`FLEXIBLE_WHITESPACE_PATTERN`]) wherever JSON allows whitespace, for
    /// a model that writes pretty-printed JSON and does worse when kept from it.
    Flexible,
}

/// How JSON schemas are read where they leave the output open (see "JSON defaults" in the
/// module docs): the server's `--schema-allow-additional-properties` and `--json-whitespace`.
/// The default is OpenAI strict mode's reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JsonOptions {
    /// Whether an object schema listing `properties` but not `additionalProperties` admits
    /// other keys, as JSON Schema reads it (`true`), or not (`false`, the default, as
    /// xgrammar, outlines and OpenAI's strict mode read it).
    pub additional_properties: bool,
    /// Whitespace between JSON tokens.
    pub whitespace: JsonWhitespace,
}

impl JsonOptions {
    /// `schema` as the grammar compiles it under these options: closed objects (unless
    /// [`JsonOptions::additional_properties`]) and llguidance's whitespace options (unless
    /// the schema sets its own `"x-guidance"`).
    ///
    /// Closing an object adds `"additionalProperties": false` where the schema has
    /// `properties` or `patternProperties`, no `additionalProperties` or
    /// `unevaluatedProperties`, and stands alone: not a branch of `allOf` (whose branches'
    /// properties add up, so closing each would forbid the others'), not itself combined
    /// with `allOf`, `anyOf`, `oneOf` or `$ref`, and not a branch of an `anyOf` or `oneOf`
    /// whose owner lists properties of its own. Those keep JSON Schema's reading; every
    /// subschema below them is still closed. Nothing under `not`, `if`, `then`, `else`,
    /// `const`, `enum` or annotations is touched.
    pub fn apply(&self, mut schema: Value) -> Value {
        if !self.additional_properties {
            close_objects(&mut schema, true);
        }
        if let Value::Object(object) = &mut schema {
            if !object.contains_key("x-guidance") {
                let options = match self.whitespace {
                    // llguidance's separators are `,` and `:` by default.
                    JsonWhitespace::Compact => json!({"whitespace_flexible": false}),
                    JsonWhitespace::Flexible => {
                        json!({"whitespace_pattern": FLEXIBLE_WHITESPACE_PATTERN})
                    }
                };
                object.insert("x-guidance".into(), options);
            }
        }
        schema
    }
}

/// Adds `"additionalProperties": false` to the object schemas of `schema` that stand alone
/// (see [`JsonOptions::apply`]); `closable` is false for a branch whose owner combines it
/// with other properties.
fn close_objects(schema: &mut Value, closable: bool) {
    let Value::Object(object) = schema else {
        return;
    };
    let lists = object.contains_key("properties") || object.contains_key("patternProperties");
    let open = !object.contains_key("additionalProperties")
        && !object.contains_key("unevaluatedProperties");
    let combined = ["allOf", "anyOf", "oneOf", "$ref"]
        .iter()
        .any(|k| object.contains_key(*k));
    // Whether this schema says something of its own keys, which its anyOf/oneOf branches'
    // keys combine with.
    let owns_keys = lists || !open;
    for (key, value) in object.iter_mut() {
        match key.as_str() {
            // Maps of subschemas.
            "properties" | "patternProperties" | "$defs" | "definitions" => {
                if let Value::Object(map) = value {
                    map.values_mut().for_each(|s| close_objects(s, true));
                }
            }
            // One subschema, or (`items` before draft 2020-12) a list of them.
            "additionalProperties"
            | "unevaluatedProperties"
            | "items"
            | "additionalItems"
            | "unevaluatedItems"
            | "contains"
            | "prefixItems" => match value {
                Value::Array(list) => list.iter_mut().for_each(|s| close_objects(s, true)),
                other => close_objects(other, true),
            },
            "anyOf" | "oneOf" => {
                if let Value::Array(list) = value {
                    list.iter_mut().for_each(|s| close_objects(s, !owns_keys));
                }
            }
            "allOf" => {
                if let Value::Array(list) = value {
                    list.iter_mut().for_each(|s| close_objects(s, false));
                }
            }
            _ => {}
        }
    }
    if closable && lists && open && !combined {
        object.insert("additionalProperties".into(), Value::Bool(false));
    }
}

/// How many compiled grammars a [`GrammarCompiler`] keeps: clients of structured outputs tend
/// to send the same few schemas over and over, and a compiled grammar (with its lexer cache)
/// is worth keeping, but not without bound.
const CACHE_CAPACITY: usize = 64;

/// How many sequences one lexer family serves before it is replaced by a fresh copy of the
/// compiled grammar (see "Shared lexers" above): enough that the DFA's building cost is spread
/// thin, few enough that an outgrown DFA does not last.
pub const FAMILY_SEQUENCES: usize = 256;

/// The lexer fuel (llguidance's measure of DFA-building work: about 14,000 a millisecond) a
/// family's sequences may spend before the family is renewed: five times what llguidance allows
/// a large schema's compilation.
pub const FAMILY_LEXER_FUEL: u64 = 5_000_000;

/// Why a response format could not be parsed or compiled, or a token not followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GrammarError {
    /// `response_format` does not have OpenAI's shape; `field` is the path of the offending
    /// value (`response_format.json_schema.schema`), so the client knows what to fix.
    #[error("invalid {field}: {message}")]
    ResponseFormat {
        /// The JSON path of the field, from `response_format`.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// llguidance refused the schema: it is invalid, unsatisfiable, or uses a feature it does
    /// not support. The message is llguidance's own (it names the keyword).
    #[error("invalid JSON schema in response_format: {0}")]
    Schema(String),
    /// The tokenizer cannot back a grammar (it is not byte-level BPE, or has no end-of-sequence
    /// token).
    #[error("structured outputs are unavailable for this tokenizer: {0}")]
    Tokenizer(String),
    /// The constraint could not follow a token: the token was not allowed by the last mask,
    /// or llguidance failed. The constraint is then in its error state.
    #[error("token {token} rejected by the response_format grammar: {message}")]
    Rejected {
        /// The token passed to [`Constraint::accept`].
        token: u32,
        /// llguidance's explanation.
        message: String,
    },
}

impl GrammarError {
    /// The coarse kind, for the server to pick a status: what the request got wrong
    /// ([`ErrorKind::InvalidInput`], a 400) versus the model's tokenizer or a bug.
    pub fn kind(&self) -> ErrorKind {
        match self {
            GrammarError::ResponseFormat { .. } | GrammarError::Schema(_) => {
                ErrorKind::InvalidInput
            }
            GrammarError::Tokenizer(_) => ErrorKind::InvalidModel,
            GrammarError::Rejected { .. } => ErrorKind::Internal,
        }
    }

    fn field(field: &str, message: impl Into<String>) -> Self {
        GrammarError::ResponseFormat {
            field: field.to_string(),
            message: message.into(),
        }
    }
}

/// What shape the output must have: OpenAI's `response_format`.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// Free text (no constraint).
    Text,
    /// Any JSON object.
    JsonObject,
    /// A JSON document valid against `schema`.
    JsonSchema {
        /// `json_schema.name`, which OpenAI requires (letters, digits, `_` and `-`, at most
        /// 64); kept for logs.
        name: String,
        /// `json_schema.schema`, a JSON Schema object.
        schema: Value,
        /// `json_schema.strict`. The grammar enforces the schema either way; an unsupported
        /// feature is an error either way.
        strict: Option<bool>,
    },
}

impl ResponseFormat {
    /// Parses OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}` or
    /// `{"type": "json_schema", "json_schema": {"name", "description"?, "schema", "strict"?}}`.
    ///
    /// Unknown keys are errors, as OpenAI's API makes them, so a misspelt key is not silently
    /// ignored; every error names the field.
    pub fn from_openai(value: &Value) -> Result<Self, GrammarError> {
        const ROOT: &str = "response_format";
        let object = value
            .as_object()
            .ok_or_else(|| GrammarError::field(ROOT, format!("must be an object, got {value}")))?;
        let kind = match object.get("type") {
            None => return Err(GrammarError::field("response_format.type", "is required")),
            Some(Value::String(kind)) => kind.as_str(),
            Some(other) => {
                return Err(GrammarError::field(
                    "response_format.type",
                    format!("must be a string, got {other}"),
                ))
            }
        };
        let allowed: &[&str] = match kind {
            "text" | "json_object" => &["type"],
            "json_schema" => &["type", "json_schema"],
            other => {
                return Err(GrammarError::field(
                    "response_format.type",
                    format!(
                        "unknown type {:?}; expected \"text\", \"json_object\" or \"json_schema\"",
                        other
                    ),
                ))
            }
        };
        reject_unknown_keys(object, allowed, ROOT)?;
        match kind {
            "text" => Ok(ResponseFormat::Text),
            "json_object" => Ok(ResponseFormat::JsonObject),
            _ => parse_json_schema(object.get("json_schema")),
        }
    }
}

impl ResponseFormat {
    /// The grammar the format's outputs follow under the default [`JsonOptions`], or `None`
    /// for free text.
    pub fn grammar(&self) -> Option<OutputGrammar> {
        self.grammar_with(&JsonOptions::default())
    }

    /// The grammar the format's outputs follow under `options` (the server's flags), or
    /// `None` for free text. `json_object` is the schema `{"type": "object"}`: any object,
    /// whitespace as `options` say.
    pub fn grammar_with(&self, options: &JsonOptions) -> Option<OutputGrammar> {
        let schema = match self {
            ResponseFormat::Text => return None,
            ResponseFormat::JsonObject => json!({"type": "object"}),
            ResponseFormat::JsonSchema { schema, .. } => schema.clone(),
        };
        Some(OutputGrammar::JsonSchema(options.apply(schema)))
    }
}

fn reject_unknown_keys(
    object: &Map<String, Value>,
    allowed: &[&str],
    path: &str,
) -> Result<(), GrammarError> {
    match object.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(key) => Err(GrammarError::field(
            &format!("{path}.{key}"),
            format!("unknown field; expected one of {}", allowed.join(", ")),
        )),
        None => Ok(()),
    }
}

fn parse_json_schema(value: Option<&Value>) -> Result<ResponseFormat, GrammarError> {
    const PATH: &str = "response_format.json_schema";
    let object = match value {
        None => {
            return Err(GrammarError::field(
                PATH,
                "is required when type is \"json_schema\"",
            ))
        }
        Some(Value::Object(object)) => object,
        Some(other) => {
            return Err(GrammarError::field(
                PATH,
                format!("must be an object, got {other}"),
            ))
        }
    };
    reject_unknown_keys(object, &["name", "description", "schema", "strict"], PATH)?;

    let name = match object.get("name") {
        None => return Err(GrammarError::field(&format!("{PATH}.name"), "is required")),
        Some(Value::String(name)) => name,
        Some(other) => {
            return Err(GrammarError::field(
                &format!("{PATH}.name"),
                format!("must be a string, got {other}"),
            ))
        }
    };
    let name_ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !name_ok {
        return Err(GrammarError::field(
            &format!("{PATH}.name"),
            format!("{name:?} must be 1 to 64 letters, digits, underscores or dashes"),
        ));
    }
    if let Some(description) = object.get("description") {
        if !description.is_string() {
            return Err(GrammarError::field(
                &format!("{PATH}.description"),
                format!("must be a string, got {description}"),
            ));
        }
    }
    let schema = match object.get("schema") {
        None => {
            return Err(GrammarError::field(
                &format!("{PATH}.schema"),
                "is required (the JSON Schema the output must follow)",
            ))
        }
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(other) => {
            return Err(GrammarError::field(
                &format!("{PATH}.schema"),
                format!("must be a JSON Schema object, got {other}"),
            ))
        }
    };
    let strict = match object.get("strict") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(strict)) => Some(*strict),
        Some(other) => {
            return Err(GrammarError::field(
                &format!("{PATH}.strict"),
                format!("must be a boolean, got {other}"),
            ))
        }
    };
    Ok(ResponseFormat::JsonSchema {
        name: name.clone(),
        schema,
        strict,
    })
}

/// GPT-2's byte-to-unicode table, inverted: which byte each character of a byte-level BPE
/// vocabulary string stands for. Printable Latin-1 bytes (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) stand
/// for themselves; the other 68 bytes, in increasing order, were given the characters from
/// U+0100 on.
fn byte_level_decoder() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    let mut map = HashMap::with_capacity(256);
    for byte in 0..=255u8 {
        let c = if printable(byte) {
            char::from(byte)
        } else {
            let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
            next += 1;
            c
        };
        map.insert(c, byte);
    }
    map
}

/// Whether the tokenizer's decoder is byte-level (alone or inside a sequence).
fn is_byte_level(decoder: Option<&tokenizers::DecoderWrapper>) -> bool {
    use tokenizers::DecoderWrapper;
    match decoder {
        Some(DecoderWrapper::ByteLevel(_)) => true,
        Some(DecoderWrapper::Sequence(sequence)) => sequence
            .get_decoders()
            .iter()
            .any(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
        _ => false,
    }
}

/// Each token's bytes as the token trie wants them: vocabulary strings through the byte-level
/// table, special tokens as `0xFF` followed by their text, unknown ids empty (never allowed).
/// Also returns how many vocabulary strings did not map (logged).
fn token_bytes(inner: &tokenizers::Tokenizer, vocab_size: usize) -> (Vec<Vec<u8>>, usize) {
    let decoder = byte_level_decoder();
    let added = inner.get_added_tokens_decoder();
    let mut unmapped = 0;
    let words = (0..vocab_size)
        .map(|id| {
            let id = id as u32;
            if let Some(token) = added.get(&id) {
                let content = &token.content;
                let control = content.starts_with('<') && content.ends_with('>');
                if token.special || control {
                    let mut bytes = Vec::with_capacity(content.len() + 1);
                    bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    bytes.extend_from_slice(content.as_bytes());
                    return bytes;
                }
                // An added token that is plain text decodes to its text as written.
                return content.as_bytes().to_vec();
            }
            let Some(text) = inner.id_to_token(id) else {
                return Vec::new();
            };
            let bytes: Option<Vec<u8>> = text.chars().map(|c| decoder.get(&c).copied()).collect();
            bytes.unwrap_or_else(|| {
                unmapped += 1;
                Vec::new()
            })
        })
        .collect();
    (words, unmapped)
}

/// The tokenizer as llguidance sees it: the trie, and canonical tokenization (by the real
/// tokenizer) for the text a grammar forces, so forced text is offered as the tokens the
/// model was trained on.
struct TokenEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for TokenEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        // Forced bytes may end inside a UTF-8 character: the valid part goes through the
        // tokenizer, the rest through the trie (llguidance re-checks the tail tokens anyway).
        let (text, rest) = match std::str::from_utf8(bytes) {
            Ok(text) => (text, &[][..]),
            Err(e) => {
                let (valid, rest) = bytes.split_at(e.valid_up_to());
                (std::str::from_utf8(valid).unwrap_or_default(), rest)
            }
        };
        let mut ids = match self.tokenizer.encode(text, false) {
            Ok(encoding) => encoding.get_ids().to_vec(),
            Err(_) => self.trie.greedy_tokenize(text.as_bytes()),
        };
        ids.extend(self.trie.greedy_tokenize(rest));
        ids
    }
}

/// Compiles response formats into per-sequence [`Constraint`]s for one tokenizer.
///
/// Built once per model (building the token trie and llguidance's token slices takes a while
/// for a large vocabulary) and shared behind an `Arc`; it is `Send + Sync`.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab_size: usize,
    eos_token_id: u32,
    cache: Mutex<GrammarCache>,
}

/// Compiled grammars by their text, oldest first out.
#[derive(Default)]
struct GrammarCache {
    grammars: HashMap<String, CompiledGrammar>,
    order: VecDeque<String>,
    /// [`GrammarCacheStats::hits`], counted under the lock.
    hits: u64,
    /// [`GrammarCacheStats::compiles`], counted under the lock.
    compiles: u64,
}

/// What a [`GrammarCompiler`]'s cache of compiled grammars has done so far.
///
/// Counters rather than a timing: a test can tell a cache hit from a compile exactly, where
/// "the second request was faster" depends on the machine's load. Also what an operator would
/// read to size the cache (its capacity is fixed at 64 grammars, oldest out first).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GrammarCacheStats {
    /// Constraints served from an already compiled grammar.
    pub hits: u64,
    /// Grammars compiled because none was cached, failed compilations included (an invalid
    /// schema is not cached, so sending it again compiles it again). Two threads that miss
    /// the same grammar at once both compile it; one result is kept.
    pub compiles: u64,
    /// Compiled grammars held now.
    pub cached: usize,
}

/// One compiled grammar: a never advanced original and the lexer families sequences are
/// copied from (see "Shared lexers" in the module docs).
struct CompiledGrammar {
    original: Matcher,
    families: Vec<LexerFamily>,
    /// The family the next sequence joins.
    next: usize,
}

/// A never advanced matcher whose lexer (DFA) its shallow copies share.
struct LexerFamily {
    template: Matcher,
    /// The lexer fuel its sequences have spent, shared with them (each adds its own); the
    /// `Arc` also names the family ([`Constraint::family`]).
    fuel: Arc<AtomicU64>,
    sequences: usize,
}

impl LexerFamily {
    fn new(original: &Matcher) -> Self {
        LexerFamily {
            template: original.deep_clone(),
            fuel: Arc::new(AtomicU64::new(0)),
            sequences: 0,
        }
    }

    /// Whether the family has served its share and is to be replaced by a fresh copy.
    fn is_spent(&self) -> bool {
        self.sequences >= FAMILY_SEQUENCES || self.fuel.load(Ordering::Relaxed) >= FAMILY_LEXER_FUEL
    }
}

impl CompiledGrammar {
    fn new(original: Matcher) -> Self {
        CompiledGrammar {
            original,
            families: Vec::new(),
            next: 0,
        }
    }

    /// A sequence's matcher: a shallow copy of the next family's template (sharing its
    /// lexer), with the family's fuel counter. Families are made as sequences arrive, up to
    /// [`lexer_families`], and renewed once spent ([`FAMILY_SEQUENCES`], [`FAMILY_LEXER_FUEL`]).
    fn matcher(&mut self) -> (Matcher, Arc<AtomicU64>) {
        if self.families.len() < lexer_families() {
            self.families.push(LexerFamily::new(&self.original));
        }
        let index = self.next % self.families.len();
        self.next = index + 1;
        let family = &mut self.families[index];
        if family.is_spent() {
            *family = LexerFamily::new(&self.original);
        }
        family.sequences += 1;
        (family.template.clone(), Arc::clone(&family.fuel))
    }
}

/// How many lexer families a compiled grammar keeps: a few per rayon thread, so that a step's
/// rows split into enough independent groups for the threads to balance uneven masks (one
/// inside a bounded string costs a hundred times one between keys), and at most 32, each
/// family's DFA being memory the grammar keeps.
fn lexer_families() -> usize {
    (4 * rayon::current_num_threads()).clamp(1, 32)
}

impl fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab_size", &self.vocab_size)
            .field("eos_token_id", &self.eos_token_id)
            .finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// Builds the token trie from `tokenizer`'s vocabulary and llguidance's parser factory.
    ///
    /// Fails when the tokenizer is not byte-level BPE (the only kind whose token bytes this
    /// reads) or has no end-of-sequence token (a grammar needs one to say "done").
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, GrammarError> {
        let inner = tokenizer.inner();
        if !is_byte_level(inner.get_decoder()) {
            return Err(GrammarError::Tokenizer(
                "only byte-level BPE tokenizers (a ByteLevel decoder, as DeepSeek's) are supported"
                    .into(),
            ));
        }
        let eos_token_id = tokenizer.eos_token_id().ok_or_else(|| {
            GrammarError::Tokenizer(
                "the tokenizer has no end-of-sequence token (tokenizer_config.json eos_token)"
                    .into(),
            )
        })?;
        let vocab_size = tokenizer.vocab_size();
        let vocab_u32 = u32::try_from(vocab_size)
            .map_err(|_| GrammarError::Tokenizer(format!("vocabulary of {vocab_size} tokens")))?;
        if eos_token_id >= vocab_u32 {
            return Err(GrammarError::Tokenizer(format!(
                "end-of-sequence token {eos_token_id} is outside the vocabulary of {vocab_size}"
            )));
        }
        let (words, unmapped) = token_bytes(inner, vocab_size);
        if unmapped > 0 {
            tracing::warn!(
                unmapped,
                "structured outputs: vocabulary strings outside the byte-level alphabet are never allowed"
            );
        }
        let info = TokRxInfo {
            vocab_size: vocab_u32,
            tok_eos: eos_token_id,
            tok_bos: tokenizer.bos_token_id(),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(TokenEnv {
            trie,
            tokenizer: inner.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| GrammarError::Tokenizer(format!("{e:#}")))?;
        // llguidance logs to stderr by default; warnings are passed to `tracing` instead.
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            vocab_size,
            eos_token_id,
            cache: Mutex::new(GrammarCache::default()),
        })
    }

    /// The number of token ids the masks cover (the tokenizer's vocabulary, added tokens
    /// included).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The number of `u32` words a mask needs: `vocab_size().div_ceil(32)`.
    pub fn mask_words(&self) -> usize {
        self.vocab_size.div_ceil(32)
    }

    /// The token the masks allow when the document is complete.
    pub fn eos_token_id(&self) -> u32 {
        self.eos_token_id
    }

    /// A fresh constraint for one sequence, or `None` for [`ResponseFormat::Text`].
    ///
    /// Compiles the format's schema (once: compiled grammars are cached by schema text, and
    /// each sequence gets its own copy). An invalid schema, or one using a feature llguidance
    /// does not support, is a [`GrammarError::Schema`] in llguidance's words.
    pub fn matcher(&self, format: &ResponseFormat) -> Result<Option<Constraint>, GrammarError> {
        self.matcher_with(format, &JsonOptions::default())
    }

    /// [`GrammarCompiler::matcher`] under `options` instead of the default [`JsonOptions`]
    /// (the server's flags).
    pub fn matcher_with(
        &self,
        format: &ResponseFormat,
        options: &JsonOptions,
    ) -> Result<Option<Constraint>, GrammarError> {
        format
            .grammar_with(options)
            .map(|g| self.grammar_matcher(&g))
            .transpose()
    }

    /// A fresh constraint for one sequence following `grammar`, compiled once per distinct
    /// grammar as [`GrammarCompiler::matcher`]'s are.
    pub fn grammar_matcher(&self, grammar: &OutputGrammar) -> Result<Constraint, GrammarError> {
        let key = match grammar {
            OutputGrammar::JsonSchema(schema) => format!("json:{schema}"),
            OutputGrammar::Lark(lark) => format!("lark:{lark}"),
        };
        {
            let mut guard = self.lock_cache();
            let cache = &mut *guard;
            if let Some(compiled) = cache.grammars.get_mut(&key) {
                cache.hits += 1;
                return Ok(self.constraint(compiled.matcher()));
            }
            cache.compiles += 1;
        }
        // Compiled outside the lock: a large schema takes milliseconds.
        let original = self.compile(grammar)?;
        let mut guard = self.lock_cache();
        let cache = &mut *guard;
        if !cache.grammars.contains_key(&key) {
            if cache.order.len() >= CACHE_CAPACITY {
                if let Some(oldest) = cache.order.pop_front() {
                    cache.grammars.remove(&oldest);
                }
            }
            cache.order.push_back(key.clone());
        }
        let compiled = cache
            .grammars
            .entry(key)
            .or_insert_with(|| CompiledGrammar::new(original));
        Ok(self.constraint(compiled.matcher()))
    }

    /// How often the cache of compiled grammars was hit, how many compilations it took, and
    /// how many grammars it holds (see [`GrammarCacheStats`]).
    pub fn cache_stats(&self) -> GrammarCacheStats {
        let cache = self.lock_cache();
        GrammarCacheStats {
            hits: cache.hits,
            compiles: cache.compiles,
            cached: cache.grammars.len(),
        }
    }

    fn constraint(&self, (matcher, family): (Matcher, Arc<AtomicU64>)) -> Constraint {
        Constraint {
            matcher,
            family,
            vocab_size: self.vocab_size,
            eos_token_id: self.eos_token_id,
        }
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, GrammarCache> {
        // The cache holds no invariant a panic could break halfway: use it as it is.
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn compile(&self, grammar: &OutputGrammar) -> Result<Matcher, GrammarError> {
        let grammar = match grammar {
            OutputGrammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            OutputGrammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Schema(format!("{e:#}")))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(GrammarError::Schema(error));
        }
        for warning in matcher.grammar_warnings() {
            tracing::debug!(%warning, "structured outputs: llguidance grammar warning");
        }
        Ok(matcher)
    }
}

/// What a [`Constraint`] enforces.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputGrammar {
    /// A JSON document valid against this schema (llguidance's JSON schema options included:
    /// see [`JsonOptions::apply`]).
    JsonSchema(Value),
    /// Text in llguidance's Lark dialect, which can embed JSON schemas (`%json {...}`) and
    /// name single tokens (`<[id]>`): how tool calls are constrained.
    Lark(String),
}

/// Rows from which [`fill_masks`] spreads the work over threads: below it, handing the rows
/// to rayon's pool costs about what it saves.
const PARALLEL_ROWS: usize = 4;

/// Runs `work` on every row, one lexer family's rows one after another (they share its
/// mutex) and different families on rayon's threads when there are at least a few rows;
/// the results in row order.
fn by_lexer_family<T: Send, R: Send>(
    rows: &mut [T],
    constraint: impl Fn(&T) -> &Constraint,
    work: impl Fn(&mut T) -> R + Sync,
) -> Vec<R> {
    use rayon::prelude::*;
    if rows.len() < PARALLEL_ROWS {
        return rows.iter_mut().map(work).collect();
    }
    let mut families: HashMap<usize, Vec<(usize, &mut T)>> = HashMap::new();
    for (index, row) in rows.iter_mut().enumerate() {
        let family = Arc::as_ptr(&constraint(row).family) as usize;
        families.entry(family).or_default().push((index, row));
    }
    let mut results: Vec<(usize, R)> = families
        .into_par_iter()
        .flat_map_iter(|(_, rows)| rows.into_iter().map(|(i, row)| (i, work(row))))
        .collect();
    results.sort_unstable_by_key(|(index, _)| *index);
    results.into_iter().map(|(_, r)| r).collect()
}

/// Fills each row's mask for its next token ([`Constraint::fill_mask`]): a step's host work
/// under structured outputs, spread over threads by lexer family (see "Shared lexers" in the
/// module docs).
pub fn fill_masks(rows: &mut [(&mut Constraint, &mut [u32])]) {
    by_lexer_family(rows, |(c, _)| c, |(c, words)| c.fill_mask(words));
}

/// What a constraint made of the token a sequence just generated ([`Constraint::advance`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Advance {
    /// The document was already complete: the token ends the sequence if it is
    /// end-of-sequence (the only token the mask allowed).
    WasFinished,
    /// The grammar took the token.
    Accepted,
    /// The grammar refused the token (the mask should have prevented it: a bug), with why.
    Refused(String),
}

/// Advances each row's constraint by the token its row just generated, spread over threads
/// as [`fill_masks`]; the results in row order.
pub fn advance_all(rows: &mut [(&mut Constraint, u32)]) -> Vec<Advance> {
    by_lexer_family(rows, |(c, _)| c, |(c, token)| c.advance(*token))
}

/// One sequence's grammar state: which tokens may come next, advanced by each sampled token.
///
/// Use per step: [`Constraint::fill_mask`] before the device samples the row, then
/// [`Constraint::accept`] with the sampled token. When the document is complete the mask allows
/// only the end-of-sequence token, and [`Constraint::is_finished`] says so once it is certain.
///
/// Preemption needs nothing: a preempted sequence keeps its generated tokens and is recomputed
/// from them, so its constraint (which has seen exactly those tokens) stays where it is.
/// [`Constraint::rollback`] exists for speculative decoding, which un-samples tokens.
pub struct Constraint {
    matcher: Matcher,
    /// The lexer fuel counter of the family whose DFA `matcher` shares (see "Shared lexers" in
    /// the module docs); its address names the family.
    family: Arc<AtomicU64>,
    vocab_size: usize,
    eos_token_id: u32,
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint")
            .field("vocab_size", &self.vocab_size)
            .field("finished", &self.is_finished())
            .field("error", &self.matcher.get_error())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Writes the allowed-token bitmask for the next token into `words`: bit `j` of word `w`
    /// allows token `32 * w + j`.
    ///
    /// `words` may be longer than the tokenizer needs ([`GrammarCompiler::mask_words`]) when
    /// the model's vocabulary is wider: every bit past the tokenizer's vocabulary is 0. When
    /// the document is complete only the end-of-sequence token is allowed; so it is if the
    /// constraint is in its error state (see [`Constraint::error`]), which ends the sequence
    /// instead of letting it run unconstrained.
    ///
    /// # Panics
    ///
    /// If `words` is shorter than `vocab_size.div_ceil(32)`: a caller bug, and a silently
    /// truncated mask would forbid tokens the grammar needs.
    pub fn fill_mask(&mut self, words: &mut [u32]) {
        let needed = self.vocab_size.div_ceil(32);
        assert!(
            words.len() >= needed,
            "grammar mask needs {needed} words for {} tokens, got {}",
            self.vocab_size,
            words.len()
        );
        let stopped = self.matcher.is_stopped();
        match self.matcher.compute_mask_or_eos() {
            Ok(mask) => {
                // The DFA-building work of this mask, counted against the family's renewal.
                if let (false, Ok(stats)) = (stopped, self.matcher.last_step_stats()) {
                    self.family.fetch_add(stats.lexer_cost, Ordering::Relaxed);
                }
                let bits = mask.as_slice();
                let n = bits.len().min(needed);
                words[..n].copy_from_slice(&bits[..n]);
                words[n..].fill(0);
                let tail = self.vocab_size % 32;
                if tail != 0 {
                    words[needed - 1] &= (1u32 << tail) - 1;
                }
            }
            Err(_) => {
                words.fill(0);
                let eos = self.eos_token_id as usize;
                words[eos / 32] |= 1 << (eos % 32);
            }
        }
    }

    /// [`Constraint::accept`] unless the document is already complete, as one answer.
    pub fn advance(&mut self, token: u32) -> Advance {
        if self.is_finished() {
            return Advance::WasFinished;
        }
        match self.accept(token) {
            Ok(()) => Advance::Accepted,
            Err(e) => Advance::Refused(e.to_string()),
        }
    }

    /// Advances the grammar by the token the sequence just generated.
    ///
    /// The token must have been allowed by the last mask; otherwise this is an error and the
    /// constraint stays in its error state. The end-of-sequence token after the document is
    /// finished is accepted (and changes nothing).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        if token == self.eos_token_id && self.is_finished() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Rejected {
                token,
                message: format!("{e:#}"),
            })
    }

    /// Whether the document is complete: nothing but the end-of-sequence token may follow.
    /// (Before this is true the mask may already allow EOS next to other tokens, e.g. after a
    /// number that could have more digits.)
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped() && !self.matcher.is_error()
    }

    /// llguidance's error, once the constraint is in its error state (a rejected token or an
    /// internal failure); the caller should end the sequence with an error.
    pub fn error(&self) -> Option<String> {
        self.matcher.get_error()
    }

    /// Un-accepts the last `tokens` tokens (for speculative decoding, whose rejected draft
    /// tokens were accepted); errors if fewer were accepted.
    pub fn rollback(&mut self, tokens: usize) -> Result<(), GrammarError> {
        self.matcher
            .rollback(tokens)
            .map_err(|e| GrammarError::Rejected {
                token: self.eos_token_id,
                message: format!("rollback of {tokens} tokens: {e:#}"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_gpt2s() {
        let map = byte_level_decoder();
        assert_eq!(map.len(), 256);
        // 'Ġ' is the space, 'Ċ' the newline, 'ĉ' the tab; printable bytes stand for themselves.
        assert_eq!(map[&'Ġ'], b' ');
        assert_eq!(map[&'Ċ'], b'\n');
        assert_eq!(map[&'ĉ'], b'\t');
        assert_eq!(map[&'Ā'], 0);
        assert_eq!(map[&'{'], b'{');
        assert_eq!(map[&'é'], 0xE9);
        assert_eq!(map[&'ł'], 0xA0);
        assert_eq!(map[&'Ń'], 0xAD);
        let mut bytes: Vec<u8> = map.values().copied().collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
    }

    #[test]
    fn response_format_shapes() {
        assert_eq!(
            ResponseFormat::from_openai(&json!({"type": "text"})).unwrap(),
            ResponseFormat::Text
        );
        assert_eq!(
            ResponseFormat::from_openai(&json!({"type": "json_object"})).unwrap(),
            ResponseFormat::JsonObject
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let parsed = ResponseFormat::from_openai(&json!({"type": "json_schema",
            "json_schema": {"name": "my-schema_1", "description": "d", "schema": schema, "strict": true}}))
        .unwrap();
        assert_eq!(
            parsed,
            ResponseFormat::JsonSchema {
                name: "my-schema_1".into(),
                schema,
                strict: Some(true)
            }
        );
    }

    #[test]
    fn response_format_errors_name_the_field() {
        let cases = [
            (json!("json"), "response_format"),
            (json!({}), "response_format.type"),
            (json!({"type": 1}), "response_format.type"),
            (json!({"type": "xml"}), "response_format.type"),
            (json!({"type": "text", "extra": 1}), "response_format.extra"),
            (
                json!({"type": "json_object", "json_schema": {}}),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": []}),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a"}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}),
                "response_format.json_schema.strict",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "stric": true}}),
                "response_format.json_schema.stric",
            ),
        ];
        for (value, field) in cases {
            let err = ResponseFormat::from_openai(&value).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
            match &err {
                GrammarError::ResponseFormat { field: got, .. } => {
                    assert_eq!(got, field, "{value}: {err}")
                }
                other => panic!("{value}: {other}"),
            }
            assert!(err.to_string().contains(field), "{err}");
        }
    }

    const FLEXIBLE_OPEN: JsonOptions = JsonOptions {
        additional_properties: true,
        whitespace: JsonWhitespace::Flexible,
    };

    #[test]
    fn whitespace_options_only_when_the_schema_sets_none() {
        let compact = JsonOptions::default().apply(json!({"type": "object"}));
        assert_eq!(compact["x-guidance"], json!({"whitespace_flexible": false}));
        let flexible = FLEXIBLE_OPEN.apply(json!({"type": "object"}));
        assert_eq!(
            flexible["x-guidance"]["whitespace_pattern"],
            FLEXIBLE_WHITESPACE_PATTERN
        );
        let own = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        assert_eq!(FLEXIBLE_OPEN.apply(own.clone()), own);
        assert_eq!(JsonOptions::default().apply(own.clone()), own);
    }

    /// Where `additionalProperties: false` goes by default, and where it does not.
    #[test]
    fn objects_that_stand_alone_are_closed() {
        let item = json!({"type": "object", "properties": {"id": {"type": "integer"}}});
        let schema = json!({
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": item},
                "pair": {"type": "array", "prefixItems": [item, item]},
                "either": {"anyOf": [item, {"type": "null"}]},
                "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": true},
                "typed": {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
                "mixed": {"type": "object", "properties": {"kind": {}}, "oneOf": [item, item]},
                "merged": {"allOf": [item, {"properties": {"b": {"type": "string"}}}]},
                "ref": {"$ref": "#/$defs/thing"},
                "literal": {"const": {"properties": {"x": 1}}},
                "negated": {"not": item},
            },
            "$defs": {"thing": item},
        });
        let closed = JsonOptions::default().apply(schema.clone());
        let p = &closed["properties"];
        let shut = json!(false);
        assert_eq!(closed["additionalProperties"], shut);
        assert_eq!(p["items"]["items"]["additionalProperties"], shut);
        assert_eq!(p["pair"]["prefixItems"][1]["additionalProperties"], shut);
        assert_eq!(p["either"]["anyOf"][0]["additionalProperties"], shut);
        assert_eq!(
            p["open"]["additionalProperties"],
            json!(true),
            "kept as given"
        );
        assert_eq!(
            p["typed"]["additionalProperties"],
            json!({"type": "integer"})
        );
        assert_eq!(closed["$defs"]["thing"]["additionalProperties"], shut);
        // Combined with other properties: JSON Schema's reading kept.
        assert!(p["mixed"].get("additionalProperties").is_none());
        assert!(p["mixed"]["oneOf"][0].get("additionalProperties").is_none());
        assert!(p["merged"]["allOf"][0]
            .get("additionalProperties")
            .is_none());
        assert!(p["merged"]["allOf"][1]
            .get("additionalProperties")
            .is_none());
        assert!(p["ref"].get("additionalProperties").is_none());
        // Values and negations are not schemas to close.
        assert_eq!(p["literal"], schema["properties"]["literal"]);
        assert_eq!(p["negated"], schema["properties"]["negated"]);
        // The flag leaves every object as JSON Schema reads it.
        let mut open = FLEXIBLE_OPEN.apply(schema.clone());
        open.as_object_mut().and_then(|o| o.remove("x-guidance"));
        assert_eq!(open, schema);
    }

    /// Walks `text`'s tokens (as the tokenizer splits it) through a fresh constraint of
    /// `grammar`: `Ok(complete)` when every token was allowed (`complete`: end-of-sequence
    /// allowed after the last), `Err(prefix)` with the text accepted before the refused token.
    fn walk(
        compiler: &GrammarCompiler,
        tokenizer: &Tokenizer,
        grammar: &OutputGrammar,
        text: &str,
    ) -> Result<bool, String> {
        let mut constraint = compiler.grammar_matcher(grammar).unwrap();
        let mut words = vec![0u32; compiler.mask_words()];
        let allowed = |words: &[u32], t: u32| words[t as usize / 32] >> (t % 32) & 1 == 1;
        let tokens = tokenizer.encode(text, false).unwrap();
        for (i, &token) in tokens.iter().enumerate() {
            constraint.fill_mask(&mut words);
            if !allowed(&words, token) {
                return Err(tokenizer.decode(&tokens[..i], false).unwrap());
            }
            constraint.accept(token).unwrap();
        }
        constraint.fill_mask(&mut words);
        Ok(allowed(&words, compiler.eos_token_id()))
    }

    fn default_model() -> (Tokenizer, GrammarCompiler) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/default-model");
        let tokenizer = Tokenizer::from_dir(&dir).unwrap();
        let compiler = GrammarCompiler::new(&tokenizer).unwrap();
        (tokenizer, compiler)
    }

    /// Issue 46: `{"ok": bool, "tags": [...]}` without `additionalProperties` let the default
    /// model write a third key until `max_tokens`. By default the object ends after its
    /// listed keys; `--schema-allow-additional-properties` restores JSON Schema's reading.
    #[test]
    fn a_schema_without_additional_properties_refuses_a_third_key() {
        let (tokenizer, compiler) = default_model();
        let format = ResponseFormat::JsonSchema {
            name: "answer".into(),
            schema: json!({"type": "object", "properties": {
                "ok": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["ok", "tags"]}),
            strict: None,
        };
        let strict = format.grammar().unwrap();
        let listed = r#"{"ok":true,"tags":["a"]}"#;
        let extra = r#"{"ok":true,"tags":["a"],"more":"and more"}"#;
        assert_eq!(walk(&compiler, &tokenizer, &strict, listed), Ok(true));
        let refused = walk(&compiler, &tokenizer, &strict, extra).unwrap_err();
        assert!(listed.starts_with(&refused), "refused after {refused:?}");

        let options = JsonOptions {
            additional_properties: true,
            ..JsonOptions::default()
        };
        let open = format.grammar_with(&options).unwrap();
        assert_eq!(walk(&compiler, &tokenizer, &open, listed), Ok(true));
        assert_eq!(walk(&compiler, &tokenizer, &open, extra), Ok(true));
    }

    /// Compact by default: no whitespace anywhere; flexible: a bounded run at each place.
    #[test]
    fn whitespace_is_compact_or_bounded() {
        let (tokenizer, compiler) = default_model();
        let format = ResponseFormat::JsonSchema {
            name: "answer".into(),
            schema: json!({"type": "object", "properties": {
                "ok": {"type": "boolean"}, "n": {"type": "integer"}}, "required": ["ok", "n"]}),
            strict: None,
        };
        let compact = format.grammar().unwrap();
        assert_eq!(
            walk(&compiler, &tokenizer, &compact, r#"{"ok":true,"n":1}"#),
            Ok(true)
        );
        for spaced in [r#"{"ok": true, "n": 1}"#, "{\"ok\":true,\n\"n\":1}", " {}"] {
            assert!(
                walk(&compiler, &tokenizer, &compact, spaced).is_err(),
                "{spaced:?}"
            );
        }
        let flexible = format
            .grammar_with(&JsonOptions {
                whitespace: JsonWhitespace::Flexible,
                ..JsonOptions::default()
            })
            .unwrap();
        let pretty = "{\n  \"ok\": true,\n  \"n\": 1\n}";
        assert_eq!(walk(&compiler, &tokenizer, &flexible, pretty), Ok(true));
        let indented = format!("{{\n{}\"ok\":true,\"n\":1}}", " ".repeat(12));
        assert_eq!(walk(&compiler, &tokenizer, &flexible, &indented), Ok(true));
        // A thirteenth space, a second newline: past the bound.
        let deeper = format!("{{\n{}\"ok\":true,\"n\":1}}", " ".repeat(13));
        assert!(walk(&compiler, &tokenizer, &flexible, &deeper).is_err());
        let blank = "{\n\n\"ok\":true,\"n\":1}";
        assert!(walk(&compiler, &tokenizer, &flexible, blank).is_err());
    }

    /// Sequences take the families in turn; a mask's lexer work is counted against its family,
    /// and a family that has spent its fuel is replaced (its sequences keep the old one).
    #[test]
    fn spent_lexer_families_are_renewed() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/default-model");
        let tokenizer = Tokenizer::from_dir(&dir).unwrap();
        let compiler = GrammarCompiler::new(&tokenizer).unwrap();
        let format = ResponseFormat::JsonObject;
        let new = || compiler.matcher(&format).unwrap().unwrap();
        let mut first = new();
        let mut words = vec![0u32; compiler.mask_words()];
        // `{` is forced (no lexer work); `{"` is where keys begin.
        for token in tokenizer.encode("{\"", false).unwrap() {
            first.fill_mask(&mut words);
            first.accept(token).unwrap();
        }
        first.fill_mask(&mut words);
        assert!(
            first.family.load(Ordering::Relaxed) > 0,
            "a cold lexer builds states"
        );
        let joins = |c: &Constraint| Arc::ptr_eq(&c.family, &first.family);
        let round: Vec<Constraint> = (0..lexer_families()).map(|_| new()).collect();
        assert_eq!(round.iter().filter(|c| joins(c)).count(), 1);
        first.family.store(FAMILY_LEXER_FUEL, Ordering::Relaxed);
        let round: Vec<Constraint> = (0..lexer_families()).map(|_| new()).collect();
        assert_eq!(round.iter().filter(|c| joins(c)).count(), 0);
        // The old family still serves `first`, the new ones their sequences, alike.
        let mut other = vec![0u32; compiler.mask_words()];
        for mut c in round {
            for token in tokenizer.encode("{\"", false).unwrap() {
                c.fill_mask(&mut other);
                c.accept(token).unwrap();
            }
            c.fill_mask(&mut other);
            assert_eq!(other, words);
        }
    }
}
