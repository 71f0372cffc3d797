//! `config.json` parsing: the published and transformers 5 spellings, every default, and every
//! rejection, each error checked for the key and the value it names.
//!
//! The whole configs are fixtures (`fixtures/configs/`); each test edits one or a few keys.
//! `accepted` checks what a config resolves to, `rejected` what its errors say.

use serde_json::Value;

use super::*;
use crate::error::Result;

mod accepted;
mod rejected;

/// deepseek-ai/DeepSeek-V2-Lite `config.json`, as published (remote-code spelling).
const V2_LITE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/configs/deepseek-v2-lite.json"
));

/// deepseek-ai/DeepSeek-V3 `config.json`, as published (FP8 weights, one MTP layer).
const V3: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/configs/deepseek-v3.json"
));

/// A tiny V3 written by transformers 5.24's `DeepseekV3Config.save_pretrained`: no
/// `scoring_func`/`topk_method`, RoPE under `rope_parameters`.
const HF5_TINY_V3: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/configs/transformers5-tiny-v3.json"
));

/// A tiny V2 written by transformers 5.24's `DeepseekV2Config.save_pretrained`.
const HF5_TINY_V2: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/fixtures/configs/transformers5-tiny-v2.json"
));

/// `base` with `edits` applied: `Some(v)` sets a (possibly dotted) key, `None` removes it.
fn edited(base: &str, edits: &[(&str, Option<Value>)]) -> String {
    let mut v: Value = serde_json::from_str(base).unwrap();
    for (path, new) in edits {
        let mut target = &mut v;
        let parts: Vec<&str> = path.split('.').collect();
        for part in &parts[..parts.len() - 1] {
            target = target.get_mut(*part).unwrap();
        }
        let obj = target.as_object_mut().unwrap();
        let last = parts[parts.len() - 1];
        match new {
            Some(x) => {
                obj.insert(last.to_string(), x.clone());
            }
            None => {
                obj.remove(last);
            }
        }
    }
    v.to_string()
}

fn parse_edited(base: &str, edits: &[(&str, Option<Value>)]) -> Result<ModelConfig> {
    ModelConfig::from_json_str(&edited(base, edits))
}

/// The error message for `base` with `edits`; panics if it parses.
fn error(base: &str, edits: &[(&str, Option<Value>)]) -> String {
    match parse_edited(base, edits) {
        Ok(c) => panic!("expected an error for {edits:?}, parsed {c:?}"),
        Err(e) => e.to_string(),
    }
}

/// Asserts that `msg` is a config error mentioning every one of `needles`.
fn assert_mentions(msg: &str, needles: &[&str]) {
    for n in needles {
        assert!(msg.contains(n), "{msg:?} does not mention {n:?}");
    }
    assert!(msg.starts_with("config.json: "), "{msg:?}");
}
