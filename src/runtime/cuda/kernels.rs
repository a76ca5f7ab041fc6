//! The CUDA kernels (kernels/*.cu, embedded in the binary), compiled by NVRTC for the device's
//! architecture on first use and kept on disk, keyed by source, architecture and driver
//! version, so a restart loads them instead of compiling again.

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::runtime::error::{Result, RuntimeError};

const PRELUDE: &str = include_str!("../../../kernels/prelude.cuh");

/// Each file and the kernels it defines.
const SOURCES: &[(&str, &str, &[&str])] = &[
    (
        "embedding.cu",
        include_str!("../../../kernels/embedding.cu"),
        &["embedding", "take_drawn_tokens"],
    ),
    ("norm.cu", include_str!("../../../kernels/norm.cu"), &["add_rms_norm"]),
    ("bias.cu", include_str!("../../../kernels/bias.cu"), &["add_bias"]),
    (
        "cache.cu",
        include_str!("../../../kernels/cache.cu"),
        &["rope_and_cache", "kv_gather", "kv_scatter"],
    ),
    (
        "attention.cu",
        include_str!("../../../kernels/attention.cu"),
        &["paged_attention", "attention_merge"],
    ),
    (
        "flash_attention.cu",
        include_str!("../../../kernels/flash_attention.cu"),
        &["flash_attention_d64", "flash_attention_d128", "flash_merge"],
    ),
    (
        "gemv.cu",
        include_str!("../../../kernels/gemv.cu"),
        &[
            "gemv_bf16",
            "gemv_mma",
            "gemv_mma_two_groups",
            "gemv_mma_three_groups",
            "gemv_mma_add",
            "gemv_mma_two_groups_add",
            "gemv_mma_three_groups_add",
            "gemv_mma_silu",
            "gemv_mma_rope",
            "gemv_mma_rope_three",
            "gemv_mma_rope_norm",
            "gemv_mma_rope_three_norm",
            "gemm_mma",
            "gemm_mma_wide",
            "gemm_wgmma",
            "gemm_wgmma_p",
            "gemm_wgmma_wide",
            "gemm_wgmma_wide_p",
            "permute_k32",
        ],
    ),
    (
        "activation.cu",
        include_str!("../../../kernels/activation.cu"),
        &["silu_mul", "silu_mul4"],
    ),
    (
        "sampling.cu",
        include_str!("../../../kernels/sampling.cu"),
        &[
            "shape_scores",
            "apply_penalties",
            "restore_values",
            "logprob_stats",
            "chosen_values",
            "drawn_confidence",
            "argmax",
            "sample_rows",
            "philox_raw",
        ],
    ),
    (
        "random.cu",
        include_str!("../../../kernels/random.cu"),
        &["fill_uniform_bf16"],
    ),
];

pub struct Kernels {
    pub embedding: CudaFunction,
    pub add_rms_norm: CudaFunction,
    pub add_bias: CudaFunction,
    pub rope_and_cache: CudaFunction,
    pub kv_gather: CudaFunction,
    pub kv_scatter: CudaFunction,
    pub paged_attention: CudaFunction,
    pub attention_merge: CudaFunction,
    pub flash_attention_d64: CudaFunction,
    pub flash_attention_d128: CudaFunction,
    pub flash_merge: CudaFunction,
    pub gemv_bf16: CudaFunction,
    pub gemv_mma: CudaFunction,
    pub gemv_mma_two_groups: CudaFunction,
    pub gemv_mma_three_groups: CudaFunction,
    pub gemv_mma_add: CudaFunction,
    pub gemv_mma_two_groups_add: CudaFunction,
    pub gemv_mma_three_groups_add: CudaFunction,
    pub gemv_mma_silu: CudaFunction,
    pub gemv_mma_rope: CudaFunction,
    pub gemv_mma_rope_three: CudaFunction,
    pub gemv_mma_rope_norm: CudaFunction,
    pub gemv_mma_rope_three_norm: CudaFunction,
    pub gemm_mma: CudaFunction,
    pub gemm_mma_wide: CudaFunction,
    pub gemm_wgmma: CudaFunction,
    pub gemm_wgmma_p: CudaFunction,
    pub gemm_wgmma_wide: CudaFunction,
    pub gemm_wgmma_wide_p: CudaFunction,
    pub permute_k32: CudaFunction,
    /// Whether the kernels were compiled for sm_90a, with wgmma (the prelude's `HAS_WGMMA`);
    /// elsewhere the wgmma kernels are empty.
    pub wgmma: bool,
    pub silu_mul: CudaFunction,
    pub silu_mul4: CudaFunction,
    pub take_drawn_tokens: CudaFunction,
    pub shape_scores: CudaFunction,
    pub apply_penalties: CudaFunction,
    pub restore_values: CudaFunction,
    pub logprob_stats: CudaFunction,
    pub chosen_values: CudaFunction,
    pub drawn_confidence: CudaFunction,
    pub argmax: CudaFunction,
    pub sample_rows: CudaFunction,
    #[cfg_attr(not(test), allow(dead_code))]
    pub philox_raw: CudaFunction,
    pub fill_uniform_bf16: CudaFunction,
}

