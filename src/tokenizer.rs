//! A model's tokenizer (`tokenizer.json`, run by the `tokenizers` crate) and chat template
//! (`tokenizer_config.json` or `chat_template.jinja`, rendered by `minijinja`).
//!
//! The goal is the token ids and prompt text that transformers produces for the same files, with
//! two deliberate differences, both about beginning/end-of-sequence tokens:
//! - transformers 5.24 ignores `add_bos_token`/`add_eos_token` in `tokenizer_config.json` when a
//!   `tokenizer.json` exists (`tokenization_utils_base.py` pops them) and lets the
//!   `tokenizer.json` post-processor decide alone. transformers 4 (and DeepSeek's intent) honours
//!   `add_bos_token: true`. Here the post-processor runs first, and when `add_bos_token` is true
//!   but the post-processor did not add the bos token, it is prepended; likewise `add_eos_token`
//!   appends eos. For DeepSeek's published tokenizers the post-processor already adds bos, so all
//!   three agree.
//! - nothing else (such as a bos at the start of the text itself) is deduplicated, as in
//!   transformers: text rendered by a chat template already starts with the bos token, so encode
//!   it with `add_special_tokens = false`.
//!
//! The chat template environment mirrors transformers' (`utils/chat_template_utils.py`):
//! `trim_blocks` and `lstrip_blocks`, loop controls, a `raise_exception(message)` function, a
//! `tojson` filter that writes JSON like Python's `json.dumps` (no HTML escaping), Python string
//! and dict methods (`.strip()`, `.split()`, `.items()`, ...) through minijinja-contrib's
//! pycompat, and `bos_token` / `eos_token` variables. `strftime_now` is not provided (no DeepSeek
//! template uses it).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Serde, Value};
use serde_json::Value as Json;
use tokenizers::models::ModelWrapper;

use crate::error::{Error, Result};

/// A model's tokenizer (`tokenizer.json`) and chat template (`tokenizer_config.json`).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The template, or why there is none (reported by `apply_chat_template`, so a model without
    /// a usable template can still encode and decode).
    chat_template: std::result::Result<String, String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    /// `add_bos_token` is set and the post-processor does not add bos itself.
    prepend_bos: bool,
    /// `add_eos_token` is set and the post-processor does not add eos itself.
    append_eos: bool,
    /// `clean_up_tokenization_spaces`, which transformers 5 ignores for BPE models.
    clean_up_spaces: bool,
    /// How a conversation becomes a prompt.
    encoding: ChatEncoding,
}

/// How a conversation becomes a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatEncoding {
    /// The model's Jinja chat template (or `--chat-template`'s).
    Template,
    /// DeepSeek-V4's encoder ([`crate::chat_v4`]): V4 is published with no template, so a
    /// `deepseek_v4` model is encoded this way unless a template is given explicitly.
    DeepseekV4,
}

