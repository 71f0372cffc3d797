//! Structured outputs (`src/engine/grammar.rs`): from a `response_format` to per-step token
//! masks, checked against independent references.
//!
//! - Walks: documents tokenized by our tokenizer are fed token by token; every token must be
//!   allowed by the mask before it, and EOS only after the last one. Whether each document is
//!   valid comes from reasoning about the schema and is cross-checked with Python's
//!   `jsonschema` (see [`CASES`]).
//! - Random walks: tokens drawn from the masks must end in a document that serde_json parses
//!   and that has the schema's required keys and types (checked by hand below).
//! - Errors: invalid and unsupported schemas name the problem.
//! - The random walks also run on a synthetic 129k-token vocabulary (DeepSeek V3's size); the
//!   time per mask is printed with `--nocapture` for orientation, and measured properly in
//!   `benches/host_work.rs`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use deepinfer::engine::grammar::{
    Constraint, GrammarCacheStats, GrammarCompiler, GrammarError, JsonOptions, JsonWhitespace,
    ResponseFormat,
};
use deepinfer::error::ErrorKind;
use deepinfer::tokenizer::Tokenizer;
use serde_json::{json, Value};

#[path = "common/synthetic_vocab.rs"]
mod synthetic_vocab;
use synthetic_vocab::{synthetic_tokenizer, Lcg};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn load(name: &str) -> (Tokenizer, GrammarCompiler) {
    let tokenizer = Tokenizer::from_dir(&fixture(name)).unwrap();
    let compiler = GrammarCompiler::new(&tokenizer).unwrap();
    (tokenizer, compiler)
}

fn schema_format(schema: &Value) -> ResponseFormat {
    ResponseFormat::from_openai(&json!({
        "type": "json_schema",
        "json_schema": {"name": "test", "schema": schema, "strict": true}
    }))
    .unwrap()
}

fn allowed(words: &[u32], token: u32) -> bool {
    words[token as usize / 32] >> (token % 32) & 1 == 1
}

fn allowed_tokens(words: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    for (w, &word) in words.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            out.push(w as u32 * 32 + bits.trailing_zeros());
            bits &= bits - 1;
        }
    }
    out
}

