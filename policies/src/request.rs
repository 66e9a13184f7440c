//! Parse OpenAI-compatible request bodies into the features the scheduler needs.
//!
//! Handles `/v1/completions` (prompt as a string, a list of strings, token ids, or a list of
//! token-id lists), `/v1/chat/completions` (message content as a string or a list of parts)
//! and `/v1/responses` (`input` as a string or a list of items, plus `instructions`).

use serde::Deserialize;

use crate::chat_template::ChatMessage;
use crate::error::{body_error, check_object, ErrorShape, RequestError};

/// Which inference API the request targets, chosen by path suffix as llm-d's parser does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Completions,
    ChatCompletions,
    Responses,
    /// Anthropic's Messages API (`/v1/messages`), as vLLM serves it.
    Messages,
    /// `/v1/messages/count_tokens`: a Messages body, counted, not generated.
    CountTokens,
    /// vLLM's token-in, token-out `/inference/v1/generate`.
    Generate,
    /// `/tokenize`.
    Tokenize,
    /// `/detokenize`.
    Detokenize,
    /// The `render` and `derender` routes of chat, completions, Messages and Responses.
    Render,
}

impl Api {
    /// Select the API by path (query string ignored). Unknown paths give `None`; the caller
    /// passes them through without scheduling features.
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        if path.ends_with("/render") || path.ends_with("/derender") {
            Some(Api::Render)
        } else if path.ends_with("/chat/completions") {
            Some(Api::ChatCompletions)
        } else if path.ends_with("/completions") {
            Some(Api::Completions)
        } else if path.ends_with("/responses") {
            Some(Api::Responses)
        } else if path.ends_with("/messages/count_tokens") {
            Some(Api::CountTokens)
        } else if path.ends_with("/messages") {
            Some(Api::Messages)
        } else if path.ends_with("/inference/v1/generate") {
            Some(Api::Generate)
        } else if path == "/tokenize" {
            Some(Api::Tokenize)
        } else if path == "/detokenize" {
            Some(Api::Detokenize)
        } else {
            None
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::ChatCompletions => "chat_completions",
            Api::Responses => "responses",
            Api::Messages => "messages",
            Api::CountTokens => "count_tokens",
            Api::Generate => "generate",
            Api::Tokenize => "tokenize",
            Api::Detokenize => "detokenize",
            Api::Render => "render",
        }
    }

    /// Every API, in a fixed order (metrics define one counter each).
    pub const ALL: [Api; 9] = [
        Api::Completions,
        Api::ChatCompletions,
        Api::Responses,
        Api::Messages,
        Api::CountTokens,
        Api::Generate,
        Api::Tokenize,
        Api::Detokenize,
        Api::Render,
    ];

    /// A utility route: cheap, generates nothing, so it is routed by load alone (no prefix,
    /// no session, no flow-control queue).
    pub fn is_utility(self) -> bool {
        matches!(self, Api::CountTokens | Api::Tokenize | Api::Detokenize | Api::Render)
    }

    /// The error body this API's clients parse.
    pub fn error_shape(self) -> ErrorShape {
        match self {
            Api::Messages | Api::CountTokens => ErrorShape::Anthropic,
            _ => ErrorShape::OpenAi,
        }
    }
}

/// The prompt, as the prefix hasher sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Text (for chat: the messages rendered as `role: content\n` lines).
    Text(String),
    /// Token ids supplied by the client.
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Rough prompt length in tokens (4 bytes per token for text).
    pub fn approx_tokens(&self) -> usize {
        match self {
            Prompt::Text(t) => t.len().div_ceil(4),
            Prompt::Tokens(t) => t.len(),
        }
    }
}

/// Request features extracted from a body.
#[derive(Debug, Clone, PartialEq)]
pub struct InferenceRequest {
    pub api: Api,
    pub model: String,
    /// The first prompt of the request (multi-prompt completions route on the first).
    pub prompt: Prompt,
    /// How many prompts the request carries (completions may batch several).
    pub num_prompts: usize,
    pub stream: bool,
    pub max_tokens: Option<u64>,
    pub cache_salt: Option<String>,
    pub priority: Option<i64>,
    pub user: Option<String>,
    /// `/v1/responses` continuation.
    pub previous_response_id: Option<String>,
    /// `/v1/responses`: whether the response is to be stored (`store`, true unless false).
    pub store: bool,
    /// `/v1/responses`: `background: true`.
    pub background: bool,
    /// Chat and Responses requests: the conversation, for rendering with the model's chat
    /// template. Empty for completions.
    pub messages: Vec<ChatMessage>,
    /// Where each message ends in `prompt`'s rendered text (byte offsets, in order; empty for
    /// completions): shared prefixes end there, so the approximate index records the block
    /// before each ([`crate::prefix::anchor_blocks`]).
    pub message_ends: Vec<usize>,
    /// Tool definitions as the chat template receives them (`tools`), as JSON: Anthropic
    /// Messages requests converted as vLLM converts them ([`crate::messages`]).
    pub tools: Option<String>,
}