/// One chat message, as a chat template sees it (transformers' message dicts).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool` (or whatever the template knows).
    pub role: String,
    /// The message text; `None` (the template's `none`) for an assistant turn that only
    /// called tools.
    pub content: Option<String>,
    /// An assistant turn's tool calls, in OpenAI's shape (`{"id", "type": "function",
    /// "function": {"name", "arguments"}}` with `arguments` a JSON string, which DeepSeek's
    /// templates paste verbatim). Absent from the template's view when `None`, so that
    /// `'tool_calls' in message` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Json>>,
    /// A tool message's `tool_call_id`: which call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant turn's reasoning (`reasoning_content`), which V4's encoder writes back in
    /// thinking mode beside tools; templates never see it.
    #[serde(skip)]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A plain text message.
    pub fn text(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_owned(),
            content: Some(content.to_owned()),
            tool_calls: None,
            tool_call_id: None,
            reasoning_content: None,
        }
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("has_chat_template", &self.chat_template.is_ok())
            .field("encoding", &self.encoding)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` (required) and `tokenizer_config.json` and `chat_template.jinja`
    /// (both optional) from a model directory; given a `.gguf` file, its own tokenizer
    /// ([`Tokenizer::from_gguf`]).
    ///
    /// Errors name the file that is missing, unreadable or malformed.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if crate::gguf::is_gguf(dir) && dir.is_file() {
            return Self::from_gguf(dir);
        }
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            return Err(Error::Tokenizer(format!(
                "{} not found (deepinfer needs the model's tokenizer.json)",
                tokenizer_path.display()
            )));
        }
        let bytes = std::fs::read(&tokenizer_path).map_err(|source| Error::Io {
            path: tokenizer_path.clone(),
            source,
        })?;
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            read_json(&config_path)?
        } else {
            Json::Object(Default::default())
        };
        let chat_template = chat_template(Some(dir), &config, &config_path)?;
        let mut tokenizer = Self::from_parts(
            &bytes,
            &tokenizer_path,
            &config,
            &config_path,
            chat_template,
        )?;
        if model_type(dir)?.as_deref() == Some("deepseek_v4") {
            tokenizer.encoding = ChatEncoding::DeepseekV4;
        }
        Ok(tokenizer)
    }

    /// The tokenizer a GGUF file carries (see [`crate::gguf::tokenizer`] for how it is
    /// rebuilt); errors name the file and the metadata key.
    pub fn from_gguf(path: &Path) -> Result<Self> {
        let gguf = crate::gguf::GgufFile::open(path)?;
        let (tokenizer, config) = gguf.hf_tokenizer()?;
        let chat_template = chat_template(None, &config, path)?;
        Self::from_parts(
            tokenizer.to_string().as_bytes(),
            path,
            &config,
            path,
            chat_template,
        )
    }

    /// A tokenizer from the text of a `tokenizer.json` and a parsed `tokenizer_config.json`
    /// (`tokenizer_path` and `config_path` name where they came from, for errors).
    fn from_parts(
        bytes: &[u8],
        tokenizer_path: &Path,
        config: &Json,
        config_path: &Path,
        chat_template: std::result::Result<String, String>,
    ) -> Result<Self> {
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", tokenizer_path.display())))?;
        // Never cut or pad a prompt behind the caller's back (transformers only applies
        // tokenizer.json's truncation/padding when a call asks for it); lengths are the
        // engine's to check.
        inner
            .with_truncation(None)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", tokenizer_path.display())))?;
        inner.with_padding(None);

        let token = |key: &str| special_token(config, key, config_path);
        let bos_token = token("bos_token")?;
        let eos_token = token("eos_token")?;
        let flag = |key: &str| config.get(key).and_then(Json::as_bool).unwrap_or(false);

        let bos_token_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let eos_token_id = eos_token.as_deref().and_then(|t| inner.token_to_id(t));
        // What the post-processor adds around a sequence, seen on an empty one.
        let probe = inner
            .encode("", true)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", tokenizer_path.display())))?;
        let probe = probe.get_ids();
        let prepend_bos = flag("add_bos_token")
            && bos_token_id.is_some()
            && probe.first().copied() != bos_token_id;
        let append_eos = flag("add_eos_token")
            && eos_token_id.is_some()
            && probe.last().copied() != eos_token_id;
        let clean_up_spaces = flag("clean_up_tokenization_spaces")
            && !matches!(inner.get_model(), ModelWrapper::BPE(_));

        Ok(Tokenizer {
            inner,
            chat_template,
            bos_token,
            eos_token,
            bos_token_id,
            eos_token_id,
            prepend_bos,
            append_eos,
            clean_up_spaces,
            encoding: ChatEncoding::Template,
        })
    }

    /// Token ids of `text`; with `add_special_tokens`, the bos/eos tokens the tokenizer adds
    /// (see the module docs).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("cannot encode text: {e}")))?;
        let ids = encoding.get_ids();
        let mut out = Vec::with_capacity(ids.len() + 2);
        if add_special_tokens && self.prepend_bos {
            out.extend(self.bos_token_id);
        }
        out.extend_from_slice(ids);
        if add_special_tokens && self.append_eos {
            out.extend(self.eos_token_id);
        }
        Ok(out)
    }

    /// The text of `ids`, optionally without special tokens; an id outside the vocabulary is an
    /// error.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(bad) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(Error::Tokenizer(format!(
                "cannot decode token id {bad}: not in the vocabulary of {} tokens",
                self.vocab_size()
            )));
        }
        let text = self
            .inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("cannot decode tokens: {e}")))?;
        Ok(if self.clean_up_spaces {
            clean_up_tokenization(&text)
        } else {
            text
        })
    }

    /// The bytes of one token, which may be part of a character (OpenAI's logprob `bytes`,
    /// from which a client rebuilds text whose characters span tokens). A byte-level BPE
    /// token's vocabulary string spells its bytes one character each (GPT-2's byte-to-unicode
    /// map); any other token (an added token, a non-byte-level tokenizer) is its decoded text.
    /// `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        let byte_level = matches!(
            self.inner.get_decoder(),
            Some(tokenizers::DecoderWrapper::ByteLevel(_))
        );
        if byte_level {
            if let Some(bytes) = piece.chars().map(byte_of_char).collect() {
                return Some(bytes);
            }
        }
        self.decode(&[id], false).ok().map(String::into_bytes)
    }

    /// The text of ids a model generated: an id the tokenizer does not have, which a model
    /// whose vocabulary is padded beyond its tokenizer's can sample (DeepSeek-V3's config says
    /// 129,280; random or briefly trained weights pick such ids often), has no text, as
    /// transformers decodes it, instead of failing the request. Ids a user sends still go
    /// through [`Tokenizer::decode`], which names the bad one.
    pub fn decode_generated(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if ids.iter().all(|&id| self.inner.id_to_token(id).is_some()) {
            return self.decode(ids, skip_special_tokens);
        }
        let known: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| self.inner.id_to_token(id).is_some())
            .collect();
        self.decode(&known, skip_special_tokens)
    }

    /// Number of token ids, including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Renders `messages` with the model's chat template; with `add_generation_prompt`, ends
    /// with the prompt for the assistant's reply.
    ///
    /// The result starts with the bos token when the template emits it (DeepSeek's do), so it
    /// should be encoded with `add_special_tokens = false`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Tokenizer::apply_chat_template`] with the request's tool definitions, which the
    /// template sees as `tools` (a list of `{"type": "function", "function": {...}}`, as
    /// transformers passes them); `None` leaves `tools` undefined.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        if self.encoding == ChatEncoding::DeepseekV4 {
            return crate::chat_v4::render(&crate::chat_v4::V4Chat {
                messages,
                tools,
                response_schema: None,
                calls_forced: false,
                thinking: None,
            });
        }
        let template = self
            .chat_template
            .as_ref()
            .map_err(|why| Error::Tokenizer(why.clone()))?;
        let env = template_env();
        let compiled = env
            .template_from_str(template)
            .map_err(|e| Error::Tokenizer(format!("chat template does not parse: {e:#}")))?;
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        ctx.insert("messages", Value::from(Serde(messages)));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        if let Some(tools) = tools {
            ctx.insert("tools", Value::from(Serde(tools)));
        }
        // Absent tokens stay undefined (rendering as ""), as in transformers.
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token", Value::from(eos.as_str()));
        }
        compiled
            .render(ctx)
            .map_err(|e| Error::Tokenizer(format!("chat template failed: {}", render_error(&e))))
    }

    /// The chat template's source, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref().ok()
    }

    /// Replaces the model's chat template (`serve --chat-template`: a model whose own template
    /// lacks something, such as a tool-call format). A template that does not parse is an
    /// error here rather than at the first request.
    pub fn set_chat_template(&mut self, template: String) -> Result<()> {
        template_env()
            .template_from_str(&template)
            .map_err(|e| Error::Tokenizer(format!("chat template does not parse: {e:#}")))?;
        self.chat_template = Ok(template);
        self.encoding = ChatEncoding::Template;
        Ok(())
    }

    /// How this tokenizer turns a conversation into a prompt.
    pub fn chat_encoding(&self) -> ChatEncoding {
        self.encoding
    }

    /// The end-of-sequence token's id: `tokenizer_config.json`'s `eos_token` looked up in the
    /// vocabulary.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
    }

    /// The beginning-of-sequence token's id: `tokenizer_config.json`'s `bos_token` looked up in
    /// the vocabulary.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// The wrapped `tokenizers` tokenizer, for code that needs the raw vocabulary (the
    /// structured-output grammar builds its token trie from each token's bytes, which
    /// `decode` cannot give for a token that is a fragment of a UTF-8 character).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// The byte a character of a byte-level BPE vocabulary stands for (GPT-2's map: printable