/// Documents for the walks, with the validity each must have.
///
/// Validity was worked out by hand from the schemas, then cross-checked with Python's
/// `jsonschema` 4.26 (Draft 2020-12), which agrees on all 36 documents:
///
/// ```text
/// python3 -m venv /tmp/jsvenv && /tmp/jsvenv/bin/pip install jsonschema
/// /tmp/jsvenv/bin/python - <<'EOF'
/// import json, re, jsonschema
/// src = open("tests/grammar.rs").read()
/// cases = json.loads(re.search(r'const CASES: &str = r##"(\[.*?)"##', src, re.S).group(1))
/// n = 0
/// for case in cases:
///     v = jsonschema.Draft202012Validator(case["schema"])
///     for want, docs in ((True, case["valid"]), (False, case["invalid"])):
///         for doc in docs:
///             assert v.is_valid(doc) == want, (case["name"], doc)
///             n += 1
/// print("agree", n)
/// EOF
/// ```
///
/// Property order follows the schema's in every document: llguidance generates properties in
/// schema order (a documented departure from JSON Schema, where order is free).
/// `json_object` is the schema `{"type": "object"}`.
const CASES: &str = r##"[
  {
    "name": "person",
    "schema": {
      "type": "object",
      "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {
          "type": "object",
          "properties": {
            "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
          },
          "required": ["city"],
          "additionalProperties": false
        },
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
      },
      "required": ["name", "age", "role"],
      "additionalProperties": false
    },
    "valid": [
      {"name": "Ada", "age": 36, "role": "admin"},
      {"name": "Bob", "age": 0, "role": "guest", "tags": ["x", "y z"],
       "address": {"city": "Paris", "zip": "75001"}, "score": 0.5},
      {"name": "Émile \"E\"\n", "age": 150, "role": "user", "tags": [], "score": 1},
      {"name": "", "age": 7, "role": "user", "address": {"city": "Oslo"}}
    ],
    "invalid": [
      {"name": "Ada", "role": "admin"},
      {"name": "Ada", "age": 151, "role": "admin"},
      {"name": "Ada", "age": -1, "role": "admin"},
      {"name": "Ada", "age": 3.5, "role": "admin"},
      {"name": "Ada", "age": 36, "role": "owner"},
      {"name": "Ada", "age": 36, "role": "admin", "email": "a@b.c"},
      {"name": "Ada", "age": 36, "role": "admin", "tags": ["a", "b", "c", "d"]},
      {"name": "Ada", "age": 36, "role": "admin", "address": {"city": "Rome", "zip": "7500"}},
      {"name": "Ada", "age": 36, "role": "admin", "address": {"zip": "75001"}},
      {"name": "Ada", "age": 36, "role": "admin", "score": 0},
      {"name": "Ada", "age": 36, "role": "admin", "score": 1.5},
      {"name": 5, "age": 36, "role": "admin"}
    ]
  },
  {
    "name": "items",
    "schema": {
      "type": "array",
      "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"]
      },
      "minItems": 1
    },
    "valid": [
      [{"id": 1, "ok": true}],
      [{"id": -20, "ok": false}, {"id": 300, "ok": true, "note": null}]
    ],
    "invalid": [
      [],
      [{"id": 1.5, "ok": true}],
      [{"id": 1}],
      [{"id": 1, "ok": "yes"}],
      {"id": 1, "ok": true}
    ]
  },
  {
    "name": "line",
    "schema": {
      "$defs": {
        "point": {
          "type": "object",
          "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
          "required": ["x", "y"],
          "additionalProperties": false
        }
      },
      "type": "object",
      "properties": {
        "kind": {"const": "line"},
        "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 2, "maxItems": 2},
        "label": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]}
      },
      "required": ["kind", "points"],
      "additionalProperties": false
    },
    "valid": [
      {"kind": "line", "points": [{"x": 0, "y": 1.5}, {"x": -300.25, "y": 4}]},
      {"kind": "line", "points": [{"x": 1, "y": 2}, {"x": 3, "y": 4}], "label": null},
      {"kind": "line", "points": [{"x": 1, "y": 2}, {"x": 3, "y": 4}], "label": "ab"}
    ],
    "invalid": [
      {"kind": "circle", "points": [{"x": 0, "y": 1}, {"x": 1, "y": 2}]},
      {"kind": "line", "points": [{"x": 0, "y": 1}]},
      {"kind": "line", "points": [{"x": 0, "y": 1}, {"x": 1, "y": 2}, {"x": 2, "y": 3}]},
      {"kind": "line", "points": [{"x": 0}, {"x": 1, "y": 2}]},
      {"kind": "line", "points": [{"x": 0, "y": 1}, {"x": 1, "y": 2}], "label": "abcde"}
    ]
  },
  {
    "name": "json_object",
    "schema": {"type": "object"},
    "valid": [
      {},
      {"a": [1, 2.5, {"b": null}], "c": "d", "e": {"f": [true, false]}}
    ],
    "invalid": [
      [1],
      "text",
      3
    ]
  }
]"##;

/// JSON Schema's own reading, which Python's `jsonschema` checks the walks' documents against:
/// objects open to other keys where the schema does not close them, and whitespace allowed
/// (bounded) so pretty-printed documents walk too. The server's defaults (closed objects,
/// compact JSON) are checked by the unit tests in `src/engine/grammar.rs`.
const JSON_SCHEMA_READING: JsonOptions = JsonOptions {
    additional_properties: true,
    whitespace: JsonWhitespace::Flexible,
};

/// Why a walk stopped early: the step and the disallowed token (EOS at the end counts).
#[derive(Debug)]
struct Refused {
    step: usize,
    token: u32,
}

/// Feeds `text`'s tokens through a fresh constraint; checks EOS is allowed exactly at the end
/// (and alone once the document is complete). Returns the first refused token.
fn walk(
    tokenizer: &Tokenizer,
    compiler: &GrammarCompiler,
    format: &ResponseFormat,
    text: &str,
) -> Result<(), Refused> {
    let eos = compiler.eos_token_id();
    let mut constraint = compiler
        .matcher_with(format, &JSON_SCHEMA_READING)
        .unwrap()
        .unwrap();
    let mut words = vec![0u32; compiler.mask_words()];
    let tokens = tokenizer.encode(text, false).unwrap();
    for (step, &token) in tokens.iter().enumerate() {
        constraint.fill_mask(&mut words);
        assert!(
            !allowed_tokens(&words).is_empty(),
            "empty mask at step {step}"
        );
        assert!(
            !allowed(&words, eos),
            "EOS allowed before the end of {text:?} (step {step})"
        );
        if !allowed(&words, token) {
            return Err(Refused { step, token });
        }
        constraint.accept(token).unwrap();
    }
    constraint.fill_mask(&mut words);
    if !allowed(&words, eos) {
        return Err(Refused {
            step: tokens.len(),
            token: eos,
        });
    }
    // A complete object or array: nothing may follow but EOS.
    assert_eq!(allowed_tokens(&words), vec![eos], "after {text:?}");
    assert!(constraint.is_finished(), "{text:?}");
    constraint.accept(eos).unwrap();
    Ok(())
}

