//! Which device runs the model: `--device auto|cpu|cuda[:N]`. The CUDA driver is opened at run
//! time, so the probe looks for the library before anything touches it (cudarc panics when it
//! is missing) and says why a GPU cannot be used.

use std::fmt;
use std::str::FromStr;

use super::error::{Result, RuntimeError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The first GPU when there is one, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("`{s}` is not a device (auto, cpu, cuda or cuda:N)")),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Auto => write!(f, "auto"),
            DeviceChoice::Cpu => write!(f, "cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The device a choice comes to on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

/// Whether the GPU tests must run here: `QUARRY_TEST_DEVICE=cuda`, which scripts/gpu-check sets
/// on the GPU machine. There a test that cannot find its GPU or model fails; elsewhere (CI has
/// no GPU) it skips with a message.
pub fn gpu_tests_required() -> bool {
    std::env::var("QUARRY_TEST_DEVICE").is_ok_and(|d| d.trim().to_ascii_lowercase().starts_with("cuda"))
}

/// A GPU test's way in: the number of GPUs, or `None` after saying why the test skips; where
/// the GPU tests are required, a missing GPU is a panic instead.
pub fn cuda_for_test() -> Option<usize> {
    match cuda_devices() {
        Ok(n) => Some(n),
        Err(why) if gpu_tests_required() => panic!("QUARRY_TEST_DEVICE asks for the GPU, but: {why}"),
        Err(why) => {
            eprintln!("skipping: {why}");
            None
        }
    }
}

/// The oldest driver whose API the bindings are built for (the `cuda-13000` feature): calls
/// into an older one can reach symbols it lacks.
const MIN_DRIVER: i32 = 13000;

/// Why no GPU can be used here, or how many there are. Every library the backend opens is
/// looked for first: cudarc panics when one is missing.
pub fn cuda_devices() -> std::result::Result<usize, String> {
    // SAFETY: these only open the libraries by name to see whether they are there.
    let (driver, nvrtc, cublas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublaslt::sys::is_culib_present(),
        )
    };
    if !driver {
        return Err("no CUDA driver library (libcuda.so) on this machine".into());
    }
    if !nvrtc {
        return Err("no NVRTC library (libnvrtc.so, CUDA 13) to compile the kernels".into());
    }
    if !cublas {
        return Err("no cuBLASLt library (libcublasLt.so, CUDA 13)".into());
    }
    cudarc::driver::result::init().map_err(|e| format!("the CUDA driver did not start: {e}"))?;
    let mut version = 0;
    // SAFETY: writes one int; the driver is initialised.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    if version < MIN_DRIVER {
        return Err(format!(
            "the driver supports CUDA {}.{}, the GPU backend needs {}.{} or later",
            version / 1000,
            version % 1000 / 10,
            MIN_DRIVER / 1000,
            MIN_DRIVER % 1000 / 10
        ));
    }
    match cudarc::driver::result::device::get_count() {
        Ok(0) => Err("the CUDA driver sees no GPU".into()),
        Ok(n) => Ok(n as usize),
        Err(e) => Err(format!("cannot count GPUs: {e}")),
    }
}

impl DeviceChoice {
    /// The device to use. `auto` falls back to the CPU with one line on stderr saying why; an
    /// explicit `cuda` that cannot be had is an error.
    pub fn resolve(self) -> Result<Device> {
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Auto => match cuda_devices() {
                Ok(_) => Ok(Device::Cuda(0)),
                Err(why) => {
                    tracing::warn!("quarry: running on the CPU: {why}");
                    Ok(Device::Cpu)
                }
            },
            DeviceChoice::Cuda(n) => match cuda_devices() {
                Ok(count) if n < count => Ok(Device::Cuda(n)),
                Ok(count) => Err(RuntimeError::Device(format!(
                    "cuda:{n} asked for, this machine has {count} GPU(s)"
                ))),
                Err(why) => Err(RuntimeError::Device(why)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse() {
        assert_eq!("auto".parse(), Ok(DeviceChoice::Auto));
        assert_eq!("CPU".parse(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceChoice::Cuda(3)));
        assert!("cuda:x".parse::<DeviceChoice>().unwrap_err().contains("cuda:N"));
        assert!("tpu".parse::<DeviceChoice>().is_err());
    }
}