/// Latin-1 bytes stand for themselves, the other 68 bytes for U+0100 onward in order).
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let code = c as u32;
    if code < 256 {
        return printable(code).then_some(code as u8);
    }
    let shifted = (0..256u32)
        .filter(|&b| !printable(b))
        .nth((code - 256) as usize)?;
    Some(shifted as u8)
}

/// `config.json`'s `model_type` beside the tokenizer, if there is one.
fn model_type(dir: &Path) -> Result<Option<String>> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Ok(None);
    }
    Ok(read_json(&path)?
        .get("model_type")
        .and_then(Json::as_str)
        .map(str::to_owned))
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text)
        .map_err(|e| Error::Tokenizer(format!("{}: not valid JSON: {e}", path.display())))
}

/// A special token in `tokenizer_config.json`: a string, `{"content": ...}` (an `AddedToken`),
/// or `null`.
fn special_token(config: &Json, key: &str, path: &Path) -> Result<Option<String>> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(o)) => match o.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(Error::Tokenizer(format!(
                "{}: {key} has no string \"content\"",
                path.display()
            ))),
        },
        Some(other) => Err(Error::Tokenizer(format!(
            "{}: {key} must be a string or an object with \"content\", got {other}",
            path.display()
        ))),
    }
}

/// The chat template, or why there is none. Like transformers 5, `chat_template.jinja` takes
/// priority over `tokenizer_config.json`'s `chat_template`, which may be a string or a list of
/// `{"name", "template"}` of which the one named `default` is used. A GGUF file has no
/// directory (`dir` is `None`): its template is the config's.
fn chat_template(
    dir: Option<&Path>,
    config: &Json,
    config_path: &Path,
) -> Result<std::result::Result<String, String>> {
    let jinja_path: Option<PathBuf> = dir.map(|d| d.join("chat_template.jinja"));
    if let Some(jinja_path) = jinja_path.as_ref().filter(|p| p.is_file()) {
        let text = std::fs::read_to_string(jinja_path).map_err(|source| Error::Io {
            path: jinja_path.clone(),
            source,
        })?;
        return Ok(Ok(text));
    }
    let jinja_path =
        jinja_path.map_or_else(|| "chat_template.jinja".into(), |p| p.display().to_string());
    let bad = || {
        Error::Tokenizer(format!(
            "{}: chat_template must be a string or a list of {{\"name\", \"template\"}}",
            config_path.display()
        ))
    };
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(Err(format!(
            "the model has no chat template (neither {jinja_path} nor chat_template in {})",
            config_path.display()
        ))),
        Some(Json::String(s)) => Ok(Ok(s.clone())),
        Some(Json::Array(list)) => {
            for item in list {
                let name = item.get("name").and_then(Json::as_str).ok_or_else(bad)?;
                let template = item
                    .get("template")
                    .and_then(Json::as_str)
                    .ok_or_else(bad)?;
                if name == "default" {
                    return Ok(Ok(template.to_string()));
                }
            }
            Ok(Err(format!(
                "{} has several chat templates and none is named \"default\"",
                config_path.display()
            )))
        }
        Some(_) => Err(bad()),
    }
}