#[test]
fn documents_walk_as_jsonschema_says() {
    let cases: Value = serde_json::from_str(CASES).unwrap();
    for fixture_name in ["default-model", "tiny-v3"] {
        let (tokenizer, compiler) = load(fixture_name);
        for case in cases.as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            let format = if name == "json_object" {
                ResponseFormat::JsonObject
            } else {
                schema_format(&case["schema"])
            };
            for (want_valid, docs) in [(true, &case["valid"]), (false, &case["invalid"])] {
                for doc in docs.as_array().unwrap() {
                    // Compact and pretty-printed: whitespace between tokens is allowed.
                    for text in [
                        serde_json::to_string(doc).unwrap(),
                        serde_json::to_string_pretty(doc).unwrap(),
                    ] {
                        let got = walk(&tokenizer, &compiler, &format, &text);
                        match (want_valid, got) {
                            (true, Ok(())) | (false, Err(_)) => {}
                            (true, Err(refused)) => {
                                let at = tokenizer.decode(&[refused.token], false).unwrap();
                                panic!(
                                    "{fixture_name}/{name}: valid {text:?} refused at step {} \
                                     (token {} {at:?})",
                                    refused.step, refused.token
                                )
                            }
                            (false, Ok(())) => {
                                panic!("{fixture_name}/{name}: invalid {text:?} accepted")
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn refused_token_is_an_error_and_the_mask_then_ends_the_sequence() {
    let (tokenizer, compiler) = load("default-model");
    let format = schema_format(
        &json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    );
    let mut constraint = compiler.matcher(&format).unwrap().unwrap();
    let mut words = vec![0u32; compiler.mask_words()];
    constraint.fill_mask(&mut words);
    let bad = tokenizer.encode("x", false).unwrap()[0];
    assert!(!allowed(&words, bad));
    let err = constraint.accept(bad).unwrap_err();
    assert!(
        matches!(err, GrammarError::Rejected { token, .. } if token == bad),
        "{err}"
    );
    assert_eq!(err.kind(), ErrorKind::Internal);
    assert!(constraint.error().is_some());
    assert!(!constraint.is_finished());
    constraint.fill_mask(&mut words);
    assert_eq!(allowed_tokens(&words), vec![compiler.eos_token_id()]);
}

#[test]
fn mask_layout_and_rollback() {
    let (tokenizer, compiler) = load("tiny-v3");
    assert_eq!(compiler.vocab_size(), tokenizer.vocab_size());
    assert_eq!(compiler.mask_words(), tokenizer.vocab_size().div_ceil(32));
    let mut constraint = compiler
        .matcher(&ResponseFormat::JsonObject)
        .unwrap()
        .unwrap();
    // A wider buffer (a model vocabulary larger than the tokenizer's): the extra words are 0.
    let mut wide = vec![u32::MAX; compiler.mask_words() + 3];
    constraint.fill_mask(&mut wide);
    assert!(wide[compiler.mask_words()..].iter().all(|&w| w == 0));
    assert!(allowed_tokens(&wide)
        .iter()
        .all(|&t| (t as usize) < compiler.vocab_size()));
    // Special tokens are never allowed mid-document.
    assert!(!allowed(&wide, tokenizer.bos_token_id().unwrap()));

    let tokens = tokenizer.encode("{\"ab\": [1, 2]}", false).unwrap();
    constraint.accept(tokens[0]).unwrap();
    let mut after_one = vec![0u32; compiler.mask_words()];
    constraint.fill_mask(&mut after_one);
    for &t in &tokens[1..3] {
        constraint.accept(t).unwrap();
    }
    constraint.rollback(2).unwrap();
    let mut again = vec![0u32; compiler.mask_words()];
    constraint.fill_mask(&mut again);
    assert_eq!(after_one, again);
    assert!(constraint.rollback(5).is_err());
}

#[test]
fn a_top_level_number_ends_at_eos() {
    let (tokenizer, compiler) = load("tiny-v3");
    let eos = compiler.eos_token_id();
    let format = schema_format(&json!({"type": "integer", "maximum": 500}));
    let mut constraint = compiler.matcher(&format).unwrap().unwrap();
    let mut words = vec![0u32; compiler.mask_words()];
    for token in tokenizer.encode("12", false).unwrap() {
        constraint.fill_mask(&mut words);
        assert!(allowed(&words, token));
        constraint.accept(token).unwrap();
    }
    // "12" is complete, but "123" would be too: EOS is allowed next to more digits.
    constraint.fill_mask(&mut words);
    let three = tokenizer.encode("3", false).unwrap()[0];
    assert!(allowed(&words, eos) && allowed(&words, three));
    assert!(!constraint.is_finished());
    constraint.accept(eos).unwrap();
    assert!(constraint.is_finished());
    constraint.fill_mask(&mut words);
    assert_eq!(allowed_tokens(&words), vec![eos]);
}

#[test]
#[should_panic(expected = "grammar mask needs")]
fn short_mask_buffer_panics() {
    let (_, compiler) = load("tiny-v3");
    let mut constraint = compiler
        .matcher(&ResponseFormat::JsonObject)
        .unwrap()
        .unwrap();
    let mut words = vec![0u32; compiler.mask_words() - 1];
    constraint.fill_mask(&mut words);
}

#[test]
fn text_has_no_constraint_and_types_are_shareable() {
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<Constraint>();
    send_sync::<GrammarCompiler>();
    let (_, compiler) = load("tiny-v3");
    assert!(compiler.matcher(&ResponseFormat::Text).unwrap().is_none());
}

/// Draws tokens from the masks until only EOS is allowed (at most `max_steps`), half the time
/// from the allowed tokens that close something (`"`, `]`, `}`), so strings and containers end
/// within the budget. Returns the text and the mean and longest `fill_mask` call.
fn random_walk(
    tokenizer: &Tokenizer,
    compiler: &GrammarCompiler,
    format: &ResponseFormat,
    seed: u64,
    max_steps: usize,
    piece: &[String],
) -> (String, Duration, Duration) {
    let eos = compiler.eos_token_id();
    let mut rng = Lcg(seed);
    let mut constraint = compiler.matcher(format).unwrap().unwrap();
    let mut words = vec![0u32; compiler.mask_words()];
    let mut generated = Vec::new();
    let mut mask_time = Duration::ZERO;
    let mut longest = Duration::ZERO;
    let mut masks = 0u32;
    for _ in 0..=max_steps {
        let start = Instant::now();
        constraint.fill_mask(&mut words);
        let took = start.elapsed();
        mask_time += took;
        longest = longest.max(took);
        masks += 1;
        let choices = allowed_tokens(&words);
        assert!(!choices.is_empty(), "empty mask after {generated:?}");
        if choices == [eos] {
            assert!(constraint.is_finished());
            let text = tokenizer.decode(&generated, true).unwrap();
            return (text, mask_time / masks, longest);
        }
        let closers: Vec<u32> = choices
            .iter()
            .copied()
            .filter(|&t| t != eos && piece[t as usize].contains(['"', ']', '}']))
            .collect();
        let token = if !closers.is_empty() && rng.below(2) == 0 {
            closers[rng.below(closers.len())]
        } else {
            choices[rng.below(choices.len())]
        };
        if token == eos {
            // EOS next to other tokens: the document is complete (e.g. after a number).
            let text = tokenizer.decode(&generated, true).unwrap();
            return (text, mask_time / masks, longest);
        }
        constraint.accept(token).unwrap();
        generated.push(token);
    }
    panic!(
        "seed {seed}: not finished after {max_steps} tokens: {:?}",
        tokenizer.decode(&generated, false).unwrap()
    );
}

fn token_pieces(tokenizer: &Tokenizer) -> Vec<String> {
    (0..tokenizer.vocab_size() as u32)
        .map(|t| tokenizer.decode(&[t], false).unwrap_or_default())
        .collect()
}

fn is_int_in(value: &Value, lo: i64, hi: i64) -> bool {
    value.as_i64().is_some_and(|v| (lo..=hi).contains(&v))
}

/// A walk schema: its name, the format, and a hand-written check of what serde_json parsed.
type WalkSchema = (&'static str, ResponseFormat, fn(&Value) -> bool);

/// The walk schemas.
fn walk_schemas() -> Vec<WalkSchema> {
    vec![
        (
            "person",
            schema_format(&json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    "role": {"enum": ["admin", "user", "guest"]},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}
                },
                "required": ["name", "age", "role"],
                "additionalProperties": false
            })),
            |v| {
                let o = v.as_object().unwrap();
                o["name"].as_str().is_some_and(|s| s.chars().count() <= 12)
                    && is_int_in(&o["age"], 0, 150)
                    && ["admin", "user", "guest"].contains(&o["role"].as_str().unwrap_or(""))
                    && o.get("tags").is_none_or(|t| {
                        t.as_array().is_some_and(|a| {
                            a.len() <= 3
                                && a.iter()
                                    .all(|s| s.as_str().is_some_and(|s| s.chars().count() <= 6))
                        })
                    })
                    && o.keys()
                        .all(|k| ["name", "age", "role", "tags"].contains(&k.as_str()))
            },
        ),
        (
            "items",
            schema_format(&json!({
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                    "required": ["id", "ok"],
                    "additionalProperties": false
                },
                "minItems": 1,
                "maxItems": 4
            })),
            |v| {
                let a = v.as_array().unwrap();
                (1..=4).contains(&a.len())
                    && a.iter().all(|o| {
                        let o = o.as_object().unwrap();
                        // An unbounded integer may pass i64 (serde_json reads it as an f64).
                        let integer = |v: &Value| {
                            v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0)
                        };
                        o.len() == 2 && integer(&o["id"]) && o["ok"].is_boolean()
                    })
            },
        ),
        (
            "line",
            schema_format(&json!({
                "type": "object",
                "properties": {
                    "kind": {"const": "line"},
                    "points": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number"}},
                            "required": ["x", "y"],
                            "additionalProperties": false
                        },
                        "minItems": 2, "maxItems": 2
                    },
                    "closed": {"type": "boolean"}
                },
                "required": ["kind", "points", "closed"],
                "additionalProperties": false
            })),
            |v| {
                let o = v.as_object().unwrap();
                o["kind"] == "line"
                    && o["closed"].is_boolean()
                    && o["points"].as_array().is_some_and(|p| {
                        p.len() == 2
                            && p.iter().all(|pt| {
                                pt.as_object().unwrap().len() == 2
                                    && pt["x"]
                                        .as_f64()
                                        .is_some_and(|x| (-10.0..=10.0).contains(&x))
                                    && pt["y"].is_number()
                            })
                    })
            },
        ),
        ("json_object", ResponseFormat::JsonObject, |v| v.is_object()),
    ]
}

