//! Model hyper-parameters, read from GGUF metadata for each supported architecture.

use super::error::{Result, RuntimeError};
use super::gguf::GgufFile;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
}

/// How rotary embeddings pair up the dimensions of a head. GGUF llama weights are permuted by
/// the converter so adjacent pairs rotate together; qwen2 keeps the NeoX split into halves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    AdjacentPairs,
    Halves,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rms_norm_eps: f32,
    pub context_length: usize,
    /// qwen2 has biases on the q/k/v projections.
    pub qkv_bias: bool,
}

/// The longest context a model may declare.
const MAX_CONTEXT: usize = 1 << 20;

impl ModelConfig {
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let arch_name = gguf.string("general.architecture")?;
        let (architecture, rope_style, qkv_bias) = match arch_name.as_str() {
            "llama" => (Architecture::Llama, RopeStyle::AdjacentPairs, false),
            "qwen2" => (Architecture::Qwen2, RopeStyle::Halves, true),
            other => return Err(RuntimeError::UnsupportedArchitecture(other.to_string())),
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        // Scaled ropes (Llama 3.1's frequency table, linear or yarn scaling) are not implemented:
        // refused, never computed as plain rope.
        let scaling = gguf.string(&key("rope.scaling.type")).unwrap_or_default();
        if !matches!(scaling.as_str(), "" | "none") {
            return Err(RuntimeError::BadMetadata {
                key: key("rope.scaling.type"),
                reason: format!("rope scaling `{scaling}` is not supported (plain rope only)"),
            });
        }
        if gguf.has_tensor("rope_freqs.weight") {
            return Err(RuntimeError::BadMetadata {
                key: "rope_freqs.weight".into(),
                reason: "scaled rope frequencies are not supported (plain rope only)".into(),
            });
        }
        let hidden_size = gguf.usize(&key("embedding_length"))?;
        let num_heads = gguf.usize(&key("attention.head_count"))?;
        let num_kv_heads = gguf.usize_or(&key("attention.head_count_kv"), num_heads)?;
        let head_dim = gguf.usize_or(&key("rope.dimension_count"), hidden_size / num_heads.max(1))?;
        let vocab_size = match gguf.usize(&key("vocab_size")) {
            Ok(v) => v,
            Err(_) => gguf.array_len("tokenizer.ggml.tokens")?,
        };
        let config = ModelConfig {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size: gguf.usize(&key("feed_forward_length"))?,
            num_layers: gguf.usize(&key("block_count"))?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta: gguf.f32_or(&key("rope.freq_base"), 10_000.0)?,
            rope_style,
            rms_norm_eps: gguf.f32_or(&key("attention.layer_norm_rms_epsilon"), 1e-6)?,
            context_length: gguf.usize_or(&key("context_length"), 2048)?,
            qkv_bias,
        };
        config.check()?;
        Ok(config)
    }

