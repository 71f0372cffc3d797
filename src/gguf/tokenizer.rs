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
/// `pre_tokenizer` of DeepSeek-V2's `tokenizer.json`). Non-ASCII characters are escaped: the
/// classes hold characters (`U+1FD3`, `U+212A`, ...) that Unicode normalization of the source
/// text would turn into others and break the ranges.
const DEEPSEEK_LLM: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
    "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+",
    "\\s+$",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}+",
];

/// DeepSeek-V3 / R1's split regexes (`LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM`).
const DEEPSEEK_V3: &[&str] = &[
    "\\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::quantized::gguf_file::{self, Value as GgufValue};
    use tokenizers::PreTokenizer;

    use super::*;

    /// A metadata-only GGUF with a byte-level vocabulary (the 256 byte symbols, no merges) and
    /// pre-tokenizer `pre`, rebuilt into a `tokenizers` tokenizer.
    fn rebuilt(pre: &str) -> tokenizers::Tokenizer {
        let symbols: Vec<GgufValue> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
            .into_iter()
            .map(|c| GgufValue::String(c.to_string()))
            .collect();
        let metadata: HashMap<&str, GgufValue> = HashMap::from([
            (
                "general.architecture",
                GgufValue::String("deepseek2".into()),
            ),
            ("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
            ("tokenizer.ggml.pre", GgufValue::String(pre.into())),
            ("tokenizer.ggml.tokens", GgufValue::Array(symbols)),
            ("tokenizer.ggml.merges", GgufValue::Array(Vec::new())),
        ]);
        let dir = std::env::temp_dir().join(format!("deepinfer-gguf-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{pre}.gguf"));
        let mut file = std::fs::File::create(&path).unwrap();
        let kv: Vec<(&str, &GgufValue)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
        gguf_file::write(&mut file, &kv, &[]).unwrap();
        let (json, _) = GgufFile::open(&path).unwrap().hf_tokenizer().unwrap();
        tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap()
    }

    fn pieces(tok: &tokenizers::Tokenizer, text: &str) -> Vec<String> {
        let mut s = tokenizers::PreTokenizedString::from(text);
        tok.get_pre_tokenizer()
            .unwrap()
            .pre_tokenize(&mut s)
            .unwrap();
        s.get_splits(
            tokenizers::OffsetReferential::Original,
            tokenizers::OffsetType::Char,
        )
        .into_iter()
        .map(|(piece, _, _)| piece.to_string())
        .collect()
    }

    /// DeepSeek-V3's published pre-tokenizer splits digits in threes and CJK runs apart from
    /// Latin words (its tokenizer.json's first two `Split`s), then byte-level maps each piece.
    #[test]
    fn deepseek_v3_pre_tokenizer_splits_as_published() {
        let tok = rebuilt("deepseek-v3");
        assert_eq!(
            pieces(&tok, "12345 東京abc"),
            ["123", "45", "Ġ", "æĿ±äº¬", "abc"]
        );
        // Every byte is a token of this vocabulary, so any text encodes and decodes back.
        let text = "Hello, 世界 2026!";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }

    #[test]
    fn deepseek_llm_and_gpt2_pre_tokenizers_build() {
        let tok = rebuilt("deepseek-llm");
        assert_eq!(pieces(&tok, "ab 12"), ["ab", "Ġ", "12"]);
        let tok = rebuilt("gpt-2");
        assert_eq!(pieces(&tok, "ab 12"), ["ab", "Ġ12"]);
    }
}