#[test]
fn random_walks_end_in_valid_documents() {
    for fixture_name in ["default-model", "tiny-v3"] {
        let (tokenizer, compiler) = load(fixture_name);
        let pieces = token_pieces(&tokenizer);
        let mut total = Duration::ZERO;
        let mut walks = 0u32;
        for (name, format, check) in walk_schemas() {
            for seed in 1..=4u64 {
                let (text, per_mask, _) =
                    random_walk(&tokenizer, &compiler, &format, seed, 1000, &pieces);
                let value: Value = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{fixture_name}/{name}/{seed}: {text:?}: {e}"));
                assert!(check(&value), "{fixture_name}/{name}/{seed}: {text}");
                total += per_mask;
                walks += 1;
            }
        }
        eprintln!(
            "{fixture_name}: vocabulary {}, {:.1} µs per mask (mean over random walks)",
            compiler.vocab_size(),
            (total / walks).as_secs_f64() * 1e6
        );
    }
}

#[test]
fn schema_errors_name_the_problem() {
    let (_, compiler) = load("tiny-v3");
    let cases = [
        // Invalid schemas.
        (json!({"type": "frobnicate"}), "frobnicate"),
        (
            json!({"type": "integer", "minimum": 5, "maximum": 1}),
            "minimum",
        ),
        (json!({"$ref": "#/$defs/missing"}), "missing"),
        // Unsupported features.
        (
            json!({"type": "string", "format": "credit-card"}),
            "credit-card",
        ),
        (json!({"type": "string", "pattern": "^(?=a)a$"}), "look"),
        (
            json!({"$ref": "https://example.com/schema.json"}),
            "example.com",
        ),
        (json!({"type": "array", "uniqueItems": true}), "uniqueItems"),
        (json!({"not": {"type": "string"}}), "not"),
        (
            json!({"if": {"type": "object"}, "then": {"required": ["a"]}}),
            "if",
        ),
        (
            json!({"oneOf": [{"type": "integer"}, {"type": "number"}]}),
            "oneOf",
        ),
        // Open to other keys (explicitly: by default an object is closed, and llguidance
        // supports minProperties 1 over optional keys of a closed object).
        (
            json!({"type": "object", "properties": {"a": {}}, "minProperties": 1,
                   "additionalProperties": true}),
            "maxProperties",
        ),
    ];
    for (schema, needle) in cases {
        let err = compiler.matcher(&schema_format(&schema)).unwrap_err();
        assert!(matches!(err, GrammarError::Schema(_)), "{schema}: {err}");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        let message = err.to_string();
        assert!(
            message.to_lowercase().contains(&needle.to_lowercase()),
            "{schema}: `{needle}` not in {message}"
        );
    }
}

