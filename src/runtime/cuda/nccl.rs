//! NCCL, opened by us rather than by cudarc. cudarc 0.19 tries `libnccl.so`, numbered
//! variants and `libnccl.so.13` (after the CUDA major, not NCCL's), takes the first that opens,
//! and panics where none does. On the device's 2-GPU host its first name opens (the system's
//! 2.28.3); PyTorch's install holds another copy (2.28.9) under `libnccl.so.2` only. So:
//! `QUARRY_NCCL_LIBRARY` if set, else `libnccl.so.2`, else `libnccl.so`; the version it reports
//! is checked against the ABI declared below (NCCL 2, from 2.19: bf16 reductions,
//! `ncclGetLastError`); missing or too old is an error that says what to do, never a panic.
//!
//! One process drives every local GPU (`Group::local`, `ncclCommInitAll`): a collective over
//! the group is one NCCL group call with a rank per device.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

use cudarc::driver::sys::CUstream;
use cudarc::driver::CudaStream;

use crate::runtime::RuntimeError;

type NcclResult = c_int;
const SUCCESS: NcclResult = 0;
/// `ncclDataType_t` values (nccl.h, stable across NCCL 2).
pub const FLOAT32: c_int = 7;
pub const BFLOAT16: c_int = 9;
const UINT8: c_int = 1;
const SUM: c_int = 0;
/// The oldest NCCL these bindings accept, as `ncclGetVersion` encodes it (major * 10000 +
/// minor * 100 + patch).
const OLDEST: c_int = 21900;

#[repr(C)]
pub struct CommOpaque {
    _private: [u8; 0],
}
type Comm = *mut CommOpaque;

struct Fns {
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    last_error: unsafe extern "C" fn(Comm) -> *const c_char,
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    comm_abort: unsafe extern "C" fn(Comm) -> NcclResult,
    async_error: unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, CUstream) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, CUstream) -> NcclResult,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, CUstream) -> NcclResult,
}

/// An opened NCCL library.
pub struct Nccl {
    fns: Fns,
    /// Where it was opened from, and its version (major * 10000 + minor * 100 + patch).
    pub path: String,
    pub version: i32,
    // Last: the function pointers above point into it.
    _lib: libloading::Library,
}

impl Nccl {
    /// Opens NCCL (see the module's comment for where it looks).
    pub fn open() -> Result<Arc<Nccl>, RuntimeError> {
        let candidates: Vec<String> = match std::env::var("QUARRY_NCCL_LIBRARY") {
            Ok(p) if !p.is_empty() => vec![p],
            _ => vec!["libnccl.so.2".into(), "libnccl.so".into()],
        };
        Nccl::open_first(&candidates)
    }

    /// The first of `candidates` that opens as a usable NCCL.
    fn open_first(candidates: &[String]) -> Result<Arc<Nccl>, RuntimeError> {
        let mut tried = Vec::new();
        for path in candidates {
            // SAFETY: NCCL's initializers only set up its own state.
            match unsafe { libloading::Library::new(path) } {
                Ok(lib) => return Nccl::from_library(lib, path).map(Arc::new),
                Err(e) => tried.push(format!("{path} ({e})")),
            }
        }
        Err(RuntimeError::Device(format!(
            "NCCL is not found: tried {}. Install NCCL 2 (libnccl2), or point QUARRY_NCCL_LIBRARY at \
             a libnccl.so.2, such as the one in PyTorch's install (site-packages/nvidia/nccl/lib)",
            tried.join(", ")
        )))
    }

