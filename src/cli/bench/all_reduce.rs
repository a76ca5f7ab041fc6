//! `quarry bench all-reduce`: NCCL's all-reduce across this machine's GPUs, one process driving
//! them all (one communicator a device, one group call a collective), at the sizes a
//! tensor-parallel step sends: from one token's hidden state (8 KiB in bf16 at a width of 4,096)
//! to a prefill chunk's. Every size is checked first (each rank ends with the sum of all), then
//! timed back to back. With f32, the one-shot all-reduce through peer memory runs beside NCCL
//! (where every GPU reaches the others'), checked bitwise against the sum in rank order on the
//! host. scripts/bench-multi-gpu puts PyTorch's all-reduce beside both.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use crate::runtime::cuda::nccl::{self, Group, Nccl};
use crate::runtime::cuda::peer_reduce::PeerReduce;
use crate::runtime::RuntimeError;

#[derive(clap::Args)]
pub struct AllReduceArgs {
    /// GPUs, by ordinal [default: every one this process sees]
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<i32>>,
    /// Message sizes in bytes.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8192,65536,524288,4194304,33554432,268435456"
    )]
    sizes: Vec<usize>,
    /// The largest message the peer all-reduce is timed at (f32 only).
    #[arg(long, default_value_t = 4 << 20)]
    peer_max: usize,
    /// All-reduces timed per size (after 10 untimed).
    #[arg(long, default_value_t = 100)]
    iters: usize,
    /// Element type: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// One rank's buffer: bf16 bits or f32 values.
enum Buffer {
    Bf16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

impl Buffer {
    fn ptr(&self, stream: &CudaStream) -> u64 {
        match self {
            Buffer::Bf16(b) => b.device_ptr(stream).0,
            Buffer::F32(b) => b.device_ptr(stream).0,
        }
    }

