//! Incremental detokenization against the tokenizer's decode of the whole sequence: the pieces
//! streamed token by token add up to exactly that text, and no piece splits a character.

mod common;

use std::sync::Arc;

use deepinfer::engine::detokenize::IncrementalDecoder;
use deepinfer::tokenizer::Tokenizer;

fn check(tok: &Arc<Tokenizer>, prompt: &str, generated: &str) {
    let prompt_ids = tok.encode(prompt, true).unwrap();
    let ids = tok.encode(generated, false).unwrap();
    let mut d = IncrementalDecoder::new(tok.clone(), &prompt_ids, true);
    let mut pieces = Vec::new();
    for &t in &ids {
        pieces.push(d.push(t).unwrap());
    }
    pieces.push(d.flush().unwrap());
    for p in &pieces {
        assert!(
            !p.contains('\u{FFFD}'),
            "a piece split a character: {pieces:?}"
        );
    }
    assert_eq!(
        pieces.concat(),
        tok.decode(&ids, true).unwrap(),
        "{pieces:?}"
    );
}

/// Every fixture that ships a tokenizer, one per distinct `tokenizer.json` (`tiny-v2-group`
/// holds the same file as `tiny-v3` and `tiny-v2-lite`). Each must be there: a missing
/// tokenizer fails the test instead of shrinking it.
const TOKENIZER_FIXTURES: &[&str] = &["default-model", "tiny-v3", "tiny-v2-lite"];

#[test]
fn pieces_add_up_to_the_whole_decode_on_every_fixture_tokenizer() {
    for name in TOKENIZER_FIXTURES {
        let dir = common::fixture_dir(name);
        assert!(
            dir.join("tokenizer.json").is_file(),
            "fixture {name} lacks tokenizer.json (scripts/make_fixtures.py, train_tiny.py)"
        );
        let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
        check(
            &tok,
            "ROMEO:",
            " But soft, what light through yonder window breaks?",
        );
        // Multi-byte characters, which byte-level tokens split.
        check(
            &tok,
            "Café:",
            " naïve façade — 日本語の文字、🙂 emoji, Ωμέγα.",
        );
        check(&tok, "", "\n\n  leading spaces and\ttabs  ");
    }
}

#[test]
fn an_incomplete_character_is_held_until_it_completes() {
    let dir = common::fixture_dir("default-model");
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let ids = tok.encode("🙂", false).unwrap();
    assert!(
        ids.len() > 1,
        "the emoji is one token here: nothing to test"
    );
    let mut d = IncrementalDecoder::new(tok.clone(), &[], true);
    let pieces: Vec<String> = ids.iter().map(|&t| d.push(t).unwrap()).collect();
    assert!(
        pieces[..ids.len() - 1].iter().all(|p| p.is_empty()),
        "{pieces:?}"
    );
    assert_eq!(pieces[ids.len() - 1], "🙂");
}