    fn from_library(lib: libloading::Library, path: &str) -> Result<Nccl, RuntimeError> {
        // SAFETY: each symbol is NCCL 2's exported function of that name, with the signature of
        // nccl.h that its field declares.
        let fns = unsafe {
            Fns {
                get_version: symbol(&lib, path, "ncclGetVersion")?,
                error_string: symbol(&lib, path, "ncclGetErrorString")?,
                last_error: symbol(&lib, path, "ncclGetLastError")?,
                comm_init_all: symbol(&lib, path, "ncclCommInitAll")?,
                comm_destroy: symbol(&lib, path, "ncclCommDestroy")?,
                comm_abort: symbol(&lib, path, "ncclCommAbort")?,
                async_error: symbol(&lib, path, "ncclCommGetAsyncError")?,
                all_reduce: symbol(&lib, path, "ncclAllReduce")?,
                group_start: symbol(&lib, path, "ncclGroupStart")?,
                group_end: symbol(&lib, path, "ncclGroupEnd")?,
                send: symbol(&lib, path, "ncclSend")?,
                recv: symbol(&lib, path, "ncclRecv")?,
            }
        };
        let mut version: c_int = 0;
        // SAFETY: writes one int.
        let r = unsafe { (fns.get_version)(&mut version) };
        if r != SUCCESS {
            return Err(RuntimeError::Device(format!(
                "NCCL at {path}: ncclGetVersion failed ({r})"
            )));
        }
        if !(OLDEST..30000).contains(&version) {
            return Err(RuntimeError::Device(format!(
                "NCCL at {path} is version {}, and Quarry's bindings are for NCCL 2.19 to 2.x: \
                 point QUARRY_NCCL_LIBRARY at another libnccl.so.2",
                version_text(version)
            )));
        }
        Ok(Nccl {
            fns,
            path: path.to_string(),
            version,
            _lib: lib,
        })
    }

    pub fn version_text(&self) -> String {
        version_text(self.version)
    }

    fn check(&self, r: NcclResult, comm: Option<Comm>, what: &str) -> Result<(), RuntimeError> {
        if r == SUCCESS {
            return Ok(());
        }
        // SAFETY: NCCL returns static, NUL-terminated strings.
        let text = unsafe { CStr::from_ptr((self.fns.error_string)(r)) }.to_string_lossy();
        let detail = comm
            .map(|c| {
                unsafe { CStr::from_ptr((self.fns.last_error)(c)) }
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|d| !d.is_empty())
            .map(|d| format!(" ({d})"))
            .unwrap_or_default();
        Err(RuntimeError::Device(format!("NCCL: {what}: {text}{detail}")))
    }
}

/// A function of the library, as the type `T` its caller declares.
///
/// # Safety
/// `T` must be the function's signature in nccl.h.
unsafe fn symbol<T: Copy>(lib: &libloading::Library, path: &str, name: &str) -> Result<T, RuntimeError> {
    lib.get::<T>(name.as_bytes())
        .map(|s| *s)
        .map_err(|e| RuntimeError::Device(format!("NCCL at {path} lacks {name}: {e}")))
}

fn version_text(v: c_int) -> String {
    format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
}

/// The names cudarc's own loader would try for NCCL, and whether any of them opens here: what
/// made us open NCCL ourselves, shown where the device's libraries are in question.
pub fn cudarc_would_find() -> (Vec<String>, Option<String>) {
    let names = cudarc::get_lib_name_candidates("nccl");
    // SAFETY: as in `Nccl::open`.
    let found = names
        .iter()
        .find(|n| unsafe { libloading::Library::new(n.as_str()) }.is_ok())
        .cloned();
    (names, found)
}

/// Communicators over local devices, rank i on `devices[i]`, driven from one thread.
pub struct Group {
    nccl: Arc<Nccl>,
    comms: Vec<Comm>,
    pub devices: Vec<i32>,
}

// SAFETY: the communicators are used from one thread at a time (`&mut self` for collectives).
unsafe impl Send for Group {}

impl Group {
    /// One communicator per device, every one of them in the group (`ncclCommInitAll`).
    pub fn local(nccl: Arc<Nccl>, devices: &[i32]) -> Result<Group, RuntimeError> {
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: `comms` has room for one communicator per device.
        let r = unsafe { (nccl.fns.comm_init_all)(comms.as_mut_ptr(), devices.len() as c_int, devices.as_ptr()) };
        nccl.check(r, None, "ncclCommInitAll")?;
        Ok(Group {
            nccl,
            comms,
            devices: devices.to_vec(),
        })
    }

