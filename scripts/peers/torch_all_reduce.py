"""The multi-GPU peer for `quarry bench all-reduce`: PyTorch's NCCL all-reduce (one process a
GPU, as torch.distributed runs it) over the same sizes and element type, timed the same way
(10 untimed, then ITERS back to back, one synchronize). Prints one JSON object.

  python3 scripts/peers/torch_all_reduce.py --sizes 8192,65536 --iters 100 --dtype bf16
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, args, port, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    elem = 2 if args.dtype == "bf16" else 4
    rows = []
    for size in args.sizes:
        x = torch.full((max(size // elem, 1),), float(rank + 1), dtype=dtype, device="cuda")
        dist.all_reduce(x)
        want = world * (world + 1) / 2
        assert bool((x == want).all()), f"rank {rank}: all-reduce of {size} bytes is wrong"
        for _ in range(10):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        us = (time.perf_counter() - t) * 1e6 / args.iters
        rows.append({"bytes": x.numel() * elem, "us": us})
    if rank == 0:
        queue.put({"peer": f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}",
                   "ranks": world, "dtype": args.dtype, "sizes": rows})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8192,65536,524288,4194304,33554432,268435456")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(args.ranks, args, 29500 + os.getpid() % 1000, queue), nprocs=args.ranks, join=True)
    print(json.dumps(queue.get()))


if __name__ == "__main__":
    main()
