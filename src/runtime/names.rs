//! Where each weight of a llama-family decoder lives in each file format.

/// One weight of a decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    AttnNorm,
    Q,
    K,
    V,
    QBias,
    KBias,
    VBias,
    AttnOut,
    FfnNorm,
    Gate,
    Up,
    Down,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Gguf,
    HuggingFace,
}

impl Format {
    pub fn embedding(self) -> &'static str {
        match self {
            Format::Gguf => "token_embd.weight",
            Format::HuggingFace => "model.embed_tokens.weight",
        }
    }

    pub fn output_norm(self) -> &'static str {
        match self {
            Format::Gguf => "output_norm.weight",
            Format::HuggingFace => "model.norm.weight",
        }
    }

    /// The output head; absent where it is tied to the embedding.
    pub fn head(self) -> &'static str {
        match self {
            Format::Gguf => "output.weight",
            Format::HuggingFace => "lm_head.weight",
        }
    }

    pub fn layer(self, i: usize, part: Part) -> String {
        let (gguf, hf) = match part {
            Part::AttnNorm => ("attn_norm.weight", "input_layernorm.weight"),
            Part::Q => ("attn_q.weight", "self_attn.q_proj.weight"),
            Part::K => ("attn_k.weight", "self_attn.k_proj.weight"),
            Part::V => ("attn_v.weight", "self_attn.v_proj.weight"),
            Part::QBias => ("attn_q.bias", "self_attn.q_proj.bias"),
            Part::KBias => ("attn_k.bias", "self_attn.k_proj.bias"),
            Part::VBias => ("attn_v.bias", "self_attn.v_proj.bias"),
            Part::AttnOut => ("attn_output.weight", "self_attn.o_proj.weight"),
            Part::FfnNorm => ("ffn_norm.weight", "post_attention_layernorm.weight"),
            Part::Gate => ("ffn_gate.weight", "mlp.gate_proj.weight"),
            Part::Up => ("ffn_up.weight", "mlp.up_proj.weight"),
            Part::Down => ("ffn_down.weight", "mlp.down_proj.weight"),
        };
        match self {
            Format::Gguf => format!("blk.{i}.{gguf}"),
            Format::HuggingFace => format!("model.layers.{i}.{hf}"),
        }
    }
}