/// A schema is compiled once: its later constraints are cache hits, told by the compiler's
/// counters (a timing would depend on the machine's load; the times are only printed). Another
/// schema is compiled rather than served the first one's grammar, free text compiles nothing,
/// and an invalid schema, never cached, is compiled again each time it is sent.
#[test]
fn compiled_grammars_are_cached() {
    let (_, compiler) = load("default-model");
    let mut schemas = walk_schemas().into_iter().map(|(_, format, _)| format);
    let (format, other) = (schemas.next().unwrap(), schemas.next().unwrap());
    let stats = |hits, compiles, cached| GrammarCacheStats {
        hits,
        compiles,
        cached,
    };
    assert_eq!(compiler.cache_stats(), stats(0, 0, 0));
    let start = Instant::now();
    drop(compiler.matcher(&format).unwrap());
    let first = start.elapsed();
    assert_eq!(
        compiler.cache_stats(),
        stats(0, 1, 1),
        "the first request compiles"
    );
    let start = Instant::now();
    let n = 20;
    for _ in 0..n {
        drop(compiler.matcher(&format).unwrap());
    }
    let cached = start.elapsed() / n;
    assert_eq!(
        compiler.cache_stats(),
        stats(u64::from(n), 1, 1),
        "every later request for the same schema is a hit"
    );
    drop(compiler.matcher(&other).unwrap());
    assert_eq!(compiler.cache_stats(), stats(u64::from(n), 2, 2));
    assert!(compiler.matcher(&ResponseFormat::Text).unwrap().is_none());
    assert_eq!(compiler.cache_stats(), stats(u64::from(n), 2, 2));
    let invalid = schema_format(&json!({"type": "array", "uniqueItems": true}));
    for compiles in [3, 4] {
        compiler.matcher(&invalid).unwrap_err();
        assert_eq!(compiler.cache_stats(), stats(u64::from(n), compiles, 2));
    }
    eprintln!(
        "compile {:.2} ms, cached copy {:.1} µs",
        first.as_secs_f64() * 1e3,
        cached.as_secs_f64() * 1e6
    );
}