    /// Sums `count` elements of `dtype` in place across the ranks: rank i's buffer at
    /// `buffers[i]` (a device pointer on its device), queued on `streams[i]`.
    pub fn all_reduce_sum(
        &mut self,
        buffers: &[u64],
        streams: &[CUstream],
        count: usize,
        dtype: c_int,
    ) -> Result<(), RuntimeError> {
        if buffers.len() != self.comms.len() || streams.len() != self.comms.len() {
            return Err(RuntimeError::InvalidBatch(format!(
                "an all-reduce over {} ranks was given {} buffers and {} streams",
                self.comms.len(),
                buffers.len(),
                streams.len()
            )));
        }
        let f = &self.nccl.fns;
        // SAFETY: each buffer holds `count` elements on its rank's device; the group call
        // launches every rank's part before any of them waits on the others.
        unsafe {
            self.nccl.check((f.group_start)(), None, "ncclGroupStart")?;
            let mut first_error = Ok(());
            for ((&comm, &buffer), &stream) in self.comms.iter().zip(buffers).zip(streams) {
                let p = buffer as *mut c_void;
                let r = (f.all_reduce)(p, p, count, dtype, SUM, comm, stream);
                if first_error.is_ok() {
                    first_error = self.nccl.check(r, Some(comm), "ncclAllReduce");
                }
            }
            let ended = self.nccl.check((f.group_end)(), None, "ncclGroupEnd");
            first_error.and(ended)
        }
    }

    /// The first asynchronous error any communicator reports (a peer that failed or stalled).
    pub fn async_error(&self) -> Result<(), RuntimeError> {
        for &comm in &self.comms {
            let mut r: NcclResult = SUCCESS;
            // SAFETY: writes one result.
            let got = unsafe { (self.nccl.fns.async_error)(comm, &mut r) };
            self.nccl.check(got, Some(comm), "ncclCommGetAsyncError")?;
            self.nccl.check(r, Some(comm), "a collective failed")?;
        }
        Ok(())
    }

    /// Sends `bytes` bytes from rank `from`'s buffer to rank `to`'s, each queued on its rank's
    /// stream, in one group call: point-to-point connections are made by a pair's first
    /// transfer, which needs both ranks at once, so a link makes it before its ranks go to
    /// threads that send and receive apart.
    pub fn send_recv(
        &mut self,
        from: usize,
        to: usize,
        buffers: [u64; 2],
        streams: [CUstream; 2],
        bytes: usize,
    ) -> Result<(), RuntimeError> {
        let f = &self.nccl.fns;
        let (sender, receiver) = (self.comms[from], self.comms[to]);
        // SAFETY: each buffer holds `bytes` bytes on its rank's device; the group call queues
        // both halves before either waits on the other.
        unsafe {
            self.nccl.check((f.group_start)(), None, "ncclGroupStart")?;
            let sent = (f.send)(
                buffers[0] as *const c_void,
                bytes,
                UINT8,
                to as c_int,
                sender,
                streams[0],
            );
            let received = (f.recv)(
                buffers[1] as *mut c_void,
                bytes,
                UINT8,
                from as c_int,
                receiver,
                streams[1],
            );
            let ended = self.nccl.check((f.group_end)(), None, "ncclGroupEnd");
            self.nccl
                .check(sent, Some(sender), "ncclSend")
                .and(self.nccl.check(received, Some(receiver), "ncclRecv"))
                .and(ended)
        }
    }

