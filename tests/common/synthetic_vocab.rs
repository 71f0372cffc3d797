//! A synthetic byte-level BPE vocabulary of any size (DeepSeek V3's is 129,280), for the
//! structured-output tests and benchmarks: the fixtures' tokenizers are small, and a grammar's
//! cost per mask grows with the vocabulary's trie. Shared by `tests/grammar.rs` and
//! `benches/host_work.rs` (each includes this file by path).
#![allow(dead_code)]

use std::collections::HashSet;
use std::path::Path;

use deepinfer::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// A tiny LCG (Knuth's MMIX constants); the high bits are the usable ones.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// GPT-2's byte-to-unicode table (the test's own copy): the vocabulary string of a byte.
fn byte_char(byte: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(byte) {
        return char::from(byte);
    }
    let rank = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(0x100 + rank).unwrap()
}

/// A byte-level BPE tokenizer with `size` tokens, DeepSeek V3's vocabulary size, made of
/// word-like pieces (letters in syllables with and without a leading space, digit groups,
/// punctuation runs, CJK characters), so its trie has a realistic shape. No merges: encoding
/// gives single bytes, which is all the grammar needs of it.
pub fn synthetic_tokenizer(dir: &Path, size: usize) -> Tokenizer {
    let specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"];
    let mut vocab = serde_json::Map::new();
    let mut seen = HashSet::new();
    let mut push = |piece: String, vocab: &mut serde_json::Map<String, Value>| {
        if seen.insert(piece.clone()) {
            let id = vocab.len();
            vocab.insert(piece, json!(id));
        }
    };
    for s in specials {
        push(s.to_string(), &mut vocab);
    }
    for b in 0..=255u8 {
        push(byte_char(b).to_string(), &mut vocab);
    }
    let mut rng = Lcg(7);
    let consonants = b"bcdfghjklmnprstvwxyzBCDFGHLMPRST";
    let vowels = b"aeiouy";
    let punct = b".,;:!?\"'(){}[]-_/\\<>=+*&%$#@";
    while vocab.len() < size {
        let mut bytes = Vec::new();
        match rng.below(20) {
            0 => {
                for _ in 0..1 + rng.below(3) {
                    bytes.push(b'0' + rng.below(10) as u8);
                }
            }
            1 | 2 => {
                if rng.below(2) == 0 {
                    bytes.push(b' ');
                }
                for _ in 0..1 + rng.below(3) {
                    bytes.push(punct[rng.below(punct.len())]);
                }
            }
            3 => {
                let c = char::from_u32(0x4E00 + rng.below(0x5000) as u32).unwrap();
                bytes.extend_from_slice(c.to_string().as_bytes());
            }
            _ => {
                if rng.below(10) < 6 {
                    bytes.push(b' ');
                }
                for _ in 0..1 + rng.below(4) {
                    bytes.push(consonants[rng.below(consonants.len())]);
                    bytes.push(vowels[rng.below(vowels.len())]);
                    if rng.below(3) == 0 {
                        bytes.push(consonants[rng.below(consonants.len())]);
                    }
                }
            }
        }
        push(bytes.into_iter().map(byte_char).collect(), &mut vocab);
    }
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(id, s)| {
            json!({"id": id, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"bos_token": specials[0], "eos_token": specials[1]}).to_string(),
    )
    .unwrap();
    Tokenizer::from_dir(dir).unwrap()
}
