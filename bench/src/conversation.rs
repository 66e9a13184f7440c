//! One agent session's conversation in its API's shape (chat, Anthropic Messages, or
//! token-in generate), growing turn by turn: what both the open- and closed-loop drivers send.

use serde_json::{json, Value};

use crate::scenario::{ApiKind, SessionPlan};

/// The model every simulated engine serves.
pub const MODEL: &str = "tinyllama";

/// Claude Code's tools, as an agent declares them (the template does not render them; the
/// approximate index hashes them).
fn agent_tools() -> Value {
    let tool = |name: &str, what: &str| {
        json!({"name": name, "description": what, "input_schema": {"type": "object",
               "properties": {"command": {"type": "string"}, "path": {"type": "string"}}}})
    };
    json!([
        tool("bash", "Run a shell command in the repository."),
        tool("read", "Read a file."),
        tool("edit", "Replace text in a file."),
        tool("grep", "Search the repository.")
    ])
}

/// One session's conversation in its API's shape, growing turn by turn.
pub struct Conversation {
    api: ApiKind,
    messages: Vec<Value>,
    /// The assistant's last answer, to append before the next turn.
    last: Option<String>,
}

impl Conversation {
    pub fn new(api: ApiKind, p: &SessionPlan) -> Self {
        let messages = match api {
            ApiKind::Chat => vec![json!({"role": "system", "content": &*p.system})],
            ApiKind::Messages | ApiKind::Generate => Vec::new(),
        };
        Self { api, messages, last: None }
    }

    /// The body of turn `k` (whose new input is `user`).
    pub fn turn(&mut self, p: &SessionPlan, k: usize, user: &str) -> Value {
        match self.api {
            ApiKind::Chat => {
                if let Some(a) = self.last.take() {
                    self.messages.push(json!({"role": "assistant", "content": a}));
                }
                self.messages.push(json!({"role": "user", "content": user}));
                json!({"model": MODEL, "messages": self.messages, "max_tokens": p.max_tokens,
                    "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})
            }
            ApiKind::Messages => {
                // After the first turn, the model called a tool; the turn is its result.
                match self.last.take() {
                    Some(a) => {
                        let id = format!("toolu_{}_{k}", p.id);
                        self.messages.push(json!({"role": "assistant", "content": [
                            {"type": "text", "text": a},
                            {"type": "tool_use", "id": id, "name": "bash", "input": {"command": format!("make step-{k}")}}]}));
                        self.messages.push(json!({"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": id, "content": user}]}));
                    }
                    None => self.messages.push(json!({"role": "user", "content": user})),
                }
                // Claude Code's attribution block changes on every request; vLLM drops it.
                let billing = format!("x-anthropic-billing-header: cc_version=2.1; cch={:05x}", p.id * 31 + k);
                json!({"model": MODEL, "max_tokens": p.max_tokens, "stream": true, "ignore_eos": true,
                    "system": [{"type": "text", "text": billing}, {"type": "text", "text": &*p.system}],
                    "tools": agent_tools(), "messages": self.messages,
                    "metadata": {"user_id": format!("user_{}_session_{}", p.id % 7, p.id)}})
            }
            ApiKind::Generate => {
                let ids = p.prompt_ids.as_deref().unwrap_or(&[]);
                json!({"model": MODEL, "token_ids": ids, "stream": true, "stream_options": {"include_usage": true},
                    "sampling_params": {"max_tokens": p.max_tokens, "ignore_eos": true, "temperature": 1.0}})
            }
        }
    }

    pub fn answered(&mut self, text: String) {
        self.last = Some(text);
    }
}
