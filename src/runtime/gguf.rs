//! Opening a GGUF file with typed errors: a missing file, a truncated or corrupt one and a
//! metadata key of the wrong type each get their own message.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;

use super::error::{Result, RuntimeError};

pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(RuntimeError::ModelNotFound(path.to_path_buf()));
        }
        let corrupt = |reason: String| RuntimeError::CorruptModel {
            path: path.to_path_buf(),
            reason,
        };
        let file = File::open(path).map_err(|e| corrupt(e.to_string()))?;
        let file_len = file.metadata().map_err(|e| corrupt(e.to_string()))?.len();
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| corrupt(format!("not a valid GGUF file ({e})")))?;
        // A truncated download parses fine up to the tensor data; catch it before loading.
        for (name, info) in &content.tensor_infos {
            let bytes = info.shape.elem_count() / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
            let end = content.tensor_data_offset + info.offset + bytes as u64;
            if end > file_len {
                return Err(corrupt(format!(
                    "tensor `{name}` ends at byte {end} but the file has {file_len} bytes (truncated?)"
                )));
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn content(&self) -> &Content {
        &self.content
    }

    pub fn value(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn required(&self, key: &str) -> Result<&Value> {
        self.value(key).ok_or_else(|| RuntimeError::BadMetadata {
            key: key.into(),
            reason: "missing".into(),
        })
    }

    pub fn string(&self, key: &str) -> Result<String> {
        let v = self.required(key)?;
        v.to_string().cloned().map_err(|e| bad_type(key, e))
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        let v = self.required(key)?;
        let n = v.to_u64().map_err(|e| bad_type(key, e))?;
        usize::try_from(n).map_err(|_| bad_type(key, format!("{n} out of range")))
    }

    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.value(key).is_none() {
            return Ok(default);
        }
        self.usize(key)
    }

    pub fn f32_or(&self, key: &str, default: f32) -> Result<f32> {
        match self.value(key) {
            None => Ok(default),
            Some(v) => v.to_f32().map_err(|e| bad_type(key, e)),
        }
    }

    pub fn array(&self, key: &str) -> Result<&Vec<Value>> {
        self.required(key)?.to_vec().map_err(|e| bad_type(key, e))
    }

    pub fn array_len(&self, key: &str) -> Result<usize> {
        Ok(self.array(key)?.len())
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(RuntimeError::BadTensor {
                name: name.into(),
                reason: "missing from the model file".into(),
            });
        }
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| RuntimeError::BadTensor {
                name: name.into(),
                reason: e.to_string(),
            })
    }
}

fn bad_type(key: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::BadMetadata {
        key: key.into(),
        reason: e.to_string(),
    }
}
