//! What a step sends to the device (batch metadata, grammar masks, sampling parameters),
//! gathered in page-locked host memory and copied with one asynchronous transfer: pageable
//! memory would make the driver stage it and block the host.
//!
//! The host buffer is written again only once the stream has passed the copy. A pass's
//! metadata alternates between two buffers, since a pipelined pass is staged before the pass
//! before it was read; `CudaBackend::stage` waits where the buffer's last copy is not known to be
//! done. Sampling inputs are staged after the last draw was read, or after a wait where it
//! never was.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};

use crate::runtime::error::{Result, RuntimeError};

pub struct Staging {
    ctx: Arc<CudaContext>,
    host: PinnedHostSlice<u32>,
    /// `host`'s words, taken once: cudarc's accessors synchronize an event of their own on every
    /// call, a driver call for each of the hundreds of pushes a step of many sequences makes,
    /// while what keeps writes behind the stream's copy is this module's protocol (above).
    words: HostWords,
    len: usize,
    device: CudaSlice<u32>,
    what: &'static str,
}

/// The address and length of a page-locked buffer's words.
struct HostWords(*mut u32, usize);

// SAFETY: the words belong to the `PinnedHostSlice` kept beside them, which may move between
// threads; they are reached only through the `Staging` that owns both.
unsafe impl Send for HostWords {}

impl HostWords {
    fn of(host: &mut PinnedHostSlice<u32>, what: &'static str) -> Result<Self> {
        let words = host.as_mut_slice().map_err(err(what))?;
        Ok(HostWords(words.as_mut_ptr(), words.len()))
    }
}

fn err(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError {
    move |e| RuntimeError::Backend(format!("staging {what}: {e}"))
}

impl Staging {
    pub fn new(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, words: usize, what: &'static str) -> Result<Self> {
        let words = words.max(1024);
        // SAFETY: words are written before they are read (`push` writes, `send` copies the
        // written prefix).
        let mut host = unsafe { ctx.alloc_pinned::<u32>(words) }.map_err(err(what))?;
        let device = stream.alloc_zeros::<u32>(words).map_err(err(what))?;
        Ok(Staging {
            ctx: ctx.clone(),
            words: HostWords::of(&mut host, what)?,
            host,
            len: 0,
            device,
            what,
        })
    }

    /// Words pushed since `clear`.
    pub fn len_words(&self) -> usize {
        self.len
    }

    /// Starts a new upload.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Appends `part`; its offset in words.
    pub fn push(&mut self, part: &[u32]) -> Result<usize> {
        self.push_with(part.len(), |dst| dst.copy_from_slice(part))
    }

    pub fn push_f32(&mut self, part: &[f32]) -> Result<usize> {
        self.push_with(part.len(), |dst| {
            dst.iter_mut().zip(part).for_each(|(w, v)| *w = v.to_bits())
        })
    }

    pub fn push_i32(&mut self, part: &[i32]) -> Result<usize> {
        self.push_with(part.len(), |dst| {
            dst.iter_mut().zip(part).for_each(|(w, v)| *w = *v as u32)
        })
    }

    /// Appends `words` words that `fill` writes; their offset.
    pub fn push_with(&mut self, words: usize, fill: impl FnOnce(&mut [u32])) -> Result<usize> {
        let at = self.len;
        self.reserve(words)?;
        fill(&mut self.slice()[at..at + words]);
        self.len += words;
        Ok(at)
    }

    /// Pads to a multiple of `words` (structs with 8-byte fields start at an even word).
    pub fn align(&mut self, words: usize) -> Result<()> {
        let pad = self.len.next_multiple_of(words) - self.len;
        self.push_with(pad, |p| p.fill(0)).map(|_| ())
    }

    /// Queues the copy of everything pushed since `clear`; the device address of word 0.
    pub fn send(&mut self, stream: &Arc<CudaStream>) -> Result<u64> {
        if self.device.len() < self.len {
            self.device = stream.alloc_zeros::<u32>(self.host.len()).map_err(err(self.what))?;
        }
        let dst = self.device.device_ptr(stream).0;
        let len = self.len;
        let src = &self.slice()[..len];
        // SAFETY: `dst` holds at least `len` words; `src` stays allocated and unwritten until the
        // stream has passed the copy (see the module's comment).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }.map_err(err(self.what))?;
        Ok(dst)
    }

    /// Queues the copy of everything pushed since `clear` to `dst`, a buffer of `capacity`
    /// words that outlives the copy (a captured graph's fixed metadata).
    pub fn send_to(&mut self, stream: &Arc<CudaStream>, dst: u64, capacity: usize) -> Result<u64> {
        if self.len > capacity {
            return Err(RuntimeError::Backend(format!(
                "staging {}: {} words for a buffer of {capacity}",
                self.what, self.len
            )));
        }
        let len = self.len;
        let src = &self.slice()[..len];
        // SAFETY: as in `send`; the caller vouches for `dst`'s size.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, stream.cu_stream()) }.map_err(err(self.what))?;
        Ok(dst)
    }

    /// The device address of word `offset` of the last `send`.
    pub fn addr(base: u64, offset: usize) -> u64 {
        base + (offset * std::mem::size_of::<u32>()) as u64
    }

    fn slice(&mut self) -> &mut [u32] {
        // SAFETY: `words` is `host`'s buffer, alive as long as `self`; `&mut self` makes this
        // the only view of it.
        unsafe { std::slice::from_raw_parts_mut(self.words.0, self.words.1) }
    }

    fn reserve(&mut self, more: usize) -> Result<()> {
        let need = self.len + more;
        if need <= self.host.len() {
            return Ok(());
        }
        // SAFETY: as in `new`; the written prefix is carried over.
        let mut bigger = unsafe { self.ctx.alloc_pinned::<u32>(need.next_power_of_two()) }.map_err(err(self.what))?;
        let words = HostWords::of(&mut bigger, self.what)?;
        let len = self.len;
        // SAFETY: `words` is `bigger`'s buffer, just allocated and not shared.
        unsafe { std::slice::from_raw_parts_mut(words.0, len) }.copy_from_slice(&self.slice()[..len]);
        (self.host, self.words) = (bigger, words);
        Ok(())
    }
}