// The body's variant fields are read with hand-written visitors rather than
// `#[serde(untagged)]`: untagged enums buffer the whole value before trying each variant, which
// for a 400 KB prompt costs more than the rest of the decision. Strings are borrowed from the
// body when they hold no escapes.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// A visitor's three string methods, wrapping the string (borrowed from the body when it holds
/// no escapes) in `$wrap`.
macro_rules! visit_strings {
    ($wrap:path) => {
        fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok($wrap(Cow::Borrowed(v)))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok($wrap(Cow::Owned(v.to_owned())))
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
            Ok($wrap(Cow::Owned(v)))
        }
    };
}

/// Visitor methods that accept any JSON scalar (bool, number, null) as `$value`: for fields
/// whose other shapes carry no prompt text.
macro_rules! visit_scalars_as {
    ($value:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}

/// A string borrowed from the body when it holds no escapes.
struct Str<'de>(Cow<'de, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Str<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            visit_strings!(Str);
        }
        d.deserialize_str(V(std::marker::PhantomData))
    }
}

/// `prompt`: a string, a list of strings, token ids, or a list of token-id lists.
enum PromptField<'de> {
    Text(Cow<'de, str>),
    Texts(Vec<Cow<'de, str>>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// One element of a `prompt` list.
enum PromptElem<'de> {
    Text(Cow<'de, str>),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptElem<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = PromptElem<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a token id or a list of token ids")
            }
            visit_strings!(PromptElem::Text);
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v).map(PromptElem::Token).map_err(|_| E::custom("token id out of range"))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u32::try_from(v).map(PromptElem::Token).map_err(|_| E::custom("token id out of range"))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptElem::Tokens(ids))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptField<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = PromptField<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a list of strings, token ids, or a list of token-id lists")
            }
            visit_strings!(PromptField::Text);
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mixed = || de::Error::custom("a prompt list mixes strings, token ids and token-id lists");
                let mut out = PromptField::Tokens(Vec::new());
                let mut first = true;
                while let Some(e) = seq.next_element::<PromptElem>()? {
                    match (&mut out, e) {
                        (PromptField::Tokens(v), PromptElem::Token(id)) => v.push(id),
                        (o, PromptElem::Text(t)) if first => *o = PromptField::Texts(vec![t]),
                        (o, PromptElem::Tokens(t)) if first => *o = PromptField::TokenLists(vec![t]),
                        (PromptField::Texts(v), PromptElem::Text(t)) => v.push(t),
                        (PromptField::TokenLists(v), PromptElem::Tokens(t)) => v.push(t),
                        _ => return Err(mixed()),
                    }
                    first = false;
                }
                Ok(out)
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// Message content: a string, a list of parts (their `text` fields), or anything else
/// (ignored).
enum Content<'de> {
    Text(Cow<'de, str>),
    Parts(Vec<Part<'de>>),
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Content<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("message content")
            }
            visit_strings!(Content::Text);
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element::<Part>()? {
                    parts.push(p);
                }
                Ok(Content::Parts(parts))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Content::Other)
            }
            visit_scalars_as!(Content::Other);
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A content part: only its text matters (images and other parts carry none).
struct Part<'de> {
    text: Option<Cow<'de, str>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Part<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Part<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a content part")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut text = None;
                while let Some(k) = map.next_key::<Str>()? {
                    if k.0 == "text" {
                        text = map.next_value::<Option<Str>>()?.map(|s| s.0);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(Part { text })
            }
            // A part that is not an object carries no text.
            fn visit_borrowed_str<E: de::Error>(self, _: &'de str) -> Result<Self::Value, E> {
                Ok(Part { text: None })
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(Part { text: None })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Part { text: None })
            }
            visit_scalars_as!(Part { text: None });
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(default, borrow)]
    role: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    content: Option<Content<'a>>,
    /// Responses API `function_call_output` items.
    #[serde(default, borrow)]
    output: Option<Content<'a>>,
}