    fn check(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(RuntimeError::BadMetadata {
                key: "attention shape".into(),
                reason,
            })
        };
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.head_dim == 0 {
            return bad("zero heads or head dimension".into());
        }
        if [
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.num_layers,
        ]
        .contains(&0)
        {
            return bad("a zero vocabulary, width or layer count".into());
        }
        // The rope tables hold every position: a bound keeps a bad value from exhausting memory.
        if self.context_length == 0 || self.context_length > MAX_CONTEXT {
            return bad(format!(
                "context length {}: 1 to {MAX_CONTEXT} positions are supported",
                self.context_length
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} kv heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.num_heads / self.num_kv_heads > crate::runtime::cpu::MAX_HEAD_GROUP {
            return bad(format!(
                "{} query heads per kv head: at most {} are supported",
                self.num_heads / self.num_kv_heads,
                crate::runtime::cpu::MAX_HEAD_GROUP
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("odd head dimension {}", self.head_dim));
        }
        Ok(())
    }

    pub fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The width of the stacked `[q | k | v]` projection.
    pub fn qkv_size(&self) -> usize {
        self.q_size() + 2 * self.kv_size()
    }

    /// Multiply-adds of the weight products for one token, every layer and the head: what a
    /// row of a step costs wherever the products are compute-bound (attention left out).
    pub fn macs_per_token(&self) -> usize {
        let h = self.hidden_size;
        let layer = h * self.qkv_size() + self.q_size() * h + 3 * h * self.intermediate_size;
        self.num_layers * layer + h * self.vocab_size
    }
}

impl ModelConfig {
    /// A Hugging Face `config.json` (llama or qwen2). HF checkpoints keep q and k unpermuted,
    /// so their heads rotate in halves whatever the architecture.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let bad = |key: &str, reason: &str| RuntimeError::BadMetadata {
            key: key.into(),
            reason: reason.into(),
        };
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad("config.json", &e.to_string()))?;
        let int = |key: &str| -> Result<usize> {
            v.get(key)
                .and_then(|x| x.as_u64())
                .map(|x| x as usize)
                .ok_or_else(|| bad(key, "missing or not a whole number"))
        };
        let float = |key: &str, default: f64| v.get(key).and_then(|x| x.as_f64()).unwrap_or(default) as f32;
        // transformers 5 keeps rope settings in `rope_parameters` (4.x: `rope_theta` and
        // `rope_scaling`). Scaled ropes (llama3, yarn, ...) are not implemented: refused, never
        // silently computed as plain rope.
        let present = |k: &str| v.get(k).filter(|x| !x.is_null());
        let rope = present("rope_parameters").or_else(|| present("rope_scaling"));
        if let Some(kind) = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(|t| t.as_str())
            .filter(|&t| t != "default")
        {
            return Err(bad(
                "rope_parameters",
                &format!("rope type `{kind}` is not supported (plain rope only)"),
            ));
        }
        let rope_theta = rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(|t| t.as_f64())
            .map(|t| t as f32)
            .unwrap_or_else(|| float("rope_theta", 10_000.0));
        let model_type = v.get("model_type").and_then(|x| x.as_str()).unwrap_or("");
        // What the layer loop does not compute is refused, never ignored.
        let flag = |k: &str| v.get(k).and_then(|x| x.as_bool()).unwrap_or(false);
        for (key, on) in [
            ("mlp_bias", flag("mlp_bias")),
            ("use_sliding_window", flag("use_sliding_window")),
        ] {
            if on {
                return Err(bad(key, "not supported"));
            }
        }
        if model_type == "llama" && flag("attention_bias") {
            return Err(bad("attention_bias", "not supported (the output projection's bias)"));
        }
        if let Some(act) = v.get("hidden_act").and_then(|x| x.as_str()).filter(|&a| a != "silu") {
            return Err(bad("hidden_act", &format!("`{act}`: only silu is supported")));
        }
        let (architecture, qkv_bias) = match model_type {
            "llama" => (Architecture::Llama, false),
            "qwen2" => (Architecture::Qwen2, true),
            other => return Err(RuntimeError::UnsupportedArchitecture(other.to_string())),
        };
        let hidden_size = int("hidden_size")?;
        let num_heads = int("num_attention_heads")?;
        let config = ModelConfig {
            architecture,
            vocab_size: int("vocab_size")?,
            hidden_size,
            intermediate_size: int("intermediate_size")?,
            num_layers: int("num_hidden_layers")?,
            num_heads,
            num_kv_heads: int("num_key_value_heads").unwrap_or(num_heads),
            head_dim: int("head_dim").unwrap_or(hidden_size / num_heads.max(1)),
            rope_theta,
            rope_style: RopeStyle::Halves,
            rms_norm_eps: float("rms_norm_eps", 1e-6),
            context_length: int("max_position_embeddings").unwrap_or(2048),
            qkv_bias,
        };
        config.check()?;
        Ok(config)
    }

    /// Shapes of well-known models, for `--load-format dummy --model-config NAME` (their
    /// Hugging Face configs; rope scaling is left out, it changes no cost).
    pub fn preset(name: &str) -> Option<Self> {
        let json = match name {
            "llama-3.1-8b" => {
                r#"{"model_type":"llama","vocab_size":128256,"hidden_size":4096,"intermediate_size":14336,
                "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"rope_theta":500000.0,
                "rms_norm_eps":1e-5,"max_position_embeddings":131072}"#
            }
            "llama-3.1-70b" => {
                r#"{"model_type":"llama","vocab_size":128256,"hidden_size":8192,"intermediate_size":28672,
                "num_hidden_layers":80,"num_attention_heads":64,"num_key_value_heads":8,"rope_theta":500000.0,
                "rms_norm_eps":1e-5,"max_position_embeddings":131072}"#
            }
            "qwen2.5-7b" => {
                r#"{"model_type":"qwen2","vocab_size":152064,"hidden_size":3584,"intermediate_size":18944,
                "num_hidden_layers":28,"num_attention_heads":28,"num_key_value_heads":4,"rope_theta":1000000.0,
                "rms_norm_eps":1e-6,"max_position_embeddings":32768}"#
            }
            _ => return None,
        };
        Self::from_hf_json(json).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugging_face_configs_of_both_generations_read_their_rope() {
        let base = r#""model_type":"qwen2","vocab_size":10,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1"#;
        let old = ModelConfig::from_hf_json(&format!("{{{base},\"rope_theta\":1000000.0}}")).unwrap();
        let new = ModelConfig::from_hf_json(&format!(
            "{{{base},\"rope_parameters\":{{\"rope_type\":\"default\",\"rope_theta\":1000000.0}}}}"
        ))
        .unwrap();
        assert_eq!((old.rope_theta, new.rope_theta), (1e6, 1e6));
        assert!(old.qkv_bias && old.rope_style == RopeStyle::Halves);
        let scaled = ModelConfig::from_hf_json(&format!(
            "{{{base},\"rope_scaling\":{{\"rope_type\":\"llama3\",\"factor\":8.0}}}}"
        ))
        .unwrap_err()
        .to_string();
        assert!(scaled.contains("llama3"), "{scaled}");
        // A null rope_parameters does not hide the older key.
        let hidden = ModelConfig::from_hf_json(&format!(
            "{{{base},\"rope_parameters\":null,\"rope_scaling\":{{\"type\":\"yarn\"}}}}"
        ));
        assert!(hidden.unwrap_err().to_string().contains("yarn"));
        // What the layer loop does not compute is refused by name.
        for (extra, key) in [
            (r#""mlp_bias":true"#, "mlp_bias"),
            (r#""use_sliding_window":true"#, "use_sliding_window"),
            (r#""hidden_act":"gelu""#, "hidden_act"),
        ] {
            let err = ModelConfig::from_hf_json(&format!("{{{base},{extra}}}"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{extra}: {err}");
        }
        let llama = base.replace("qwen2", "llama");
        let err = ModelConfig::from_hf_json(&format!("{{{llama},\"attention_bias\":true}}")).unwrap_err();
        assert!(err.to_string().contains("attention_bias"), "{err}");
        let zero = base.replace("\"num_hidden_layers\":1", "\"num_hidden_layers\":0");
        assert!(ModelConfig::from_hf_json(&format!("{{{zero}}}")).is_err());
        let long = ModelConfig::from_hf_json(&format!("{{{base},\"max_position_embeddings\":100000000000}}"));
        assert!(long.unwrap_err().to_string().contains("context length"));
        assert_eq!(ModelConfig::preset("llama-3.1-8b").unwrap().num_kv_heads, 8);
        assert!(ModelConfig::preset("gpt-5").is_none());
    }
}
