//! Chat templates: the model's own Jinja template (`tokenizer.chat_template`) rendered by
//! minijinja with Python-compatible string methods, as transformers renders it.

use minijinja::{context, Environment, Error as JinjaError, ErrorKind};
use serde::Serialize;

use super::TokenizerError;

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TokenizerError::ChatTemplate(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The prompt text for `messages`, ending with the assistant's turn opened.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TokenizerError::ChatTemplate(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| TokenizerError::ChatTemplate(e.to_string()))
    }
}