/// Responses `input`: a string or a list of items.
enum InputField<'de> {
    Text(Cow<'de, str>),
    Items(Vec<Message<'de>>),
}

impl<'de: 'a, 'a> Deserialize<'de> for InputField<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = InputField<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of input items")
            }
            visit_strings!(InputField::Text);
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(m) = seq.next_element::<Message>()? {
                    items.push(m);
                }
                Ok(InputField::Items(items))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// Every field any of the three APIs may carry; serde skips the rest of the body.
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(default)]
    model: Option<String>,
    #[serde(default, borrow)]
    prompt: Option<PromptField<'a>>,
    #[serde(default, borrow)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default, borrow)]
    input: Option<InputField<'a>>,
    #[serde(default, borrow)]
    instructions: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    priority: Option<i64>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    background: Option<bool>,
    /// `/inference/v1/generate`: the prompt's token ids.
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    /// `/inference/v1/generate`: vLLM's `SamplingParams` (only `max_tokens` matters here).
    #[serde(default)]
    sampling_params: Option<SamplingParams>,
}

#[derive(Deserialize)]
struct SamplingParams {
    #[serde(default)]
    max_tokens: Option<u64>,
}

/// A utility route's body: only the model matters (optional on vLLM's utility routes).
#[derive(Deserialize)]
struct UtilityBody {
    #[serde(default)]
    model: Option<String>,
}

fn content_text(c: Content<'_>) -> String {
    match c {
        Content::Text(t) => t.into_owned(),
        Content::Parts(parts) => {
            let mut out = String::new();
            for (i, p) in parts.into_iter().filter_map(|p| p.text).enumerate() {
                if i > 0 {
                    out.push('\n');
                }
                out.push_str(&p);
            }
            out
        }
        Content::Other => String::new(),
    }
}

/// Flatten chat messages (with an optional leading system instruction) to role + text.
fn chat_messages(system: Option<Cow<'_, str>>, messages: Vec<Message<'_>>) -> Vec<ChatMessage> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(s) = system {
        out.push(ChatMessage::new("system", s.into_owned()));
    }
    for m in messages {
        let content = m.content.or(m.output).map(content_text).unwrap_or_default();
        out.push(ChatMessage::new(m.role.map_or_else(|| "user".into(), Cow::into_owned), content));
    }
    out
}

/// Render messages the way the reference chat template does (`role: content\n` per message,
/// then `assistant:`), so that shared conversation prefixes give shared text prefixes. Precise
/// routing renders the model's own template instead ([`crate::chat_template`]). Tool
/// definitions, when the request has them, come first (templates put them in the system
/// prompt); an assistant's tool calls follow its content.
fn render_messages(messages: &[ChatMessage], tools: Option<&str>) -> (String, Vec<usize>) {
    let calls = |m: &ChatMessage| m.tool_calls.iter().map(|c| c.name.len() + c.arguments.len() + 13).sum::<usize>();
    let len: usize = messages.iter().map(|m| m.role.len() + m.content.len() + 3 + calls(m)).sum();
    let mut out = String::with_capacity(len + tools.map_or(0, |t| t.len() + 8) + 10);
    let mut ends = Vec::with_capacity(messages.len() + 1);
    if let Some(t) = tools {
        out.push_str("tools: ");
        out.push_str(t);
        out.push('\n');
        ends.push(out.len());
    }
    for m in messages {
        out.push_str(&m.role);
        out.push_str(": ");
        out.push_str(&m.content);
        for c in &m.tool_calls {
            out.push_str("\ntool_call ");
            out.push_str(&c.name);
            out.push(' ');
            out.push_str(&c.arguments);
        }
        out.push('\n');
        ends.push(out.len());
    }
    out.push_str("assistant:");
    (out, ends)
}

