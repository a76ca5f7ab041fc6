//! Hugging Face model directories, the format users download: `config.json`, one or more
//! `*.safetensors` shards (with `model.safetensors.index.json` when there are several),
//! `tokenizer.json` and `tokenizer_config.json`. Tensors are read by their Hugging Face names
//! and converted to f32 for the backend to place; every problem is a typed error naming the
//! file or the tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use super::config::ModelConfig;
use super::error::{Result, RuntimeError};

/// Whether `path` is a model directory rather than a GGUF file.
pub fn is_model_dir(path: &Path) -> bool {
    path.is_dir()
}

pub fn config(dir: &Path) -> Result<(ModelConfig, bool)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|_| RuntimeError::ModelNotFound(path.clone()))?;
    let config = ModelConfig::from_hf_json(&text)?;
    let tied = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("tie_word_embeddings").and_then(|t| t.as_bool()))
        .unwrap_or(false);
    Ok((config, tied))
}

/// The shards of a directory, memory-mapped, and which shard holds each tensor.
pub struct Shards {
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    by_name: HashMap<String, usize>,
}

fn corrupt(path: &Path, reason: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::CorruptModel {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

impl Shards {
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        // With an index, it decides which shard holds each tensor; without, the single file.
        let (files, index_map): (Vec<PathBuf>, Option<HashMap<String, PathBuf>>) = if index.is_file() {
            let text = std::fs::read_to_string(&index).map_err(|e| corrupt(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| corrupt(&index, e))?;
            let map: HashMap<String, PathBuf> = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| corrupt(&index, "no weight_map"))?
                .iter()
                .filter_map(|(name, f)| f.as_str().map(|f| (name.clone(), dir.join(f))))
                .collect();
            let mut files: Vec<PathBuf> = map.values().cloned().collect();
            files.sort();
            files.dedup();
            (files, Some(map))
        } else {
            let single = dir.join("model.safetensors");
            if !single.is_file() {
                return Err(RuntimeError::ModelNotFound(single));
            }
            (vec![single], None)
        };
        let mut maps = Vec::new();
        let mut by_name = HashMap::new();
        for file in files {
            let f = std::fs::File::open(&file).map_err(|e| corrupt(&file, format!("a shard of the model: {e}")))?;
            // SAFETY: the file is opened read-only; a concurrent writer would be a user error
            // that at worst corrupts weights, as with any memory-mapped loader.
            let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| corrupt(&file, e))?;
            let (_, meta) = SafeTensors::read_metadata(&map).map_err(|e| corrupt(&file, e))?;
            for name in meta.tensors().keys() {
                let listed = index_map.as_ref().is_none_or(|m| m.get(name) == Some(&file));
                if listed {
                    by_name.insert(name.clone(), maps.len());
                }
            }
            maps.push((file, map));
        }
        Ok(Shards { maps, by_name })
    }

    pub fn has(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// A tensor of exactly `shape`, as f32 (from bf16, f16 or f32).
    pub fn read(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let bad = |reason: String| RuntimeError::BadTensor {
            name: name.into(),
            reason,
        };
        let &i = self
            .by_name
            .get(name)
            .ok_or_else(|| bad("missing from every shard".into()))?;
        let (path, map) = &self.maps[i];
        let st = SafeTensors::deserialize(map).map_err(|e| corrupt(path, e))?;
        let view = st.tensor(name).map_err(|e| bad(e.to_string()))?;
        if view.shape() != shape {
            return Err(bad(format!("shape {:?}, expected {shape:?}", view.shape())));
        }
        let bytes = view.data();
        let values = match view.dtype() {
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            other => return Err(bad(format!("dtype {other:?}: bf16, f16 or f32 expected"))),
        };
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_model(dir: &Path, q_dtype: Dtype, q_shape: Vec<usize>) {
        std::fs::write(
            dir.join("config.json"),
            r#"{"model_type":"llama","vocab_size":10,"hidden_size":4,"intermediate_size":8,
            "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"tie_word_embeddings":true}"#,
        )
        .unwrap();
        let n: usize = q_shape.iter().product();
        let q: Vec<u8> = match q_dtype {
            Dtype::F32 => (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect(),
            Dtype::BF16 => (0..n)
                .flat_map(|i| half::bf16::from_f32(i as f32).to_le_bytes())
                .collect(),
            other => vec![0; n * other.bitsize() / 8],
        };
        let view = safetensors::tensor::TensorView::new(q_dtype, q_shape, &q).unwrap();
        safetensors::serialize_to_file(
            [("model.layers.0.self_attn.q_proj.weight", view)],
            None,
            &dir.join("model.safetensors"),
        )
        .unwrap();
    }

    #[test]
    fn tensors_read_by_name_and_bad_ones_are_typed_errors() {
        let dir = std::env::temp_dir().join(format!("quarry-hf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_model(&dir, Dtype::BF16, vec![4, 4]);
        let (cfg, tied) = config(&dir).unwrap();
        assert_eq!((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tied), (2, 1, 2, true));
        let shards = Shards::open(&dir).unwrap();
        let q = shards.read("model.layers.0.self_attn.q_proj.weight", &[4, 4]).unwrap();
        assert_eq!(q, (0..16).map(|i| i as f32).collect::<Vec<_>>());
        let err = shards
            .read("model.layers.0.self_attn.q_proj.weight", &[2, 8])
            .unwrap_err()
            .to_string();
        assert!(err.contains("shape [4, 4], expected [2, 8]"), "{err}");
        let err = shards.read("model.norm.weight", &[4]).unwrap_err().to_string();
        assert!(err.contains("model.norm.weight") && err.contains("missing"), "{err}");

        write_model(&dir, Dtype::I64, vec![4, 4]);
        let err = Shards::open(&dir)
            .unwrap()
            .read("model.layers.0.self_attn.q_proj.weight", &[4, 4])
            .unwrap_err();
        assert!(err.to_string().contains("dtype I64"), "{err}");

        std::fs::write(
            dir.join("model.safetensors.index.json"),
            r#"{"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let err = Shards::open(&dir).err().expect("a missing shard").to_string();
        assert!(err.contains("model-00001-of-00002.safetensors"), "{err}");
        std::fs::write(dir.join("config.json"), r#"{"model_type":"gpt2"}"#).unwrap();
        assert!(matches!(config(&dir), Err(RuntimeError::UnsupportedArchitecture(a)) if a == "gpt2"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
