//! NCCL, opened by us rather than by cudarc. cudarc 0.19 tries `libnccl.so`, numbered
//! variants and `libnccl.so.13` (after the CUDA major, not NCCL's), takes the first that opens,
//! and panics where none does. On the device's 2-GPU host its first name opens (the system's
//! 2.28.3); PyTorch's install holds another copy (2.28.9) under `libnccl.so.2` only. So:
//! `QUARRY_NCCL_LIBRARY` if set, else `libnccl.so.2`, else `libnccl.so`; the version it reports
//! is checked against the ABI declared below (NCCL 2, from 2.19: bf16 reductions,
//! `ncclGetLastError`); missing or too old is an error that says what to do, never a panic.
//!
//! One process drives every local GPU (`Group::local`, `ncclCommInitAll`): a collective over
//! the group is one NCCL group call with a rank per device. A KV link's two GPUs get a pair of
//! nonblocking communicators instead (`pair`, `ncclCommInitRankConfig`), which either end can
//! abort when a transfer stalls.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaContext, CudaStream};

use crate::runtime::RuntimeError;

type NcclResult = c_int;
const SUCCESS: NcclResult = 0;
/// A nonblocking communicator's call still under way (`ncclInProgress`).
const IN_PROGRESS: NcclResult = 7;
/// `ncclDataType_t` values (nccl.h, stable across NCCL 2).
pub const FLOAT32: c_int = 7;
pub const BFLOAT16: c_int = 9;
const UINT8: c_int = 1;
const SUM: c_int = 0;
/// The oldest NCCL these bindings accept, as `ncclGetVersion` encodes it (major * 10000 +
/// minor * 100 + patch).
const OLDEST: c_int = 21900;

/// `ncclUniqueId`: what every rank of a new communicator is given.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

/// NCCL's "not set" for a config's integers.
const UNDEF_INT: c_int = c_int::MIN;

/// `ncclConfig_t` as NCCL 2.19 lays it out. A later NCCL copies `size` bytes of it and, by
/// `version`, takes its defaults for every field that version lacked (init.cc's
/// `parseCommConfig`), so this struct serves every NCCL these bindings accept.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
    _pad: c_int,
}

impl Config {
    /// Nonblocking: calls return at once (`IN_PROGRESS`), and `ncclCommAbort` can end a
    /// communicator whose kernel waits for a peer that never comes.
    fn nonblocking() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: OLDEST as u32,
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
            _pad: 0,
        }
    }
}

#[repr(C)]
pub struct CommOpaque {
    _private: [u8; 0],
}
type Comm = *mut CommOpaque;