    /// Every element as f32.
    fn read(&self, stream: &Arc<CudaStream>) -> anyhow::Result<Vec<f32>> {
        Ok(match self {
            Buffer::Bf16(b) => stream
                .clone_dtoh(b)?
                .into_iter()
                .map(|h| f32::from_bits((h as u32) << 16))
                .collect(),
            Buffer::F32(b) => stream.clone_dtoh(b)?,
        })
    }
}

pub fn run(args: AllReduceArgs) -> anyhow::Result<()> {
    let (bf16, elem) = match args.dtype.as_str() {
        "bf16" => (true, 2),
        "f32" => (false, 4),
        other => anyhow::bail!("--dtype {other}: bf16 or f32"),
    };
    anyhow::ensure!(args.iters > 0, "--iters must be at least 1");
    let (cudarc_names, cudarc_found) = nccl::cudarc_would_find();
    let nccl = Nccl::open()?;
    let count = CudaContext::device_count().context("counting GPUs")?;
    let devices = args.devices.clone().unwrap_or_else(|| (0..count).collect());
    anyhow::ensure!(
        devices.len() >= 2,
        "an all-reduce needs at least 2 GPUs; this process sees {count}"
    );
    let contexts = devices
        .iter()
        .map(|&d| CudaContext::new(d as usize).with_context(|| format!("GPU {d}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let streams = contexts.iter().map(|c| c.new_stream()).collect::<Result<Vec<_>, _>>()?;
    let raw_streams: Vec<_> = streams.iter().map(|s| s.cu_stream()).collect();
    let mut group = Group::local(nccl.clone(), &devices)?;
    let peer = match bf16 {
        true => None,
        false => PeerReduce::new(&contexts)?,
    };
    let dtype = if bf16 { nccl::BFLOAT16 } else { nccl::FLOAT32 };
    let ranks = devices.len();
    let mut rows = Vec::new();
    for &size in &args.sizes {
        let n = (size / elem).max(1);
        // Rank r holds r + 1 everywhere: the sum, ranks * (ranks + 1) / 2, is exact in bf16.
        let buffers = streams
            .iter()
            .enumerate()
            .map(|(r, s)| {
                let v = (r + 1) as f32;
                Ok(match bf16 {
                    true => Buffer::Bf16(s.clone_htod(&vec![(v.to_bits() >> 16) as u16; n])?),
                    false => Buffer::F32(s.clone_htod(&vec![v; n])?),
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let ptrs: Vec<u64> = buffers.iter().zip(&streams).map(|(b, s)| b.ptr(s)).collect();
        group.all_reduce_sum(&ptrs, &raw_streams, n, dtype)?;
        let want = (ranks * (ranks + 1) / 2) as f32;
        for (r, (b, s)) in buffers.iter().zip(&streams).enumerate() {
            let got = b.read(s)?;
            if let Some(i) = got.iter().position(|&x| x != want) {
                anyhow::bail!(
                    "all-reduce of {size} bytes: rank {r} holds {} at {i}, not {want}",
                    got[i]
                );
            }
        }
        let us = time_calls(&streams, args.iters, || {
            group.all_reduce_sum(&ptrs, &raw_streams, n, dtype)
        })?;
        group.async_error()?;
        let bytes = (n * elem) as f64;
        // Bus bandwidth as nccl-tests counts it: what each rank's links carry in a ring.
        let alg = bytes / us / 1e3;
        let bus = alg * 2.0 * (ranks - 1) as f64 / ranks as f64;
        let peer_us = match peer.as_ref().filter(|_| n * elem <= args.peer_max) {
            Some(p) => Some(time_peer(p, &streams, n, args.iters)?),
            None => None,
        };
        rows.push(serde_json::json!({
            "bytes": n * elem, "us": us, "algbw_gb_s": alg, "busbw_gb_s": bus, "peer_us": peer_us,
        }));
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "nccl": nccl.version_text(), "library": nccl.path, "ranks": ranks, "dtype": args.dtype,
                "cudarc_would_open": cudarc_found, "sizes": rows,
            })
        );
        return Ok(());
    }
    println!(
        "NCCL {} from {}; {ranks} GPUs {:?}, {}, one process",
        nccl.version_text(),
        nccl.path,
        devices,
        args.dtype
    );
    match cudarc_found {
        Some(name) => println!("cudarc's loader would open {name}"),
        None => println!("cudarc's loader would open none of {}", cudarc_names.join(" ")),
    }
    if !bf16 && peer.is_none() {
        println!("no peer all-reduce: some GPU cannot reach another's memory");
    }
    println!(
        "{:>12} {:>10} {:>12} {:>12} {:>10}",
        "bytes", "us", "algbw GB/s", "busbw GB/s", "peer us"
    );
    for r in &rows {
        let peer = r["peer_us"].as_f64().map_or("-".into(), |u| format!("{u:.1}"));
        println!(
            "{:>12} {:>10.1} {:>12.1} {:>12.1} {:>10}",
            r["bytes"],
            r["us"].as_f64().unwrap_or(0.0),
            r["algbw_gb_s"].as_f64().unwrap_or(0.0),
            r["busbw_gb_s"].as_f64().unwrap_or(0.0),
            peer
        );
    }
    Ok(())
}

/// Checks the peer all-reduce of `n` floats bitwise against the host's sum in rank order (on
/// random values, where another order would round differently), then times it: us a call.
fn time_peer(peer: &PeerReduce, streams: &[Arc<CudaStream>], n: usize, iters: usize) -> anyhow::Result<f64> {
    let ranks = streams.len();
    // A fixed pseudo-random fill per rank: values of mixed magnitude and sign.
    let values = |r: usize| -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = ((i as u64) ^ ((r as u64 + 1) << 40)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * (1 + (h >> 60)) as f32
            })
            .collect()
    };
    let host: Vec<Vec<f32>> = (0..ranks).map(values).collect();
    let want: Vec<u32> = (0..n)
        .map(|i| host.iter().skip(1).fold(host[0][i], |s, v| s + v[i]).to_bits())
        .collect();
    let inputs = streams
        .iter()
        .zip(&host)
        .map(|(s, h)| s.clone_htod(h))
        .collect::<Result<Vec<_>, _>>()?;
    let outputs = streams
        .iter()
        .map(|s| s.alloc_zeros::<f32>(n))
        .collect::<Result<Vec<_>, _>>()?;
    let ins: Vec<u64> = inputs.iter().zip(streams).map(|(b, s)| b.device_ptr(s).0).collect();
    let outs: Vec<u64> = outputs.iter().zip(streams).map(|(b, s)| b.device_ptr(s).0).collect();
    peer.all_reduce_f32(&ins, &outs, n, streams)?;
    for (r, (o, s)) in outputs.iter().zip(streams).enumerate() {
        let got = s.clone_dtoh(o)?;
        if let Some(i) = (0..n).find(|&i| got[i].to_bits() != want[i]) {
            anyhow::bail!(
                "peer all-reduce of {n} floats: rank {r} holds {} at {i}, the sum in rank order is {}",
                got[i],
                f32::from_bits(want[i])
            );
        }
    }
    time_calls(streams, iters, || peer.all_reduce_f32(&ins, &outs, n, streams))
}

/// Microseconds a call of `call`: 10 untimed, then `iters` back to back, timed to the moment
/// every stream has finished them.
fn time_calls(
    streams: &[Arc<CudaStream>],
    iters: usize,
    mut call: impl FnMut() -> Result<(), RuntimeError>,
) -> anyhow::Result<f64> {
    for _ in 0..10 {
        call()?;
    }
    for s in streams {
        s.synchronize()?;
    }
    let started = Instant::now();
    for _ in 0..iters {
        call()?;
    }
    for s in streams {
        s.synchronize()?;
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / iters as f64)
}