/// One row's sampling parameters, laid out as `SampleParams` in kernels/sampling.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SampleParams {
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    /// The request's output index: with the seed, all a draw depends on.
    pub counter: u64,
}

// SAFETY: plain old data with the C layout the kernel reads.
unsafe impl cudarc::driver::DeviceRepr for SampleParams {}

/// The architecture NVRTC compiles for: compute capability 9.0 as sm_90a, whose wgmma the flash
/// attention kernel uses (PTX for sm_90a loads only on 9.0 devices, the only ones it is built
/// for); others as they are.
pub fn nvrtc_arch(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "90a".into()
    } else {
        format!("{major}{minor}")
    }
}

/// The PTX NVRTC makes of one kernel file for `arch` (uncached).
#[cfg(test)]
pub fn ptx_of(file: &str, arch: &str) -> Result<String> {
    let (_, source, _) = SOURCES
        .iter()
        .find(|(f, _, _)| *f == file)
        .ok_or_else(|| RuntimeError::Device(format!("no kernel file {file}")))?;
    Ok(compiled(file, source, arch, driver_version(), false)?.0.to_src())
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| RuntimeError::Device(format!("reading the compute capability: {e}")))?;
        Self::load_for(ctx, &nvrtc_arch(major, minor))
    }

    /// `load` for the NVRTC architecture `arch` (on Hopper, "90" gives the kernels without wgmma).
    pub fn load_for(ctx: &Arc<CudaContext>, arch: &str) -> Result<Self> {
        let driver = driver_version();
        let mut functions = std::collections::HashMap::new();
        for (file, source, names) in SOURCES {
            let (ptx, cached) = compiled(file, source, arch, driver, true)?;
            let module = match (ctx.load_module(ptx), cached) {
                (Ok(m), _) => m,
                // A damaged cache entry: dropped and compiled again.
                (Err(_), Some(path)) => {
                    let _ = std::fs::remove_file(&path);
                    let (ptx, _) = compiled(file, source, arch, driver, false)?;
                    ctx.load_module(ptx)
                        .map_err(|e| RuntimeError::Device(format!("loading kernels/{file}: {e}")))?
                }
                (Err(e), None) => return Err(RuntimeError::Device(format!("loading kernels/{file}: {e}"))),
            };
            for name in *names {
                let f = module
                    .load_function(name)
                    .map_err(|e| RuntimeError::Device(format!("kernel `{name}` in kernels/{file}: {e}")))?;
                functions.insert(*name, f);
            }
        }
        let mut take = |name: &str| functions.remove(name).expect("every listed kernel was loaded");
        let kernels = Kernels {
            embedding: take("embedding"),
            add_rms_norm: take("add_rms_norm"),
            add_bias: take("add_bias"),
            rope_and_cache: take("rope_and_cache"),
            kv_gather: take("kv_gather"),
            kv_scatter: take("kv_scatter"),
            paged_attention: take("paged_attention"),
            attention_merge: take("attention_merge"),
            flash_attention_d64: take("flash_attention_d64"),
            flash_attention_d128: take("flash_attention_d128"),
            flash_merge: take("flash_merge"),
            gemv_bf16: take("gemv_bf16"),
            gemv_mma: take("gemv_mma"),
            gemv_mma_two_groups: take("gemv_mma_two_groups"),
            gemv_mma_three_groups: take("gemv_mma_three_groups"),
            gemv_mma_add: take("gemv_mma_add"),
            gemv_mma_two_groups_add: take("gemv_mma_two_groups_add"),
            gemv_mma_three_groups_add: take("gemv_mma_three_groups_add"),
            gemv_mma_silu: take("gemv_mma_silu"),
            gemv_mma_rope: take("gemv_mma_rope"),
            gemv_mma_rope_three: take("gemv_mma_rope_three"),
            gemv_mma_rope_norm: take("gemv_mma_rope_norm"),
            gemv_mma_rope_three_norm: take("gemv_mma_rope_three_norm"),
            gemm_mma: take("gemm_mma"),
            gemm_mma_wide: take("gemm_mma_wide"),
            gemm_wgmma: take("gemm_wgmma"),
            gemm_wgmma_p: take("gemm_wgmma_p"),
            gemm_wgmma_wide: take("gemm_wgmma_wide"),
            gemm_wgmma_wide_p: take("gemm_wgmma_wide_p"),
            permute_k32: take("permute_k32"),
            wgmma: arch == "90a",
            silu_mul: take("silu_mul"),
            silu_mul4: take("silu_mul4"),
            take_drawn_tokens: take("take_drawn_tokens"),
            shape_scores: take("shape_scores"),
            apply_penalties: take("apply_penalties"),
            restore_values: take("restore_values"),
            logprob_stats: take("logprob_stats"),
            chosen_values: take("chosen_values"),
            drawn_confidence: take("drawn_confidence"),
            argmax: take("argmax"),
            sample_rows: take("sample_rows"),
            philox_raw: take("philox_raw"),
            fill_uniform_bf16: take("fill_uniform_bf16"),
        };
        super::attention::prepare(&kernels)?;
        super::gemm::prepare(&kernels)?;
        Ok(kernels)
    }
}