    /// Ends every communicator at once, collectives in flight included (a failed group).
    pub fn abort(mut self) {
        for comm in std::mem::take(&mut self.comms) {
            // SAFETY: each communicator is aborted once and not used again.
            unsafe { (self.nccl.fns.comm_abort)(comm) };
        }
    }
}

impl Group {
    /// The communicators apart, one for each rank's own thread (a thread a GPU, as tensor
    /// parallelism drives them).
    pub fn into_ranks(mut self) -> Vec<RankComm> {
        std::mem::take(&mut self.comms)
            .into_iter()
            .map(|comm| RankComm {
                nccl: self.nccl.clone(),
                comm,
            })
            .collect()
    }
}

/// One rank's communicator, driven by its GPU's thread alone: its collectives are single
/// calls, since every other rank's thread makes its own.
pub struct RankComm {
    nccl: Arc<Nccl>,
    comm: Comm,
}

// SAFETY: a communicator may move between threads; it is used by one at a time (`&self`
// methods queue work on a stream the caller owns, and NCCL locks a communicator's state).
unsafe impl Send for RankComm {}
unsafe impl Sync for RankComm {}

impl RankComm {
    /// `out` = the sum over ranks of `input`, `count` f32 values on this rank's device,
    /// queued on `stream`.
    pub fn all_reduce_f32(&self, input: u64, out: u64, count: usize, stream: &CudaStream) -> Result<(), RuntimeError> {
        let f = &self.nccl.fns;
        // SAFETY: both buffers hold `count` floats on this rank's device.
        let r = unsafe {
            (f.all_reduce)(
                input as *const c_void,
                out as *mut c_void,
                count,
                FLOAT32,
                SUM,
                self.comm,
                stream.cu_stream(),
            )
        };
        self.nccl.check(r, Some(self.comm), "ncclAllReduce")
    }

    /// Queues sending `bytes` bytes at `buffer` (on this rank's device) to rank `peer`, which
    /// receives them with `recv` in the same order.
    pub fn send(&self, buffer: u64, bytes: usize, peer: usize, stream: &CudaStream) -> Result<(), RuntimeError> {
        // SAFETY: the buffer holds `bytes` bytes on this rank's device until the stream passes.
        let r = unsafe {
            (self.nccl.fns.send)(
                buffer as *const c_void,
                bytes,
                UINT8,
                peer as c_int,
                self.comm,
                stream.cu_stream(),
            )
        };
        self.nccl.check(r, Some(self.comm), "ncclSend")
    }

    /// Queues receiving `bytes` bytes from rank `peer` into `buffer`.
    pub fn recv(&self, buffer: u64, bytes: usize, peer: usize, stream: &CudaStream) -> Result<(), RuntimeError> {
        // SAFETY: the buffer has room for `bytes` bytes on this rank's device.
        let r = unsafe {
            (self.nccl.fns.recv)(
                buffer as *mut c_void,
                bytes,
                UINT8,
                peer as c_int,
                self.comm,
                stream.cu_stream(),
            )
        };
        self.nccl.check(r, Some(self.comm), "ncclRecv")
    }

    /// An error a collective of this rank's reported since (a peer that failed or stalled).
    pub fn async_error(&self) -> Result<(), RuntimeError> {
        let mut r: NcclResult = SUCCESS;
        // SAFETY: writes one result.
        let got = unsafe { (self.nccl.fns.async_error)(self.comm, &mut r) };
        self.nccl.check(got, Some(self.comm), "ncclCommGetAsyncError")?;
        self.nccl.check(r, Some(self.comm), "a collective failed")
    }
}

impl Drop for RankComm {
    fn drop(&mut self) {
        // SAFETY: destroyed once, after its last use.
        unsafe { (self.nccl.fns.comm_destroy)(self.comm) };
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        for &comm in &self.comms {
            // SAFETY: each communicator is destroyed once, after its last use.
            unsafe { (self.nccl.fns.comm_destroy)(comm) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_nccl_encodes_them() {
        assert_eq!(version_text(22803), "2.28.3");
        assert_eq!(version_text(21900), "2.19.0");
    }

    #[test]
    fn a_missing_library_is_an_error_that_says_where_to_point() {
        // A path that cannot exist: the error names it and the variable, with no panic.
        let e = Nccl::open_first(&["/nonexistent/libnccl.so.2".into()])
            .err()
            .expect("no NCCL there")
            .to_string();
        assert!(e.contains("/nonexistent/libnccl.so.2"), "{e}");
        assert!(e.contains("QUARRY_NCCL_LIBRARY"), "{e}");
    }
}
