//! A GGUF file's tokenizer (`tokenizer.ggml.*`) rebuilt as the HF `tokenizer.json` and
//! `tokenizer_config.json` it was converted from, for [`crate::tokenizer::Tokenizer`] to load.
//!
//! DeepSeek models use byte-level BPE (`tokenizer.ggml.model = "gpt2"`): the file keeps the
//! vocabulary in its byte-level spelling, the merges, and which tokens are added (control
//! tokens are HF's special added tokens, user-defined ones its other added tokens). What it
//! does not keep is the pre-tokenizer: only its name (`tokenizer.ggml.pre`), which llama.cpp
//! maps to a list of split regexes (`llama-vocab.cpp`). The names of DeepSeek's tokenizers and
//! GPT-2's are rebuilt here with those regexes, each an isolated `Split` before a byte-level
//! step, the shape of DeepSeek's own `tokenizer.json`; any other name is an error that says so.

use serde_json::{json, Map, Value};

use super::GgufFile;
use crate::error::{Error, Result};

/// gguf-py's `TokenType` values that mark added tokens.
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// DeepSeek LLM / V2's split regexes (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM`, from the
/// `pre_tokenizer` of DeepSeek-V2's `tokenizer.json`).
const DEEPSEEK_LLM: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
];

/// DeepSeek-V3 / R1's split regexes (`LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM`).
const DEEPSEEK_V3: &[&str] = &[
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

/// The pre-tokenizer names rebuilt here.
const KNOWN_PRE: &str = "gpt-2, deepseek-llm, deepseek-v3";

impl GgufFile {
    /// The `tokenizer.json` and `tokenizer_config.json` the file's tokenizer metadata stands for.
    pub fn hf_tokenizer(&self) -> Result<(Value, Value)> {
        let m = self.metadata();
        let path = self.path().display();
        let model = m.str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(Error::Gguf(format!(
                "{path}: tokenizer.ggml.model is `{model}`; deepinfer rebuilds byte-level BPE \
                 tokenizers (`gpt2`), which DeepSeek models use"
            )));
        }
        let pre = m.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
        let byte_level = |use_regex: bool| {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                   "use_regex": use_regex})
        };
        let pre_tokenizer = match pre {
            "gpt-2" => byte_level(true),
            "deepseek-llm" | "deepseek-v3" => {
                let regexes = if pre == "deepseek-llm" {
                    DEEPSEEK_LLM
                } else {
                    DEEPSEEK_V3
                };
                let mut steps: Vec<Value> = regexes
                    .iter()
                    .map(|r| {
                        json!({"type": "Split", "pattern": {"Regex": r},
                               "behavior": "Isolated", "invert": false})
                    })
                    .collect();
                steps.push(byte_level(false));
                json!({"type": "Sequence", "pretokenizers": steps})
            }
            other => {
                return Err(Error::Gguf(format!(
                    "{path}: tokenizer.ggml.pre is `{other}`, a pre-tokenizer deepinfer does not \
                     rebuild (it knows {KNOWN_PRE}); run the HF checkpoint directory instead"
                )))
            }
        };

        let tokens = m.strings("tokenizer.ggml.tokens")?;
        let merges = m.strings("tokenizer.ggml.merges")?;
        let types = m.opt_ints("tokenizer.ggml.token_type")?;
        if let Some(types) = &types {
            if types.len() != tokens.len() {
                return Err(Error::Gguf(format!(
                    "{path}: tokenizer.ggml.token_type has {} entries for {} tokens",
                    types.len(),
                    tokens.len()
                )));
            }
        }
        let vocab: Map<String, Value> = tokens
            .iter()
            .enumerate()
            .map(|(id, t)| (t.to_string(), json!(id)))
            .collect();
        let merges: Vec<Value> = merges
            .iter()
            .map(|pair| match pair.split_once(' ') {
                Some((a, b)) => Ok(json!([a, b])),
                None => Err(Error::Gguf(format!(
                    "{path}: tokenizer.ggml.merges has `{pair}`, not two tokens separated by a \
                     space"
                ))),
            })
            .collect::<Result<_>>()?;
        let added: Vec<Value> = types
            .iter()
            .flatten()
            .enumerate()
            .filter(|&(_, &t)| t == CONTROL || t == USER_DEFINED)
            .map(|(id, &t)| {
                json!({"id": id, "content": tokens[id], "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": t != CONTROL, "special": t == CONTROL})
            })
            .collect();
        let tokenizer = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": byte_level(true),
            "decoder": byte_level(true),
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges},
        });

        let mut config = Map::new();
        let token_of = |key: &str| -> Result<Option<Value>> {
            let Some(id) = m.opt_usize(key)? else {
                return Ok(None);
            };
            match tokens.get(id) {
                Some(t) => Ok(Some(json!(t))),
                None => Err(Error::Gguf(format!(
                    "{path}: {key} is {id}, outside the {} tokens",
                    tokens.len()
                ))),
            }
        };
        for (hf, key) in [
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id"),
        ] {
            if let Some(t) = token_of(key)? {
                config.insert(hf.into(), t);
            }
        }
        for (hf, key) in [
            ("add_bos_token", "tokenizer.ggml.add_bos_token"),
            ("add_eos_token", "tokenizer.ggml.add_eos_token"),
        ] {
            if let Some(b) = m.opt_bool(key)? {
                config.insert(hf.into(), json!(b));
            }
        }
        if let Some(template) = m.opt_str("tokenizer.chat_template")? {
            config.insert("chat_template".into(), json!(template));
        }
        Ok((tokenizer, Value::Object(config)))
    }
}
