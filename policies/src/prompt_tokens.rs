//! The token ids an engine computes for a request's prompt: one place for the rules, used by the
//! filter (to compute the engines' block keys) and by the simulator (to be the engine).
//!
//! vLLM's rules: token-id completions are used as given; text completions are tokenized with the
//! post-processor's special tokens (BOS); chat and Responses conversations are rendered with the
//! model's chat template and the result is tokenized *without* added special tokens (the template
//! writes them itself).

use crate::chat_template::{ChatMessage, ChatTemplate, ChatTemplateError};
use crate::config::{PreciseConfig, TokenizerCheck};
use crate::request::{Api, InferenceRequest, Prompt};
use crate::token_prefix::{encode_with_store, StoreStats, TokenPrefixStore};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// Why a request's prompt could not be turned into the engine's ids.
#[derive(Debug, thiserror::Error)]
pub enum PromptTokensError {
    #[error("no usable tokenizer: text and chat prompts are not routed precisely")]
    NoTokenizer,
    #[error("no chat template is configured, so conversations cannot be tokenized as the engine does")]
    NoChatTemplate,
    #[error(transparent)]
    Template(#[from] ChatTemplateError),
}

/// Why the configured tokenizer or template cannot be used at all.
#[derive(Debug, thiserror::Error)]
pub enum PromptTokenizerLoadError {
    #[error("precise routing has no tokenizer_json")]
    NoTokenizer,
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] ChatTemplateError),
}

/// A model's tokenizer plus, optionally, its chat template.
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// The template renders a system message after others (vLLM's Messages route merges them
    /// into the leading one otherwise).
    inline_system: bool,
    /// Tokenized prefixes: a conversation's next turn tokenizes only what it added.
    store: TokenPrefixStore,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer").field("chat_template", &self.template.is_some()).finish_non_exhaustive()
    }
}

impl PromptTokenizer {
    pub fn new(tokenizer: Tokenizer, template: Option<ChatTemplate>) -> Self {
        let inline_system = template.as_ref().is_some_and(ChatTemplate::accepts_inline_system);
        Self { tokenizer, template, inline_system, store: TokenPrefixStore::new(0) }
    }

    /// Keep up to `max_bytes` of tokenized prefixes ([`crate::token_prefix`]; 0: none).
    pub fn with_prefix_store(mut self, max_bytes: usize) -> Self {
        self.store = TokenPrefixStore::new(max_bytes);
        self
    }

    /// What the prefix store has done.
    pub fn prefix_store_stats(&self) -> StoreStats {
        self.store.stats()
    }

    /// Build from the precise-routing configuration and run its `tokenizer_check`s. Returns the
    /// tokenizer and how many checks gave other ids than expected (non-zero: do not trust it).
    pub fn load_checked(cfg: &PreciseConfig) -> Result<(Self, usize), PromptTokenizerLoadError> {
        let json = cfg.tokenizer_json.as_deref().ok_or(PromptTokenizerLoadError::NoTokenizer)?;
        let tokenizer = Tokenizer::from_json(json.as_bytes())?;
        let template = match &cfg.chat_template {
            Some(src) => Some(ChatTemplate::new(src, &cfg.bos_token, &cfg.eos_token)?),
            None => None,
        };
        let mut me = Self::new(tokenizer, template);
        let failed = cfg.tokenizer_check.iter().filter(|c| !me.check(c)).count();
        // The checks' texts are not routed: the store starts empty.
        Ok((me.with_prefix_store(cfg.prefix_store_bytes), failed))
    }

    /// The tokenizer precise routing uses, if it is configured: `Ok(None)` when precise routing
    /// or the tokenizer is off; `Err(why)` when it cannot load or gives other ids than the
    /// engine on a configured check (the host logs and counts it, and routes without it).
    pub fn for_routing(cfg: &PreciseConfig) -> Result<Option<Self>, String> {
        if !cfg.enabled || cfg.tokenizer_json.is_none() {
            return Ok(None);
        }
        match Self::load_checked(cfg) {
            Ok((t, 0)) => Ok(Some(t)),
            Ok((_, failed)) => Err(format!("tokenizer gives other ids than the engine on {failed} check(s)")),
            Err(e) => Err(format!("tokenizer not usable ({e})")),
        }
    }

    fn check(&mut self, c: &TokenizerCheck) -> bool {
        let got = match &c.messages {
            Some(ms) => self.conversation(ms, true, 0).ok(),
            None => Some(self.tokenizer.encode(&c.text, c.add_special_tokens, 0)),
        };
        got.as_deref() == Some(c.ids.as_slice())
    }

    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Tokenize text as `/tokenize` and completions do (`add_special_tokens` adds BOS).
    pub fn text(&mut self, text: &str, add_special_tokens: bool, max_tokens: usize) -> Vec<u32> {
        self.tokenizer.encode(text, add_special_tokens, max_tokens)
    }