/// One kernel of a file outside the set every backend loads (kernels/all_reduce.cu, for a
/// group of GPUs), compiled and cached as the others are.
pub fn load_one(ctx: &Arc<CudaContext>, file: &str, source: &str, name: &str) -> Result<CudaFunction> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| RuntimeError::Device(format!("reading the compute capability: {e}")))?;
    let (ptx, _) = compiled(file, source, &nvrtc_arch(major, minor), driver_version(), true)?;
    ctx.load_module(ptx)
        .and_then(|m| m.load_function(name))
        .map_err(|e| RuntimeError::Device(format!("kernel `{name}` in kernels/{file}: {e}")))
}

fn driver_version() -> i32 {
    let mut v = 0;
    // SAFETY: writes one int; the driver was initialised by the device probe.
    unsafe {
        cudarc::driver::sys::cuDriverGetVersion(&mut v);
    }
    v
}

/// FNV-1a: stable across builds and Rust versions, unlike `DefaultHasher`.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("QUARRY_KERNEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("quarry/kernels")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/quarry/kernels")))?;
    std::fs::create_dir_all(&base).ok()?;
    Some(base)
}

/// The PTX of one file, from the disk cache (with its path) when `use_cache` and it is there,
/// else from NVRTC.
fn compiled(file: &str, source: &str, arch: &str, driver: i32, use_cache: bool) -> Result<(Ptx, Option<PathBuf>)> {
    let full = format!("{PRELUDE}\n#line 1 \"{file}\"\n{source}");
    let key = format!(
        "{}-{:016x}-sm{arch}-drv{driver}.ptx",
        file.trim_end_matches(".cu"),
        fnv(full.as_bytes())
    );
    let cached = cache_dir().map(|d| d.join(&key));
    if let (true, Some(path)) = (use_cache, cached.as_ref()) {
        if let Ok(text) = std::fs::read_to_string(path) {
            return Ok((Ptx::from_src(text), Some(path.clone())));
        }
    }
    let options = CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{arch}"), "--std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&full, options).map_err(|e| {
        let detail = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        };
        RuntimeError::Device(format!("compiling kernels/{file} (NVRTC, sm_{arch}): {detail}"))
    })?;
    if let Some(path) = cached {
        // Written whole, then renamed: a concurrent start never reads half a file.
        // Unique per writer, also across containers that share the cache and a pid.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tmp = path.with_extension(format!("tmp{}-{nanos}", std::process::id()));
        if std::fs::write(&tmp, ptx.to_src()).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok((ptx, None))
}
