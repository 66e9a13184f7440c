//! Chat-template rendering: turn chat messages into the exact prompt text the engine tokenizes.
//!
//! vLLM hashes the tokens of the *rendered* prompt (`tokenizer.apply_chat_template(...,
//! tokenize=False)`, then tokenized without adding special tokens), so precise routing of chat
//! and Responses requests must render the model's Jinja template the same way. MiniJinja with
//! Python-compatible string methods covers what Hugging Face templates use; a fuel limit bounds
//! any template's cost so a hostile or buggy template cannot stall a proxy worker.

use minijinja::{Environment, Error, ErrorKind, Value};

/// One chat message, with content already flattened to text (parts joined by `\n`, as vLLM does
/// for string-content templates).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's tool calls (Anthropic `tool_use` blocks, converted as vLLM does).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant message's reasoning (Anthropic `thinking` blocks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
}

/// A function call an assistant made: its arguments as JSON text.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into(), ..Self::default() }
    }

    /// The message as the template sees it: vLLM hands templates the tool calls' arguments as
    /// objects, not strings (`_postprocess_messages` in `vllm/renderers/chat_utils.py`).
    fn to_value(&self) -> Value {
        let mut map: std::collections::BTreeMap<&str, Value> =
            [("role", Value::from(self.role.as_str())), ("content", Value::from(self.content.as_str()))].into();
        if !self.tool_calls.is_empty() {
            let calls: Vec<Value> = self
                .tool_calls
                .iter()
                .map(|c| {
                    // vLLM parses the arguments back into an object; text that is not JSON
                    // becomes an empty one (`_postprocess_messages`).
                    let args = crate::template_json::parse(&c.arguments)
                        .ok()
                        .filter(|v| v.kind() == minijinja::value::ValueKind::Map)
                        .unwrap_or_else(|| crate::template_json::parse("{}").unwrap_or_default());
                    let function: std::collections::BTreeMap<&str, Value> =
                        [("name", Value::from(c.name.as_str())), ("arguments", args)].into();
                    let call: std::collections::BTreeMap<&str, Value> = [
                        ("id", Value::from(c.id.as_str())),
                        ("type", Value::from("function")),
                        ("function", Value::from(function)),
                    ]
                    .into();
                    Value::from(call)
                })
                .collect();
            map.insert("tool_calls", Value::from(calls));
        }
        if let Some(id) = &self.tool_call_id {
            map.insert("tool_call_id", Value::from(id.as_str()));
        }
        if let Some(r) = &self.reasoning {
            // vLLM hands templates both names (`_parse_chat_message_content`).
            map.insert("reasoning", Value::from(r.as_str()));
            map.insert("reasoning_content", Value::from(r.as_str()));
        }
        Value::from(map)
    }
}

/// Why a template could not be compiled or rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("chat template does not compile: {0}")]
    Compile(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
}

/// Instructions a template may execute per render (MiniJinja fuel); generous for any real chat
/// template over long conversations, small enough to stop a runaway loop quickly.
const FUEL: u64 = 5_000_000;
const NAME: &str = "chat";

/// A compiled chat template with the special tokens Hugging Face passes to it.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).finish_non_exhaustive()
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compile `source` (the `chat_template` of `tokenizer_config.json`, or a `.jinja` file).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_fuel(Some(FUEL));
        // Hugging Face renders with trim_blocks and lstrip_blocks on.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatTemplateError::Compile(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", crate::template_json::tojson);
        env.add_template_owned(NAME, source.to_string()).map_err(|e| ChatTemplateError::Compile(e.to_string()))?;
        Ok(Self { env, bos_token: bos_token.to_string(), eos_token: eos_token.to_string() })
    }

    /// Render `messages` as the engine does for a chat request (`add_generation_prompt` is vLLM's
    /// default, true).
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, ChatTemplateError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the request's tool definitions (`tools`, a JSON list, as
    /// vLLM passes them to the template; absent when the request declares none).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&str>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        let tmpl = self.env.get_template(NAME).map_err(|e| ChatTemplateError::Compile(e.to_string()))?;
        let tools = match tools {
            Some(t) => crate::template_json::parse(t)
                .map_err(|e| ChatTemplateError::Render(format!("tools are not JSON: {e}")))?,
            None => Value::from(()),
        };
        tmpl.render(minijinja::context! {
            messages => Value::from(messages.iter().map(ChatMessage::to_value).collect::<Vec<_>>()),
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        })
        .map_err(|e| ChatTemplateError::Render(e.to_string()))
    }

    /// Whether the template renders a system message after other messages. vLLM's Messages
    /// route probes the template with `[system, user, system, user]`; a template that refuses
    /// it (Qwen's `loop.first` guard) gets every inline system message merged into the leading
    /// one (`_detect_merge_inline_system`, `vllm/entrypoints/anthropic/serving.py`).
    pub fn accepts_inline_system(&self) -> bool {
        let probe: Vec<Value> =
            ["system", "user", "system", "user"].iter().map(|r| ChatMessage::new(*r, "t").to_value()).collect();
        // vLLM's probe passes these two variables only.
        self.env.get_template(NAME).is_ok_and(|t| {
            t.render(minijinja::context! { messages => Value::from(probe), add_generation_prompt => false }).is_ok()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REFERENCE: &str = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}";

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect()
    }

    #[test]
    fn renders_the_reference_template() {
        let t = ChatTemplate::new(REFERENCE, "<s>", "</s>").unwrap();
        let out = t.render(&msgs(&[("system", "You are terse."), ("user", "Hi")]), true).unwrap();
        assert_eq!(out, "<s>system: You are terse.\n<s>user: Hi\nassistant:");
        let out = t.render(&msgs(&[("user", "Hi")]), false).unwrap();
        assert_eq!(out, "<s>user: Hi\n");
    }

    #[test]
    fn supports_hugging_face_idioms() {
        // bos_token, python string methods, raise_exception, loop variables.
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}[{{ m.role | upper }}]{{ m.content.strip() }}{% if not loop.last %}|{% endif %}{% endfor %}";
        let t = ChatTemplate::new(src, "<bos>", "<eos>").unwrap();
        assert_eq!(
            t.render(&msgs(&[("user", "  a "), ("assistant", "b")]), true).unwrap(),
            "<bos>[USER]a|[ASSISTANT]b"
        );
        let err = t.render(&msgs(&[("tool", "x")]), true).unwrap_err();
        assert!(err.to_string().contains("bad role tool"), "{err}");
    }

    #[test]
    fn rejects_broken_and_runaway_templates() {
        assert!(matches!(ChatTemplate::new("{% for %}", "", ""), Err(ChatTemplateError::Compile(_))));
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert!(matches!(t.render(&[], true), Err(ChatTemplateError::Render(_))));
    }
}