struct Fns {
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank_config: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> NcclResult,
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
                get_unique_id: symbol(&lib, path, "ncclGetUniqueId")?,
                comm_init_rank_config: symbol(&lib, path, "ncclCommInitRankConfig")?,
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

/// How long a nonblocking call may stay under way: it only queues work (its kernels wait on the
/// device, not here), so one that takes longer is taken for a failed communicator.
const SETTLE_DEADLINE: Duration = Duration::from_secs(30);

/// Two nonblocking communicators, one on each of two GPUs of this process, for transfers
/// between them queued from two threads (a KV link's ends). Either end may abort both: the
/// kernels of a transfer whose peer never comes then end and their streams move on.
struct PairShared {
    nccl: Arc<Nccl>,
    /// Rank 0's and rank 1's; None once aborted. Held across each call, so that an abort
    /// never frees a communicator another thread is calling.
    comms: Mutex<Option<[Comm; 2]>>,
}

// SAFETY: the communicators are only reached under the mutex.
unsafe impl Send for PairShared {}
unsafe impl Sync for PairShared {}

impl PairShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<[Comm; 2]>> {
        self.comms.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `comm`'s last call is no longer under way; its outcome.
    fn settle(&self, comm: Comm, what: &str) -> Result<(), RuntimeError> {
        let started = Instant::now();
        loop {
            let mut state: NcclResult = SUCCESS;
            // SAFETY: writes one result; `comm` is live (the caller holds the lock).
            let got = unsafe { (self.nccl.fns.async_error)(comm, &mut state) };
            self.nccl.check(got, Some(comm), "ncclCommGetAsyncError")?;
            if state != IN_PROGRESS {
                return self.nccl.check(state, Some(comm), what);
            }
            if started.elapsed() > SETTLE_DEADLINE {
                return Err(RuntimeError::Device(format!(
                    "NCCL: {what}: still under way after {} s",
                    SETTLE_DEADLINE.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    fn abort(&self) {
        if let Some(comms) = self.lock().take() {
            for comm in comms.into_iter().filter(|c| !c.is_null()) {
                // SAFETY: taken out under the lock: aborted once and never reached again.
                unsafe { (self.nccl.fns.comm_abort)(comm) };
            }
        }
    }
}

impl Drop for PairShared {
    fn drop(&mut self) {
        if let Some(comms) = self.lock().take() {
            for comm in comms.into_iter().filter(|c| !c.is_null()) {
                // SAFETY: the last reference: destroyed once, after its last call.
                unsafe { (self.nccl.fns.comm_destroy)(comm) };
            }
        }
    }
}

/// One end of a pair (`pair`): rank 0 or 1.
pub struct PairEnd {
    shared: Arc<PairShared>,
    rank: usize,
}

/// Nonblocking communicators over the GPUs of `ctxs` (rank 0, rank 1), with their first
/// transfer made: `buffers` (`bytes` on each device) from rank 0 to rank 1 on `streams`, in one
/// group call, since a pair's first transfer connects them and needs both at once. The caller
/// waits for the streams.
pub fn pair(
    nccl: Arc<Nccl>,
    ctxs: [&Arc<CudaContext>; 2],
    buffers: [u64; 2],
    streams: [CUstream; 2],
    bytes: usize,
) -> Result<[PairEnd; 2], RuntimeError> {
    let f = &nccl.fns;
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: writes one id.
    nccl.check(unsafe { (f.get_unique_id)(&mut id) }, None, "ncclGetUniqueId")?;
    let mut comms: [Comm; 2] = [std::ptr::null_mut(); 2];
    let mut made = Ok(());
    // SAFETY: each call writes one communicator; the group creates both at once.
    unsafe {
        nccl.check((f.group_start)(), None, "ncclGroupStart")?;
        for (rank, ctx) in ctxs.iter().enumerate() {
            // NCCL takes a rank's device from the one current when it is created.
            let r = ctx
                .bind_to_thread()
                .map_err(|e| RuntimeError::Device(format!("NCCL: making cuda:{} current: {e}", ctx.ordinal())))
                .and_then(|_| {
                    let mut config = Config::nonblocking();
                    let r = (f.comm_init_rank_config)(&mut comms[rank], 2, id, rank as c_int, &mut config);
                    nccl.check(
                        if r == IN_PROGRESS { SUCCESS } else { r },
                        None,
                        "ncclCommInitRankConfig",
                    )
                });
            made = made.and(r);
        }
        let ended = (f.group_end)();
        made = made.and(nccl.check(if ended == IN_PROGRESS { SUCCESS } else { ended }, None, "ncclGroupEnd"));
    }
    let shared = Arc::new(PairShared {
        nccl,
        comms: Mutex::new(Some(comms)),
    });
    let connected = made
        .and_then(|_| {
            comms
                .iter()
                .try_for_each(|&c| shared.settle(c, "creating a KV link's communicators"))
        })
        .and_then(|_| first_transfer(&shared, buffers, streams, bytes));
    if let Err(e) = connected {
        shared.abort();
        return Err(e);
    }
    Ok([0, 1].map(|rank| PairEnd {
        shared: shared.clone(),
        rank,
    }))
}

fn first_transfer(
    shared: &PairShared,
    buffers: [u64; 2],
    streams: [CUstream; 2],
    bytes: usize,
) -> Result<(), RuntimeError> {
    let guard = shared.lock();
    let [sender, receiver] = guard.ok_or_else(aborted)?;
    let (nccl, f) = (&shared.nccl, &shared.nccl.fns);
    let ok = |r: NcclResult| if r == IN_PROGRESS { SUCCESS } else { r };
    // SAFETY: each buffer holds `bytes` bytes on its rank's device; the group call queues both
    // halves before either waits on the other.
    unsafe {
        nccl.check((f.group_start)(), None, "ncclGroupStart")?;
        let sent = (f.send)(buffers[0] as *const c_void, bytes, UINT8, 1, sender, streams[0]);
        let received = (f.recv)(buffers[1] as *mut c_void, bytes, UINT8, 0, receiver, streams[1]);
        let ended = (f.group_end)();
        nccl.check(ok(sent), Some(sender), "ncclSend")?;
        nccl.check(ok(received), Some(receiver), "ncclRecv")?;
        nccl.check(ok(ended), None, "ncclGroupEnd")?;
    }
    shared.settle(sender, "a KV link's first send")?;
    shared.settle(receiver, "a KV link's first receive")
}

fn aborted() -> RuntimeError {
    RuntimeError::Device("NCCL: the KV link's communicators were aborted".into())
}

impl PairEnd {
    /// Calls `call` with this end's communicator, under the lock, and waits for it to settle.
    fn call(&self, what: &str, call: impl FnOnce(&Fns, Comm) -> NcclResult) -> Result<(), RuntimeError> {
        let guard = self.shared.lock();
        let comm = guard.ok_or_else(aborted)?[self.rank];
        let r = call(&self.shared.nccl.fns, comm);
        if r != IN_PROGRESS {
            self.shared.nccl.check(r, Some(comm), what)?;
        }
        self.shared.settle(comm, what)
    }

    /// Queues sending `bytes` bytes at `buffer` (on this end's device) to the other end, which
    /// receives them with `recv` in the same order.
    pub fn send(&self, buffer: u64, bytes: usize, stream: &CudaStream) -> Result<(), RuntimeError> {
        let peer = (1 - self.rank) as c_int;
        // SAFETY: the buffer holds `bytes` bytes on this end's device until the stream passes.
        self.call("ncclSend", |f, comm| unsafe {
            (f.send)(buffer as *const c_void, bytes, UINT8, peer, comm, stream.cu_stream())
        })
    }

    /// Queues receiving `bytes` bytes from the other end into `buffer`.
    pub fn recv(&self, buffer: u64, bytes: usize, stream: &CudaStream) -> Result<(), RuntimeError> {
        let peer = (1 - self.rank) as c_int;
        // SAFETY: the buffer has room for `bytes` bytes on this end's device.
        self.call("ncclRecv", |f, comm| unsafe {
            (f.recv)(buffer as *mut c_void, bytes, UINT8, peer, comm, stream.cu_stream())
        })
    }

    /// An error this end's transfers reported since, or the pair's abort.
    pub fn health(&self) -> Result<(), RuntimeError> {
        let guard = self.shared.lock();
        let comm = guard.ok_or_else(aborted)?[self.rank];
        self.shared.settle(comm, "a KV transfer")
    }

    /// Ends both ends' communicators, transfers in flight included: their kernels return and
    /// the streams move on (what they moved is undefined). Every later call fails.
    pub fn abort(&self) {
        self.shared.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NCCL 2.19's `ncclConfig_t` on a 64-bit target: what a newer NCCL copies by `size`.
    #[test]
    fn the_config_is_laid_out_as_nccl_2_19s() {
        assert_eq!(std::mem::size_of::<Config>(), 48);
        assert_eq!(std::mem::offset_of!(Config, blocking), 16);
        assert_eq!(std::mem::offset_of!(Config, net_name), 32);
        assert_eq!(std::mem::offset_of!(Config, split_share), 40);
        let c = Config::nonblocking();
        // Versions before 2.14 ignore `blocking`; from 2.25 on the struct is longer.
        assert!((21400..22500).contains(&c.version) && c.blocking == 0 && c.magic == 0xcafe_beef);
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
    }

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