/// A completion's prompt (the first of a batch) and the batch size.
fn completion_prompt(field: Option<PromptField<'_>>) -> Result<(Prompt, usize), RequestError> {
    let missing = || RequestError::MissingField("prompt");
    match field.ok_or_else(missing)? {
        PromptField::Text(t) => Ok((Prompt::Text(t.into_owned()), 1)),
        PromptField::Texts(ts) => {
            let n = ts.len();
            ts.into_iter().next().map(|t| (Prompt::Text(t.into_owned()), n)).ok_or_else(missing)
        }
        PromptField::Tokens(t) if t.is_empty() => Err(missing()),
        PromptField::Tokens(t) => Ok((Prompt::Tokens(t), 1)),
        PromptField::TokenLists(ls) => {
            let n = ls.len();
            ls.into_iter().find(|l| !l.is_empty()).map(|t| (Prompt::Tokens(t), n)).ok_or_else(missing)
        }
    }
}

/// An Anthropic Messages request: its conversation, rendered canonically for the approximate
/// index (tool definitions first, as templates put them in the system prompt).
fn messages_request(c: crate::messages::Conversation) -> InferenceRequest {
    let (text, message_ends) = render_messages(&c.messages, c.tools.as_deref());
    InferenceRequest {
        api: Api::Messages,
        model: c.model,
        prompt: Prompt::Text(text),
        num_prompts: 1,
        stream: c.stream,
        max_tokens: c.max_tokens,
        cache_salt: c.cache_salt,
        priority: None,
        user: c.user,
        previous_response_id: None,
        store: false,
        background: false,
        messages: c.messages,
        message_ends,
        tools: c.tools,
    }
}

/// A request with no prompt to route on: a utility route, routed by load alone.
fn utility(api: Api, model: String) -> InferenceRequest {
    InferenceRequest {
        api,
        model,
        prompt: Prompt::Text(String::new()),
        num_prompts: 1,
        stream: false,
        max_tokens: Some(0),
        cache_salt: None,
        priority: None,
        user: None,
        previous_response_id: None,
        store: false,
        background: false,
        messages: Vec::new(),
        message_ends: Vec::new(),
        tools: None,
    }
}

