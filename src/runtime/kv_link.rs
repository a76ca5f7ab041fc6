//! Moving KV blocks from one backend to another: disaggregated serving, where one engine
//! computes a prompt's keys and values and another decodes from them.
//!
//! A link has two ends, one attached to each backend (`Backend::attach_kv_link`). The sending
//! backend gathers a block's keys and values over every layer into one piece and sends the
//! pieces of a transfer in one go; the receiving one scatters them into the blocks it was told
//! to fill. Transfers are matched in the order they are queued on each end (the caller queues a
//! send, then its receive), as NCCL's point-to-point operations are. Both ends report their
//! transfers done in order (`Backend::kv_transfers_done`), so a caller holds a transfer's blocks
//! until its count passes the transfer's ticket.
//!
//! A backend holds as many links as engines it exchanges blocks with (one prefill engine
//! serving two decode engines: two links), each an ordered queue of its own, numbered as
//! attached.
//!
//! Host memory (two CPU backends) goes through a queue; two GPUs through NCCL send and receive
//! (`cuda::kv_transfer`), the transport that also reaches another host.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::error::{Result, RuntimeError};
use super::{Backend, DeviceChoice};

/// One end of a link, for `Backend::attach_kv_link`.
pub enum KvLinkEnd {
    Host(HostLink),
    Nccl(super::cuda::kv_transfer::NcclEnd),
}

/// Joins `prefill` (on `from`) and `decode` (on `to`) by a new link: host memory between two
/// CPU backends, NCCL between two GPUs. Returns the link's number on each end (a backend may
/// hold several links, one per engine it exchanges blocks with).
pub fn join(
    prefill: &mut dyn Backend,
    from: DeviceChoice,
    decode: &mut dyn Backend,
    to: DeviceChoice,
) -> Result<(usize, usize)> {
    let (a, b) = match (from, to) {
        (DeviceChoice::Cpu, DeviceChoice::Cpu) => {
            let (a, b, _) = HostLink::pair();
            (a, b)
        }
        (DeviceChoice::Cuda(x), DeviceChoice::Cuda(y)) => super::cuda::kv_transfer::pair(x, y)?,
        _ => {
            return Err(RuntimeError::Device(format!(
                "prefill on {from} and decode on {to}: both must be named, and both be the CPU or both GPUs"
            )))
        }
    };
    Ok((prefill.attach_kv_link(a)?, decode.attach_kv_link(b)?))
}

/// The link between two backends in host memory: the sender's pieces wait in a queue until
/// the receiver takes them. Both ends share it.
#[derive(Clone, Default)]
pub struct HostLink {
    queue: Arc<Mutex<VecDeque<Vec<u8>>>>,
    /// Sends still to go before one fails (tests of a failed transfer); 0: none fails.
    fail_in: Arc<AtomicUsize>,
}

impl HostLink {
    /// Both ends of a new link.
    pub fn pair() -> (KvLinkEnd, KvLinkEnd, HostLink) {
        let link = HostLink::default();
        (KvLinkEnd::Host(link.clone()), KvLinkEnd::Host(link.clone()), link)
    }

    /// Makes the `n`th send from now fail (1: the next), as a broken transport would: the
    /// sender gets an error and the receiver finds nothing to take.
    pub fn fail_send(&self, n: usize) {
        self.fail_in.store(n, Ordering::SeqCst);
    }

    pub fn send(&self, piece: Vec<u8>) -> Result<()> {
        let armed = self.fail_in.load(Ordering::SeqCst);
        if armed > 0 {
            self.fail_in.store(armed - 1, Ordering::SeqCst);
            if armed == 1 {
                return Err(RuntimeError::Backend("KV transfer: the link failed (injected)".into()));
            }
        }
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).push_back(piece);
        Ok(())
    }

    /// The oldest piece sent and not yet taken, which must be `bytes` long.
    pub fn receive(&self, bytes: usize) -> Result<Vec<u8>> {
        let piece = self.queue.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
        match piece {
            Some(p) if p.len() == bytes => Ok(p),
            Some(p) => Err(RuntimeError::Backend(format!(
                "KV transfer: {} bytes arrived where {bytes} were expected (two models of different shapes?)",
                p.len()
            ))),
            None => Err(RuntimeError::Backend("KV transfer: nothing was sent".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_arrive_in_order_and_checked_for_size() {
        let (_, _, link) = HostLink::pair();
        link.send(vec![1, 2]).unwrap();
        link.send(vec![3]).unwrap();
        assert_eq!(link.receive(2).unwrap(), vec![1, 2]);
        assert!(link.receive(2).unwrap_err().to_string().contains("1 bytes arrived"));
        assert!(link.receive(1).unwrap_err().to_string().contains("nothing was sent"));
    }

    #[test]
    fn an_injected_failure_hits_the_send_it_names() {
        let (_, _, link) = HostLink::pair();
        link.fail_send(2);
        link.send(vec![1]).unwrap();
        assert!(link.send(vec![2]).is_err());
        link.send(vec![3]).unwrap();
        assert_eq!(link.receive(1).unwrap(), vec![1]);
        assert_eq!(link.receive(1).unwrap(), vec![3]);
    }
}
