//! Reads `include/nrt_deepinfer.h`, the header the committed bindings are generated from, so
//! the tests can hold the crate's hand-written tables (status codes, enum constants, the
//! symbol lists) against it instead of against copies of themselves.
//!
//! The header is plain C written by this project: comments, `typedef enum { A = 0, ... } T;`
//! and `typedef __typeof__(f) *f_fn;`. This reader knows just that much and panics on
//! anything else, so a header it cannot read fails the tests instead of emptying them.
#![allow(dead_code)]

use std::path::PathBuf;

/// The header's text without comments, every run of whitespace collapsed to one space.
pub fn text() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("include/nrt_deepinfer.h");
    let raw = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    strip_comments(&raw)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn strip_comments(c: &str) -> String {
    let mut out = String::with_capacity(c.len());
    let mut rest = c;
    while let Some(slash) = rest.find('/') {
        out.push_str(&rest[..slash]);
        let from = &rest[slash..];
        if let Some(body) = from.strip_prefix("/*") {
            let end = body.find("*/").expect("an unterminated /* comment");
            out.push(' ');
            rest = &body[end + 2..];
        } else if from.starts_with("//") {
            rest = from.find('\n').map_or("", |n| &from[n..]);
        } else {
            out.push('/');
            rest = &from[1..];
        }
    }
    out.push_str(rest);
    out
}

/// The enumerators of `typedef enum [tag] { ... } <name>;`, in declaration order, each with
/// its explicit value (every enumerator in the header has one).
pub fn enum_values(name: &str) -> Vec<(String, u32)> {
    let text = text();
    let close = format!("}} {name};");
    let end = text
        .find(&close)
        .unwrap_or_else(|| panic!("the header declares no `typedef enum {{ ... }} {name};`"));
    let open = text[..end].rfind('{').expect("an opening brace");
    assert!(
        text[..open]
            .trim_end()
            .rsplit("typedef")
            .next()
            .is_some_and(|head| head.trim_start().starts_with("enum")),
        "`{name}` is not a typedef'd enum"
    );
    let values: Vec<(String, u32)> = text[open + 1..end]
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|entry| {
            let (ident, value) = entry
                .split_once('=')
                .unwrap_or_else(|| panic!("{name}: `{entry}` has no explicit value"));
            (ident.trim().to_string(), parse_int(value.trim()))
        })
        .collect();
    assert!(!values.is_empty(), "{name} has no enumerators");
    values
}

/// Every function the header derives a dlsym pointer type for
/// (`typedef __typeof__(f) *f_fn;`), in declaration order.
pub fn functions_with_pointer_types() -> Vec<String> {
    let text = text();
    let names: Vec<String> = text
        .split("typedef __typeof__(")
        .skip(1)
        .map(|rest| {
            let (name, tail) = rest.split_once(')').expect("a closing parenthesis");
            let expected = format!(" *{name}_fn;");
            assert!(
                tail.starts_with(&expected),
                "`typedef __typeof__({name})` is not followed by `{expected}`"
            );
            name.to_string()
        })
        .collect();
    assert!(
        !names.is_empty(),
        "the header derives no function-pointer types"
    );
    names
}

fn parse_int(v: &str) -> u32 {
    let parsed = match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => v.parse(),
    };
    parsed.unwrap_or_else(|e| panic!("`{v}` is not an integer: {e}"))
}