/// Parse a request body for `api`.
pub fn parse(api: Api, body: &[u8]) -> Result<InferenceRequest, RequestError> {
    check_object(body)?;
    match api {
        Api::Messages => return Ok(messages_request(crate::messages::parse(body)?)),
        Api::CountTokens | Api::Tokenize | Api::Detokenize | Api::Render => {
            let b: UtilityBody = serde_json::from_slice(body).map_err(|e| body_error(&e))?;
            let model = b.model.unwrap_or_default();
            if model.is_empty() && api == Api::CountTokens {
                return Err(RequestError::MissingModel);
            }
            return Ok(utility(api, model));
        }
        _ => {}
    }
    let mut b: Body = serde_json::from_slice(body).map_err(|e| body_error(&e))?;
    let model = match b.model {
        Some(m) if !m.is_empty() => m,
        // vLLM's generate request names no model when the engine serves one: any endpoint's
        // base model will do (the model filter keeps every endpoint for an empty name).
        _ if api == Api::Generate => String::new(),
        _ => return Err(RequestError::MissingModel),
    };
    let (prompt, num_prompts) = match api {
        Api::Completions => completion_prompt(b.prompt)?,
        Api::ChatCompletions => match b.messages {
            Some(ref ms) if !ms.is_empty() => (Prompt::Text(String::new()), 1),
            _ => return Err(RequestError::MissingField("messages")),
        },
        Api::Responses => match b.input {
            Some(InputField::Text(_)) => (Prompt::Text(String::new()), 1),
            Some(InputField::Items(ref items)) if !items.is_empty() => (Prompt::Text(String::new()), 1),
            _ => return Err(RequestError::MissingField("input")),
        },
        Api::Generate => match b.token_ids.take() {
            Some(ids) if !ids.is_empty() => (Prompt::Tokens(ids), 1),
            _ => return Err(RequestError::MissingField("token_ids")),
        },
        // Parsed above.
        Api::Messages | Api::CountTokens | Api::Tokenize | Api::Detokenize | Api::Render => {
            return Err(RequestError::InvalidField { field: "path", detail: "not a generation API".into() })
        }
    };
    let messages = match (api, b.messages, b.input) {
        (Api::ChatCompletions, Some(ms), _) => chat_messages(None, ms),
        (Api::Responses, _, Some(InputField::Text(t))) => {
            let ms = vec![Message { role: Some("user".into()), content: Some(Content::Text(t)), output: None }];
            chat_messages(b.instructions, ms)
        }
        (Api::Responses, _, Some(InputField::Items(items))) => chat_messages(b.instructions, items),
        _ => Vec::new(),
    };
    let (prompt, message_ends) = if messages.is_empty() {
        (prompt, Vec::new())
    } else {
        let (text, ends) = render_messages(&messages, None);
        (Prompt::Text(text), ends)
    };
    Ok(InferenceRequest {
        api,
        model,
        prompt,
        num_prompts,
        stream: b.stream.unwrap_or(false),
        max_tokens: b
            .max_tokens
            .or(b.max_completion_tokens)
            .or(b.max_output_tokens)
            .or(b.sampling_params.and_then(|p| p.max_tokens)),
        cache_salt: b.cache_salt,
        priority: b.priority,
        user: b.user,
        previous_response_id: b.previous_response_id,
        store: api == Api::Responses && b.store.unwrap_or(true),
        background: b.background.unwrap_or(false),
        messages,
        message_ends,
        tools: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(api: Api, s: &str) -> Result<InferenceRequest, RequestError> {
        parse(api, s.as_bytes())
    }

    #[test]
    fn api_from_path() {
        assert_eq!(Api::from_path("/v1/completions"), Some(Api::Completions));
        assert_eq!(Api::from_path("/v1/chat/completions?x=1"), Some(Api::ChatCompletions));
        assert_eq!(Api::from_path("/v1/responses"), Some(Api::Responses));
        assert_eq!(Api::from_path("/v1/models"), None);
        for (path, api) in [
            ("/v1/messages", Api::Messages),
            ("/v1/messages/count_tokens", Api::CountTokens),
            ("/v1/messages/render", Api::Render),
            ("/v1/chat/completions/render", Api::Render),
            ("/v1/completions/derender", Api::Render),
            ("/inference/v1/generate", Api::Generate),
            ("/tokenize", Api::Tokenize),
            ("/detokenize", Api::Detokenize),
        ] {
            assert_eq!(Api::from_path(path), Some(api), "{path}");
        }
        assert_eq!(Api::from_path("/v1/chat/completions/batch"), None);
        assert_eq!(Api::from_path("/inference/v1/abort_requests"), None);
        assert!(Api::Tokenize.is_utility() && Api::CountTokens.is_utility() && !Api::Generate.is_utility());
        assert_eq!(Api::Messages.error_shape(), ErrorShape::Anthropic);
        assert_eq!(Api::ALL.iter().map(|a| a.as_str()).collect::<std::collections::HashSet<_>>().len(), Api::ALL.len());
    }

    #[test]
    fn messages_hash_tools_first_then_every_message_with_its_tool_calls() {
        let r = p(
            Api::Messages,
            r#"{"model":"m","max_tokens":3,"metadata":{"user_id":"u"},"tools":[{"name":"read","input_schema":{"type":"object"}}],
                "messages":[{"role":"user","content":"open"},{"role":"assistant","content":[{"type":"text","text":"Reading."},
                {"type":"tool_use","id":"t","name":"read","input":{"path":"é.txt"}}]}]}"#,
        )
        .unwrap();
        let Prompt::Text(t) = &r.prompt else { panic!("text") };
        assert!(t.starts_with("tools: [{\"type\": \"function\""), "{t}");
        assert!(t.ends_with("user: open\nassistant: Reading.\ntool_call read {\"path\":\"é.txt\"}\nassistant:"), "{t}");
        assert_eq!(r.message_ends.len(), r.messages.len() + 1, "the tools line is an anchor too");
        assert_eq!((r.api, r.user.as_deref(), r.max_tokens), (Api::Messages, Some("u"), Some(3)));
    }

    #[test]
    fn generate_hashes_token_ids_and_utilities_carry_no_prompt() {
        let r = p(
            Api::Generate,
            r#"{"token_ids":[5,6,7],"sampling_params":{"max_tokens":9,"temperature":1.0},"stream":true,"cache_salt":"s"}"#,
        )
        .unwrap();
        assert_eq!(
            (r.prompt, r.model.as_str(), r.max_tokens, r.stream),
            (Prompt::Tokens(vec![5, 6, 7]), "", Some(9), true)
        );
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        assert_eq!(p(Api::Generate, r#"{"model":"m","token_ids":[]}"#), Err(RequestError::MissingField("token_ids")));
        let r = p(Api::Tokenize, r#"{"prompt":"hello"}"#).unwrap();
        assert_eq!((r.prompt.approx_tokens(), r.model.as_str()), (0, ""));
        let r = p(Api::Render, r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#).unwrap();
        assert_eq!((r.api, r.model.as_str(), r.messages.len()), (Api::Render, "m", 0));
        assert_eq!(p(Api::CountTokens, r#"{"messages":[]}"#), Err(RequestError::MissingModel));
        assert!(matches!(p(Api::Detokenize, "[1]"), Err(RequestError::NotAnObject)));
    }

    #[test]
    fn completions_all_prompt_shapes() {
        let r = p(
            Api::Completions,
            r#"{"model":"m","prompt":"hello","stream":true,"max_tokens":5,"cache_salt":"s","priority":-1,"user":"u"}"#,
        )
        .unwrap();
        assert_eq!(r.model, "m");
        assert_eq!(r.prompt, Prompt::Text("hello".into()));
        assert!(r.stream);
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        assert_eq!(r.priority, Some(-1));
        assert_eq!(r.user.as_deref(), Some("u"));

        let r = p(Api::Completions, r#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert_eq!((r.prompt, r.num_prompts), (Prompt::Text("a".into()), 2));
        let r = p(Api::Completions, r#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        let r = p(Api::Completions, r#"{"model":"m","prompt":[[4,5],[6]]}"#).unwrap();
        assert_eq!((r.prompt, r.num_prompts), (Prompt::Tokens(vec![4, 5]), 2));
        assert_eq!(p(Api::Completions, r#"{"model":"m","prompt":[]}"#), Err(RequestError::MissingField("prompt")));
        assert_eq!(p(Api::Completions, r#"{"model":"m"}"#), Err(RequestError::MissingField("prompt")));
    }

    #[test]
    fn chat_string_and_parts() {
        let r = p(
            Api::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"system","content":"be terse"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]}],"max_completion_tokens":9}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Text("system: be terse\nuser: hi\nthere\nassistant:".into()));
        // Each message ends just after its newline.
        assert_eq!(r.message_ends, vec!["system: be terse\n".len(), "system: be terse\nuser: hi\nthere\n".len()]);
        assert_eq!(r.max_tokens, Some(9));
        assert_eq!(
            p(Api::ChatCompletions, r#"{"model":"m","messages":[]}"#),
            Err(RequestError::MissingField("messages"))
        );
    }

    #[test]
    fn responses_input_and_instructions() {
        let r = p(
            Api::Responses,
            r#"{"model":"m","input":"q","instructions":"sys","previous_response_id":"resp_1","max_output_tokens":3}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Text("system: sys\nuser: q\nassistant:".into()));
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
        assert_eq!(r.max_tokens, Some(3));
        let r = p(Api::Responses, r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a"}]},{"type":"function_call_output","output":"42"}]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Text("user: a\nuser: 42\nassistant:".into()));
    }

    #[test]
    fn bad_bodies_are_typed_errors() {
        assert!(matches!(p(Api::Completions, "{not json"), Err(RequestError::MalformedJson(_))));
        assert!(matches!(p(Api::Completions, "hello world"), Err(RequestError::MalformedJson(_))));
        assert_eq!(p(Api::Completions, "[1,2]"), Err(RequestError::NotAnObject));
        assert_eq!(p(Api::Completions, "   "), Err(RequestError::EmptyBody));
        assert_eq!(p(Api::Completions, r#"{"prompt":"x"}"#), Err(RequestError::MissingModel));
        assert_eq!(p(Api::Completions, r#"{"model":"","prompt":"x"}"#), Err(RequestError::MissingModel));
        assert!(matches!(p(Api::Completions, r#"{"model":5,"prompt":"x"}"#), Err(RequestError::InvalidField { .. })));
        assert!(matches!(
            p(Api::Completions, r#"{"model":"m","prompt":[-1]}"#),
            Err(RequestError::InvalidField { .. })
        ));
    }

    #[test]
    fn invalid_bytes_are_errors_never_panics() {
        // A cheap exhaustive-ish sweep; the fuzz target covers the rest.
        let seeds: [&[u8]; 6] =
            [b"{", b"{\"model\":", b"\xff\xfe", b"{\"model\":\"m\",\"prompt\":[[[]]]}", b"null", b"{\"messages\":{}}"];
        for s in seeds {
            for api in [Api::Completions, Api::ChatCompletions, Api::Responses, Api::Messages, Api::Generate] {
                // Every seed is invalid for every API: it must be a typed error, never a panic.
                assert!(parse(api, s).is_err(), "{api:?} accepted {s:?}");
            }
        }
    }
}