#[test]
fn random_walks_on_a_deepseek_sized_vocabulary() {
    let dir = std::env::temp_dir().join(format!("deepinfer-grammar-{}", std::process::id()));
    let tokenizer = synthetic_tokenizer(&dir, 129_280);
    assert_eq!(tokenizer.vocab_size(), 129_280);
    let start = Instant::now();
    let compiler = GrammarCompiler::new(&tokenizer).unwrap();
    let setup = start.elapsed();
    let pieces = token_pieces(&tokenizer);
    eprintln!(
        "synthetic vocabulary {}: compiler built in {:.0} ms",
        compiler.vocab_size(),
        setup.as_secs_f64() * 1e3
    );
    let mut total = Duration::ZERO;
    let mut walks = 0u32;
    for (name, format, check) in walk_schemas() {
        for seed in 1..=3 {
            let (text, per_mask, longest) =
                random_walk(&tokenizer, &compiler, &format, seed, 1000, &pieces);
            let value: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {text:?}: {e}"));
            assert!(check(&value), "{name}: {text}");
            eprintln!(
                "  {name}/{seed}: {:.1} µs per mask, longest {:.0} µs",
                per_mask.as_secs_f64() * 1e6,
                longest.as_secs_f64() * 1e6
            );
            total += per_mask;
            walks += 1;
        }
    }
    let per_mask = total / walks;
    eprintln!("  mean {:.1} µs per mask", per_mask.as_secs_f64() * 1e6);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Sequences of one schema share a lexer family's DFA, and a step's rows are filled and
/// advanced together on several threads (`fill_masks`, `advance_all`). Every row's masks, over
/// whole documents of uniformly drawn tokens, must be exactly those of a constraint that
/// shares nothing (a second compiler, one row at a time). More sequences are made first than
/// the families serve before renewal, so renewed families are among those checked.
#[test]
fn rows_sharing_lexers_mask_as_rows_alone() {
    use deepinfer::engine::grammar::{advance_all, fill_masks, Advance, FAMILY_SEQUENCES};
    let (tokenizer, shared) = load("default-model");
    let (_, alone) = load("default-model");
    let schemas = walk_schemas();
    for (_, format, _) in &schemas {
        for _ in 0..=32 * FAMILY_SEQUENCES {
            drop(shared.matcher(format).unwrap());
        }
    }
    let pieces = token_pieces(&tokenizer);
    let eos = shared.eos_token_id();
    const ROWS: usize = 24;
    let schema_of = |row: usize| row % schemas.len();
    let mut rows: Vec<Constraint> = (0..ROWS)
        .map(|r| shared.matcher(&schemas[schema_of(r)].1).unwrap().unwrap())
        .collect();
    let mut masks = vec![vec![0u32; shared.mask_words()]; ROWS];
    let mut rngs: Vec<Lcg> = (0..ROWS as u64).map(|r| Lcg(r + 11)).collect();
    // Each row's document so far, and the masks it was given.
    let mut generated: Vec<Vec<u32>> = vec![Vec::new(); ROWS];
    let mut given: Vec<Vec<Vec<u32>>> = vec![Vec::new(); ROWS];
    let mut finished = 0;
    for _ in 0..400 {
        let mut step: Vec<_> = rows
            .iter_mut()
            .zip(masks.iter_mut())
            .map(|(c, m)| (c, m.as_mut_slice()))
            .collect();
        fill_masks(&mut step);
        let mut tokens = Vec::with_capacity(ROWS);
        for r in 0..ROWS {
            given[r].push(masks[r].clone());
            let choices = allowed_tokens(&masks[r]);
            assert!(!choices.is_empty(), "row {r}: empty mask");
            tokens.push(choices[rngs[r].below(choices.len())]);
        }
        let mut step: Vec<_> = rows.iter_mut().zip(tokens.iter().copied()).collect();
        let advanced = advance_all(&mut step);
        for r in 0..ROWS {
            let done = match &advanced[r] {
                Advance::Accepted if tokens[r] != eos => {
                    generated[r].push(tokens[r]);
                    false
                }
                Advance::Accepted | Advance::WasFinished => true,
                Advance::Refused(e) => panic!("row {r}: a token its mask allowed: {e}"),
            };
            if !done {
                continue;
            }
            // The row's document is complete: its masks must be those of a constraint alone.
            let (name, format, _) = &schemas[schema_of(r)];
            let mut reference = alone.matcher(format).unwrap().unwrap();
            let mut words = vec![0u32; alone.mask_words()];
            for (i, mask) in given[r].iter().enumerate() {
                reference.fill_mask(&mut words);
                assert!(
                    words == *mask,
                    "row {r} ({name}): mask {i} differs after {:?}",
                    &pieces_of(&pieces, &generated[r][..i])
                );
                if let Some(&token) = generated[r].get(i) {
                    reference.accept(token).unwrap();
                }
            }
            finished += 1;
            rows[r] = shared.matcher(format).unwrap().unwrap();
            generated[r].clear();
            given[r].clear();
        }
    }
    assert!(finished >= 2 * ROWS, "only {finished} documents finished");
}

fn pieces_of(pieces: &[String], tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|&t| pieces[t as usize].as_str())
        .collect()
}