/// A minijinja environment configured like transformers' chat template sandbox.
fn template_env() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build();
    // The default delimiters always build; keep minijinja's defaults if that ever changes.
    if let Ok(syntax) = syntax {
        env.set_syntax(syntax);
    }
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                message,
            ))
        },
    );
    env.add_filter("tojson", tojson);
    env
}

/// A render error with minijinja's detail (which holds `raise_exception`'s message) and the
/// template line.
fn render_error(e: &minijinja::Error) -> String {
    let mut msg = match e.detail() {
        Some(detail) => detail.to_string(),
        None => e.to_string(),
    };
    if let Some(line) = e.line() {
        msg.push_str(&format!(" (template line {line})"));
    }
    msg
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, sort_keys=False)`,
/// without Jinja's HTML escaping.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let style = PyJson {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` layout: `", "` and `": "` separators (`","` between items when
/// indenting), Python's float spelling, maps in insertion order.
///
/// Written over minijinja's values rather than through `serde_json::Value`, whose maps would
/// sort the keys (serde_json's `preserve_order` feature is off).
struct PyJson {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn write(
        &self,
        v: &Value,
        depth: usize,
        out: &mut String,
    ) -> std::result::Result<(), minijinja::Error> {
        use minijinja::value::ValueKind;
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if v.is_integer() {
                    out.push_str(&v.to_string());
                } else {
                    out.push_str(&py_float(f64::try_from(v.clone())?));
                }
            }
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separator(i, depth + 1, out);
                    self.write(item, depth + 1, out)?;
                }
                self.close(depth, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort();
                }
                out.push('{');
                for (i, key) in keys.iter().enumerate() {
                    self.separator(i, depth + 1, out);
                    match key.as_str() {
                        Some(k) => self.string(k, out),
                        None => self.string(&key.to_string(), out),
                    }
                    out.push_str(": ");
                    self.write(&v.get_item(key)?, depth + 1, out)?;
                }
                self.close(depth, out);
                out.push('}');
            }
            other => {
                return Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!("tojson cannot write a value of kind {other}"),
                ))
            }
        }
        Ok(())
    }

    fn separator(&self, index: usize, depth: usize, out: &mut String) {
        match self.indent {
            None if index > 0 => out.push_str(", "),
            None => {}
            Some(width) => {
                if index > 0 {
                    out.push(',');
                }
                out.push('\n');
                out.push_str(&" ".repeat(width * depth));
            }
        }
    }

    fn close(&self, depth: usize, out: &mut String) {
        if let Some(width) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's `repr(float)`: shortest round-trip digits, positional for exponents in [-4, 16),
/// else `1e-07` / `1e+16`; `NaN` and `Infinity` as `json.dumps` writes them.
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = x.to_string();
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// transformers' `clean_up_tokenization`: drops the space before punctuation and contractions.
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    const BOS: &str = "<｜begin▁of▁sentence｜>";
    const EOS: &str = "<｜end▁of▁sentence｜>";

    /// DeepSeek-V3's chat template (tokenizer_config.json, without the R1 `<think>` parts).
    /// A chat template written for these tests in the style of DeepSeek's (system prompts first,
    /// joined by a blank line; role markers; reasoning stripped from earlier replies; a
    /// generation prompt). It exercises namespaces, loops, `in`, `.split()` and indexing.
    const DEEPSEEK_STYLE_TEMPLATE: &str = r#"{% set ns = namespace(system='', first=true) %}{% for m in messages %}{% if m['role'] == 'system' %}{% if ns.first %}{% set ns.system = m['content'] %}{% set ns.first = false %}{% else %}{% set ns.system = ns.system + '\n\n' + m['content'] %}{% endif %}{% endif %}{% endfor %}{{ bos_token }}{{ ns.system }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}{% elif m['role'] == 'assistant' %}{% set reply = m['content'] %}{% if '</think>' in reply %}{% set reply = reply.split('</think>')[-1] %}{% endif %}{{ '<｜Assistant｜>' + reply + eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"#;

    /// A Llama-2/Mistral-style template: `raise_exception`, `.strip()`, loop.index0, and
    /// trim_blocks/lstrip_blocks on a multi-line layout.
    const STRICT_TEMPLATE: &str = "{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
[INST] {{ message['content'].strip() }} [/INST]
    {% else %}
{{ message['content'].strip() + eos_token }}
    {% endif %}
{% endfor %}
";

    fn temp_dir(tag: &str) -> PathBuf {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "deepinfer-tokenizer-{}-{}-{tag}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A byte-level BPE `tokenizer.json` shaped like DeepSeek's: specials 0..3, the 256
    /// byte symbols, merges building a few words, a digit-splitting regex, and optionally a
    /// post-processor adding bos.
    fn tokenizer_json(bos_post_processor: bool) -> Json {
        let specials = [BOS, EOS, "<｜User｜>", "<｜Assistant｜>"];
        let mut vocab = serde_json::Map::new();
        for s in specials {
            vocab.insert(s.to_string(), json!(vocab.len()));
        }
        let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        alphabet.sort_unstable();
        for c in alphabet {
            vocab.insert(c.to_string(), json!(vocab.len()));
        }
        let mut merges = Vec::new();
        for word in ["hello", "Ġworld", "12", "123"] {
            let chars: Vec<String> = word.chars().map(String::from).collect();
            let mut left = chars[0].clone();
            for right in &chars[1..] {
                let merged = format!("{left}{right}");
                if !vocab.contains_key(&merged) {
                    merges.push(json!(format!("{left} {right}")));
                    vocab.insert(merged.clone(), json!(vocab.len()));
                }
                left = merged;
            }
        }
        let added: Vec<Json> = specials
            .iter()
            .enumerate()
            .map(|(id, s)| {
                json!({"id": id, "content": s, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let post_processor = if bos_post_processor {
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": BOS, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}}
            })
        } else {
            Json::Null
        };
        json!({
            "version": "1.0",
            // Both must be ignored, as transformers does unless a call asks for them.
            "truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
            "padding": {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": null,
                        "pad_id": 1, "pad_type_id": 0, "pad_token": EOS},
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
            ]},
            "post_processor": post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": false, "vocab": vocab, "merges": merges}
        })
    }

    /// A model directory with the test tokenizer and, when given, a tokenizer_config.json.
    fn model_dir(tag: &str, bos_post_processor: bool, config: Option<Json>) -> PathBuf {
        let dir = temp_dir(tag);
        std::fs::write(
            dir.join("tokenizer.json"),
            tokenizer_json(bos_post_processor).to_string(),
        )
        .unwrap();
        if let Some(config) = config {
            std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        }
        dir
    }

    fn deepseek_config() -> Json {
        json!({
            "add_bos_token": true,
            "add_eos_token": false,
            "bos_token": {"__type": "AddedToken", "content": BOS, "lstrip": false,
                          "normalized": true, "rstrip": false, "single_word": false},
            "eos_token": EOS,
            "clean_up_tokenization_spaces": false,
            "tokenizer_class": "LlamaTokenizerFast",
            "chat_template": DEEPSEEK_STYLE_TEMPLATE
        })
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::text(role, content)
    }

    #[test]
    fn encode_decode_round_trip() {
        let dir = model_dir("roundtrip", true, Some(deepseek_config()));
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(tok.vocab_size(), 4 + 256 + 4 + 5 + 1 + 1);
        assert_eq!(tok.bos_token_id(), Some(0));
        assert_eq!(tok.eos_token_id(), Some(1));

        let plain = tok.encode("hello world", false).unwrap();
        let hello = tok.inner.token_to_id("hello").unwrap();
        let world = tok.inner.token_to_id("Ġworld").unwrap();
        assert_eq!(plain, vec![hello, world]);
        // The post-processor adds bos; add_bos_token must not add a second one.
        assert_eq!(
            tok.encode("hello world", true).unwrap(),
            vec![0, hello, world]
        );

        // \p{N}{1,3} (a fancy-regex pattern) splits digits in threes before the BPE.
        let digits = tok.encode("12345", false).unwrap();
        let t123 = tok.inner.token_to_id("123").unwrap();
        let t45 = vec![
            tok.inner.token_to_id("4").unwrap(),
            tok.inner.token_to_id("5").unwrap(),
        ];
        assert_eq!(digits, [vec![t123], t45].concat());

        for text in ["hello world", "héllo, 世界! \n\ttabs  ", "12345 hello", ""] {
            let ids = tok.encode(text, true).unwrap();
            assert_eq!(tok.decode(&ids, true).unwrap(), text);
            assert_eq!(tok.decode(&ids, false).unwrap(), format!("{BOS}{text}"));
        }
        // Special tokens in the text are recognized as such.
        let ids = tok.encode(&format!("{BOS}hello{EOS}"), false).unwrap();
        assert_eq!(ids, vec![0, hello, 1]);
        assert_eq!(tok.decode(&ids, true).unwrap(), "hello");

        let err = tok
            .decode(&[hello, 100_000], false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("100000"), "{err}");
        assert_eq!(
            tok.decode_generated(&[hello, 100_000], false).unwrap(),
            "hello"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bos_added_when_post_processor_does_not() {
        let dir = model_dir("nopp", false, Some(deepseek_config()));
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let hello = tok.inner.token_to_id("hello").unwrap();
        assert_eq!(tok.encode("hello", true).unwrap(), vec![0, hello]);
        assert_eq!(tok.encode("hello", false).unwrap(), vec![hello]);

        // add_eos_token appends eos; add_bos_token false adds nothing the post-processor does not.
        let mut config = deepseek_config();
        config["add_bos_token"] = json!(false);
        config["add_eos_token"] = json!(true);
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(tok.encode("hello", true).unwrap(), vec![hello, 1]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn deepseek_style_chat_template() {
        let dir = model_dir("v3template", true, Some(deepseek_config()));
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let messages = [
            msg("system", "You are helpful."),
            msg("user", "Hi"),
            msg("assistant", "<think>hmm</think>Hello!"),
            msg("user", "2+2?"),
        ];
        let with = tok.apply_chat_template(&messages, true).unwrap();
        assert_eq!(
            with,
            format!("{BOS}You are helpful.<｜User｜>Hi<｜Assistant｜>Hello!{EOS}<｜User｜>2+2?<｜Assistant｜>")
        );
        let without = tok.apply_chat_template(&messages, false).unwrap();
        assert_eq!(without, with.trim_end_matches("<｜Assistant｜>"));

        // Two system prompts are joined by a blank line.
        let two = [msg("system", "A"), msg("system", "B"), msg("user", "x")];
        assert_eq!(
            tok.apply_chat_template(&two, true).unwrap(),
            format!("{BOS}A\n\nB<｜User｜>x<｜Assistant｜>")
        );

        // The rendered prompt carries its own bos: encode without special tokens.
        let ids = tok.encode(&with, false).unwrap();
        assert_eq!(ids.iter().filter(|&&id| id == 0).count(), 1);
        assert_eq!(ids[0], 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn raise_exception_strip_and_whitespace_control() {
        let mut config = deepseek_config();
        config["chat_template"] = json!(STRICT_TEMPLATE);
        let dir = model_dir("strict", true, Some(config));
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let ok = tok
            .apply_chat_template(&[msg("user", "  hi  "), msg("assistant", " yo\n")], false)
            .unwrap();
        // As Jinja2 renders it: trim_blocks eats the newline after `%}`, not after `}}`.
        assert_eq!(ok, format!("{BOS}\n[INST] hi [/INST]\nyo{EOS}\n"));

        let err = tok
            .apply_chat_template(&[msg("user", "a"), msg("user", "b")], true)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("tokenizer: chat template failed: Conversation roles must alternate"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tojson_writes_like_python() {
        let mut config = deepseek_config();
        config["chat_template"] = json!(
            "{{ messages[0]|tojson }}|{{ {'b': [1, 'x<y'], 'a': {}}|tojson(indent=2) }}|{{ 'é'|tojson(ensure_ascii=true) }}|{{ [1.0, 2.5, 1e-7, 1e16, 123456789012345678]|tojson }}"
        );
        let dir = model_dir("tojson", true, Some(config));
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let out = tok
            .apply_chat_template(&[msg("user", "a \"q\" <b>\n")], false)
            .unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": \"a \\\"q\\\" <b>\\n\"}|{\n  \"b\": [\n    1,\n    \"x<y\"\n  ],\n  \"a\": {}\n}|\"\\u00e9\"|[1.0, 2.5, 1e-07, 1e+16, 123456789012345678]"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn template_sources() {
        // chat_template.jinja wins over tokenizer_config.json.
        let dir = model_dir("jinja", true, Some(deepseek_config()));
        std::fs::write(dir.join("chat_template.jinja"), "J{{ messages|length }}").unwrap();
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(
            tok.apply_chat_template(&[msg("user", "x")], true).unwrap(),
            "J1"
        );
        std::fs::remove_dir_all(&dir).unwrap();

        // A list of named templates: the default one.
        let mut config = deepseek_config();
        config["chat_template"] = json!([
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D{{ eos_token }}"}
        ]);
        let dir = model_dir("list", true, Some(config));
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(
            tok.apply_chat_template(&[], false).unwrap(),
            format!("D{EOS}")
        );
        std::fs::remove_dir_all(&dir).unwrap();

        // No template: encode works, the template call explains.
        let mut config = deepseek_config();
        config.as_object_mut().unwrap().remove("chat_template");
        let dir = model_dir("none", true, Some(config));
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert!(tok.encode("hello", true).is_ok());
        let err = tok.apply_chat_template(&[], true).unwrap_err().to_string();
        assert!(err.contains("no chat template"), "{err}");

        // A template that does not parse names the problem at use.
        std::fs::write(dir.join("chat_template.jinja"), "{% if %}").unwrap();
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let err = tok.apply_chat_template(&[], true).unwrap_err().to_string();
        assert!(err.contains("does not parse"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_and_malformed_files() {
        let dir = temp_dir("missing");
        let err = Tokenizer::from_dir(&dir).unwrap_err().to_string();
        assert!(
            err.contains(&dir.join("tokenizer.json").display().to_string()),
            "{err}"
        );

        std::fs::write(dir.join("tokenizer.json"), "{\"model\": 3}").unwrap();
        let err = Tokenizer::from_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");

        // tokenizer_config.json is optional...
        std::fs::write(
            dir.join("tokenizer.json"),
            tokenizer_json(false).to_string(),
        )
        .unwrap();
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(tok.bos_token_id(), None);
        assert_eq!(tok.eos_token_id(), None);
        let hello = tok.inner.token_to_id("hello").unwrap();
        assert_eq!(tok.encode("hello", true).unwrap(), vec![hello]);

        // ...but must be valid when present.
        std::fs::write(dir.join("tokenizer_config.json"), "{\"bos_token\": ").unwrap();
        let err = Tokenizer::from_dir(&dir).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("line 1"),
            "{err}"
        );
        std::fs::write(dir.join("tokenizer_config.json"), "{\"eos_token\": 5}").unwrap();
        let err = Tokenizer::from_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("eos_token"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
