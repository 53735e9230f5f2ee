"""A tensor-parallel shard worker (rank 1..N-1), started by rank 0's launcher.

    python -m genserve.worker.shard_worker --rank 1 --world-size 2 --model-dir DIR ...

It joins the process group, loads its slices of the weights, agrees on the KV-cache size,
then executes what rank 0 broadcasts (steps, cache set-up, shutdown) until told to stop.  It
never samples and never talks to clients.  It exits when rank 0 goes away, whatever the
reason: the lifeline pipe (``--parent-fd``) reads end-of-file, or the parent pid changes.

Exit codes: 0 after ``SHUTDOWN``; 1 on any error (logged with its traceback); 3 when rank 0
disappeared.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence

EXIT_PARENT_GONE = 3


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="genserve-shard-worker", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--model-id", default="")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), required=True)
    p.add_argument("--memory-fraction", type=float, required=True)
    p.add_argument("--parent-fd", type=int, default=None)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json-output", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--kernel-cache-dir", default=None)
    p.add_argument("--disable-cpu-kernels", action="store_true")
    p.add_argument("--cpu-int-dot", choices=("auto", "on", "off"), default="auto")
    # rank 0's --cpu-features-mask (already parsed there): every rank runs the same kernels
    p.add_argument("--cpu-features-mask", default="")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument(
        "--gpu-prefill-attention", choices=("auto", "triton", "sdpa", "sdpa-pinned"), default="auto"
    )
    p.add_argument("--rope-scaling", choices=("linear", "dynamic"), default=None)
    p.add_argument("--rope-factor", type=float, default=None)
    p.add_argument("--quantize", choices=("int8", "int4", "gguf"), default=None)
    p.add_argument("--gguf-file", default=None)
    return p.parse_args(argv)


def watch_parent(parent_fd: int | None, parent_pid: int | None) -> None:
    """Exit this process (without cleanup: peers are gone anyway) once rank 0 is gone.

    The pipe read returns only at end-of-file, i.e. when rank 0's write end closed; the pid
    check covers a worker started without the pipe."""

    def by_pipe(fd: int) -> None:
        while os.read(fd, 1):
            pass
        _exit_parent_gone()

    def by_pid(pid: int) -> None:
        while os.getppid() == pid:
            time.sleep(0.5)
        _exit_parent_gone()

    if parent_fd is not None:
        threading.Thread(target=by_pipe, args=(parent_fd,), daemon=True).start()
    if parent_pid is not None:
        threading.Thread(target=by_pid, args=(parent_pid,), daemon=True).start()


def _exit_parent_gone() -> None:
    print("genserve shard worker: rank 0 is gone, exiting", file=sys.stderr, flush=True)
    os._exit(EXIT_PARENT_GONE)


def run(args: argparse.Namespace) -> None:
    # Heavy imports after the parent watch is running: a worker whose rank 0 dies while it
    # imports torch exits anyway.
    from pathlib import Path

    import structlog
    import torch

    from genserve.kernels import cpu as cpu_kernels
    from genserve.kernels import int_dot
    from genserve.kernels.cpu_features import parse_mask
    from genserve.logging import configure_logging
    from genserve.model.loader import ResolvedModel
    from genserve.worker.model_runner import ModelRunner
    from genserve.worker.shard_group import (
        ShardChannel,
        agree_kv_budget,
        init_shard_group,
        leave_shard_group,
        rank_device,
    )
    from genserve.worker.shard_messages import (
        InitKVCacheMessage,
        ShutdownMessage,
        StepMessage,
    )

    configure_logging(args.json_output)
    structlog.contextvars.bind_contextvars(shard=args.rank)
    log = structlog.get_logger("genserve.shard")
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    cache_dir = Path(args.kernel_cache_dir) if args.kernel_cache_dir is not None else None
    cpu_kernels.configure(
        cache_dir,
        enabled=not args.disable_cpu_kernels,
        batch_invariant=args.deterministic,
        hidden_features=parse_mask(args.cpu_features_mask),
    )
    if args.cpu_features_mask:
        log.warning("cpu_features_hidden", features=",".join(cpu_kernels.hidden_features()))
    int_dot.configure(args.cpu_int_dot, args.dtype)  # every rank multiplies as rank 0 does
    device = rank_device(args.rank, torch.cuda.is_available())
    group = init_shard_group(
        args.rank,
        args.world_size,
        args.master_addr,
        args.master_port,
        device,
        expert_parallel=args.expert_parallel,
    )
    runner = ModelRunner(
        ResolvedModel(
            Path(args.model_dir),
            args.model_id or args.model_dir,
            rope_scaling=args.rope_scaling,
            rope_factor=args.rope_factor,
            gguf_file=None if args.gguf_file is None else Path(args.gguf_file),
            quantize=args.quantize,
        ),
        dtype=getattr(torch, args.dtype),
        device=device,
        parallel=group.parallel,
        trust_remote_code=args.trust_remote_code,
        prefill_attention=args.gpu_prefill_attention,
    )
    agree_kv_budget(runner, args.memory_fraction, group)
    channel = ShardChannel(group)
    log.info("shard_ready", rank=args.rank, device=str(device), pid=os.getpid())
    while True:
        message = channel.receive()
        if isinstance(message, StepMessage):
            runner.execute_model(message.step)
        elif isinstance(message, InitKVCacheMessage):
            runner.initialize_kv_cache(message.num_blocks, message.block_size)
        elif isinstance(message, ShutdownMessage):
            break
    runner.shutdown()
    leave_shard_group()
    log.info("shard_stopped", rank=args.rank)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    watch_parent(args.parent_fd, args.parent_pid)
    try:
        run(args)
    except BaseException:
        import traceback

        print(f"genserve shard {args.rank}: fatal error", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: a peer may be gone mid-collective
    # Nothing is left to release that the OS does not; torch's teardown takes seconds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
