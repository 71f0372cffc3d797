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

// Stop strings, against a reference that searches the whole text after every piece: the
// matcher must release exactly the text before the earliest stop string, hold back exactly the
// longest tail that could still begin one, and never more.

use deepinfer::engine::detokenize::StopStrings;

/// What the matcher must have released after `text` (no stop string in it): all of it but the
/// longest tail that is a proper prefix of a stop string.
fn releasable<'a>(text: &'a str, stops: &[String]) -> &'a str {
    let hold = stops
        .iter()
        .flat_map(|s| {
            (1..s.len().min(text.len() + 1))
                .filter(|&n| s.is_char_boundary(n) && text.ends_with(&s[..n]))
                .max()
        })
        .max()
        .unwrap_or(0);
    &text[..text.len() - hold]
}

/// Feeds `pieces` and checks every push against the reference; returns the released text and
/// whether a stop string ended it.
fn check_stops(stops: &[String], pieces: &[String]) -> (String, bool) {
    let mut m = StopStrings::new(stops);
    let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    let mut text = String::new();
    let mut released = String::new();
    for p in pieces {
        text.push_str(p);
        let c = m.push(p);
        released.push_str(&c.text);
        let first = stops.iter().filter_map(|s| text.find(s.as_str())).min();
        match first {
            Some(at) => {
                assert!(c.stopped, "no stop reported in {text:?} (stops {stops:?})");
                assert_eq!(released, text[..at], "stops {stops:?}");
                return (released, true);
            }
            None => {
                assert!(!c.stopped, "a stop reported in {text:?} (stops {stops:?})");
                assert_eq!(released, releasable(&text, &stops), "stops {stops:?}");
                assert!(text.len() - released.len() < longest.max(1));
            }
        }
    }
    released.push_str(&m.flush());
    assert_eq!(released, text);
    (released, false)
}

/// A small deterministic generator (xorshift), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }

    /// A string of `len` characters over a small alphabet (multi-byte ones included), so
    /// that partial and overlapping matches are frequent.
    fn text(&mut self, len: usize) -> String {
        const ALPHABET: [char; 4] = ['a', 'b', 'é', '🙂'];
        (0..len).map(|_| ALPHABET[self.below(4)]).collect()
    }

    /// `text` cut into pieces of 0 to 5 characters.
    fn pieces(&mut self, text: &str) -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let n = self.below(6).min(chars.len() - i);
            out.push(chars[i..i + n].iter().collect());
            i += n;
        }
        out
    }
}

#[test]
fn stop_strings_match_a_whole_text_search_on_random_text() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut stopped = 0;
    for _ in 0..3000 {
        let stops: Vec<String> = (0..1 + rng.below(4))
            .map(|_| {
                let n = rng.below(7);
                rng.text(n)
            })
            .collect();
        let n = rng.below(40);
        let text = rng.text(n);
        let pieces = rng.pieces(&text);
        stopped += usize::from(check_stops(&stops, &pieces).1);
    }
    // Both outcomes were exercised many times.
    assert!((300..2700).contains(&stopped), "{stopped} of 3000 stopped");
}

#[test]
fn long_stop_strings_hold_back_at_most_their_length_and_cut_exactly() {
    let sentence = "The quick brown fox jumps over the lazy dog while five wizards box. ";
    let boilerplate: String = sentence.repeat(20).chars().take(1000).collect();
    let stops: Vec<String> = (0..4)
        .map(|i| format!("{}<#{i}>", &boilerplate[..996]))
        .collect();
    let pieces = |text: &str| -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        chars.chunks(3).map(|c| c.iter().collect()).collect()
    };
    // The text keeps starting the stop strings and turning away 900 characters in.
    let near_miss = format!("{}, or not. ", &boilerplate[..900]).repeat(5);
    let (out, stopped) = check_stops(&stops, &pieces(&near_miss));
    assert!(!stopped);
    assert_eq!(out, near_miss);
    // Then one of them whole, after some text: everything before it is released.
    let hit = format!("{near_miss}{}<#2> and after", &boilerplate[..996]);
    let (out, stopped) = check_stops(&stops, &pieces(&hit));
    assert!(stopped);
    assert_eq!(out, near_miss);
    // A stop string inside a longer one that starts earlier: the shorter one completes first,
    // and the text stops there, as it would have token by token.
    let stops = vec![
        boilerplate[..500].to_string(),
        boilerplate[100..300].to_string(),
    ];
    let (out, stopped) = check_stops(&stops, &pieces(&format!("xy{boilerplate}")));
    assert!(stopped);
    // The boilerplate repeats a sentence, so the shorter one first occurs a sentence earlier.
    let at = boilerplate.find(&stops[1]).unwrap();
    assert!(at < 100);
    assert_eq!(out, format!("xy{}", &boilerplate[..at]));
}

/// The cost the issue measured (milliseconds per token with long stop strings) came from
/// re-searching the held text and trying every prefix of every stop string on each push,
/// quadratic in a stop string's length. Four stop strings of 16,000 characters over 8,000
/// tokens that twice run 15,900 characters into them: incremental matching takes milliseconds
/// here; the quadratic search took about 3 s on the development machine (opt-level 1). The
/// bound is 6x under that and some 100x over this.
#[test]
fn long_stop_strings_cost_little_per_token() {
    let sentence = "The quick brown fox jumps over the lazy dog while five wizards box. ";
    let boilerplate: String = sentence.repeat(400).chars().take(16_000).collect();
    let stops: Vec<String> = (0..4)
        .map(|i| format!("{}<#{i}>", &boilerplate[..15_996]))
        .collect();
    let text = format!("{}, or not. ", &boilerplate[..15_900]);
    let chars: Vec<char> = text.chars().cycle().take(8000 * 4).collect();
    let pieces: Vec<String> = chars.chunks(4).map(|c| c.iter().collect()).collect();
    let start = std::time::Instant::now();
    let mut m = StopStrings::new(&stops);
    let mut out = String::new();
    for p in &pieces {
        let c = m.push(p);
        assert!(!c.stopped);
        out.push_str(&c.text);
    }
    let elapsed = start.elapsed();
    out.push_str(&m.flush());
    assert_eq!(out, pieces.concat());
    assert!(
        elapsed < std::time::Duration::from_millis(500),
        "{elapsed:?} for 8000 tokens"
    );
}