    /// Render a conversation with the chat template and tokenize it without special tokens.
    pub fn conversation(
        &mut self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        max_tokens: usize,
    ) -> Result<Vec<u32>, PromptTokensError> {
        self.conversation_with_tools(messages, None, add_generation_prompt, max_tokens)
    }

    /// [`PromptTokenizer::conversation`] with the request's tool definitions.
    pub fn conversation_with_tools(
        &mut self,
        messages: &[ChatMessage],
        tools: Option<&str>,
        add_generation_prompt: bool,
        max_tokens: usize,
    ) -> Result<Vec<u32>, PromptTokensError> {
        let template = self.template.as_ref().ok_or(PromptTokensError::NoChatTemplate)?;
        let rendered = template.render_with_tools(messages, tools, add_generation_prompt)?;
        Ok(encode_with_store(&mut self.tokenizer, &mut self.store, &rendered, false, max_tokens))
    }

    /// An Anthropic Messages conversation as vLLM renders it: inline system messages merged
    /// into the leading one when the template refuses them where they are.
    fn messages(&mut self, req: &InferenceRequest, max_tokens: usize) -> Result<Vec<u32>, PromptTokensError> {
        let inline = req.messages.iter().skip(1).any(|m| m.role == "system");
        if inline && !self.inline_system {
            let merged = crate::messages::merge_inline_system(&req.messages);
            return self.conversation_with_tools(&merged, req.tools.as_deref(), true, max_tokens);
        }
        self.conversation_with_tools(&req.messages, req.tools.as_deref(), true, max_tokens)
    }

    /// The first `max_tokens` (0 = all) ids the engine computes for `req`'s (first) prompt.
    pub fn request(&mut self, req: &InferenceRequest, max_tokens: usize) -> Result<Vec<u32>, PromptTokensError> {
        if req.api == Api::Messages {
            return self.messages(req, max_tokens);
        }
        if !req.messages.is_empty() {
            return self.conversation_with_tools(&req.messages, req.tools.as_deref(), true, max_tokens);
        }
        Ok(match &req.prompt {
            Prompt::Tokens(ids) => given_ids(ids, max_tokens),
            Prompt::Text(text) => encode_with_store(&mut self.tokenizer, &mut self.store, text, true, max_tokens),
        })
    }
}

/// The request's token ids as the engine computes them, for precise routing: token-id prompts
/// as given, text completions with BOS, conversations rendered with the model's chat template.
/// `Ok(None)`: precise routing is off. `Err`: it is on, but this prompt could not be tokenized
/// (no usable tokenizer, or the tokenizer refused it); the caller counts it.
pub fn engine_ids(
    cfg: &PreciseConfig,
    req: &InferenceRequest,
    tokenizer: Option<&mut PromptTokenizer>,
) -> Result<Option<Vec<u32>>, PromptTokensError> {
    match (&req.prompt, tokenizer) {
        // Utility routes are routed by load alone: there is nothing to match.
        _ if !cfg.enabled || req.api.is_utility() => Ok(None),
        (Prompt::Tokens(ids), _) if req.messages.is_empty() => Ok(Some(given_ids(ids, cfg.max_tokens))),
        (_, Some(t)) => t.request(req, cfg.max_tokens).map(Some),
        (_, None) => Err(PromptTokensError::NoTokenizer),
    }
}

/// A token-id prompt as the engine sees it (vLLM adds nothing), cut at `max_tokens` (0 = all).
/// Needs no tokenizer.
pub fn given_ids(ids: &[u32], max_tokens: usize) -> Vec<u32> {
    let n = if max_tokens == 0 { ids.len() } else { ids.len().min(max_tokens) };
    ids.get(..n).unwrap_or(ids).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{parse, Api};
    use serde::Deserialize;

    fn reference(file: &str) -> String {
        attache_fixtures::read_vllm(file).unwrap()
    }

    #[test]
    fn the_routing_tokenizer_is_off_loaded_or_refused_with_a_reason() {
        assert!(PromptTokenizer::for_routing(&PreciseConfig::default()).unwrap().is_none(), "precise off");
        let cfg = PreciseConfig { enabled: true, ..PreciseConfig::default() };
        assert!(PromptTokenizer::for_routing(&cfg).unwrap().is_none(), "no tokenizer configured");
        let broken = PreciseConfig { tokenizer_json: Some("{".into()), ..cfg.clone() };
        assert!(PromptTokenizer::for_routing(&broken).unwrap_err().contains("not usable"));
        let mut wrong = reference_config();
        wrong.tokenizer_check =
            vec![TokenizerCheck { text: "Hello".into(), messages: None, add_special_tokens: true, ids: vec![1] }];
        assert!(PromptTokenizer::for_routing(&wrong).unwrap_err().contains("1 check(s)"));
        assert!(PromptTokenizer::for_routing(&reference_config()).unwrap().is_some());
    }

    fn reference_config() -> PreciseConfig {
        PreciseConfig {
            enabled: true,
            tokenizer_json: Some(reference("model/tokenizer.json")),
            chat_template: Some(reference("model/chat_template.jinja")),
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
            ..PreciseConfig::default()
        }
    }

    #[derive(Deserialize)]
    struct ChatCapture {
        messages: Vec<ChatMessage>,
        tokenize_response: TokenizeResponse,
    }
    #[derive(Deserialize)]
    struct TokenizeResponse {
        tokens: Vec<u32>,
    }

    /// The captured `/tokenize` of the chat messages from the real vLLM 0.32: rendering the
    /// model's template and tokenizing gives the very same ids, through the request path.
    #[test]
    fn chat_request_ids_equal_real_vllm() {
        let cap: ChatCapture = serde_json::from_str(&reference("http/chat-prompt-tokenized.json")).unwrap();
        let (mut pt, failed) = PromptTokenizer::load_checked(&reference_config()).unwrap();
        assert_eq!(failed, 0);
        let body = serde_json::json!({"model": "tinyllama", "messages": cap.messages}).to_string();
        let req = parse(Api::ChatCompletions, body.as_bytes()).unwrap();
        assert_eq!(pt.request(&req, 0).unwrap(), cap.tokenize_response.tokens);
        // The cap keeps exactly the leading ids.
        assert_eq!(pt.request(&req, 40).unwrap(), cap.tokenize_response.tokens[..40]);
        // Responses: instructions become the system message, the input the user message.
        let body = serde_json::json!({"model": "tinyllama", "instructions": cap.messages[0].content,
            "input": cap.messages[1].content})
        .to_string();
        let req = parse(Api::Responses, body.as_bytes()).unwrap();
        assert_eq!(pt.request(&req, 0).unwrap(), cap.tokenize_response.tokens);
    }

    /// Anthropic Messages requests, rendered by the real vLLM 0.32 (`/v1/messages/render`,
    /// `http/messages-capture.json`): system blocks with Claude Code's billing header, tools,
    /// tool use and results (string and list content), empty text blocks, multi-byte text,
    /// inline system messages. The request path gives the very same ids for every one, and
    /// `count_tokens` counts them.
    #[test]
    fn messages_request_ids_equal_real_vllm() {
        let cap: serde_json::Value = serde_json::from_str(&reference("http/messages-capture.json")).unwrap();
        let records = cap["requests"].as_array().unwrap();
        let (mut pt, _) = PromptTokenizer::load_checked(&reference_config()).unwrap();
        let mut compared = 0;
        for r in records.iter().filter(|r| r["path"] == "/v1/messages/render" && r["status"] == 200) {
            let req = parse(Api::Messages, r["request"].to_string().as_bytes()).unwrap();
            let want: Vec<u32> = serde_json::from_value(r["response"]["token_ids"].clone()).unwrap();
            assert_eq!(pt.request(&req, 0).unwrap(), want, "{}", r["name"]);
            let name = r["name"].as_str().unwrap().replace("/render", "/count_tokens");
            if let Some(c) = records.iter().find(|c| c["name"] == name.as_str()) {
                assert_eq!(c["response"]["input_tokens"].as_u64(), Some(want.len() as u64), "{name}");
            }
            compared += 1;
        }
        assert!(compared >= 12, "only {compared} renders compared");
    }

    #[test]
    fn checks_detect_a_wrong_template() {
        let cap: ChatCapture = serde_json::from_str(&reference("http/chat-prompt-tokenized.json")).unwrap();
        let check = TokenizerCheck {
            text: String::new(),
            messages: Some(cap.messages.clone()),
            add_special_tokens: false,
            ids: cap.tokenize_response.tokens.clone(),
        };
        let mut cfg = reference_config();
        cfg.tokenizer_check = vec![check.clone()];
        assert_eq!(PromptTokenizer::load_checked(&cfg).unwrap().1, 0);
        // A template that differs by one space renders other ids: the check says so.
        cfg.chat_template =
            Some("{% for m in messages %}<s>{{ m['role'] }}:  {{ m['content'] }}\n{% endfor %}assistant:".into());
        assert_eq!(PromptTokenizer::load_checked(&cfg).unwrap().1, 1);
        // No template: conversations are refused with a clear error, text still works.
        cfg.chat_template = None;
        let (mut pt, failed) = PromptTokenizer::load_checked(&cfg).unwrap();
        assert_eq!(failed, 1);
        assert!(matches!(pt.conversation(&cap.messages, true, 0), Err(PromptTokensError::NoChatTemplate)));
        assert_eq!(pt.text("a", true, 0)[0], 0);
    }
}
