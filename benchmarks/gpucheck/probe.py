"""Small facts about the node, each printed as one JSON line (run as a child by the driver).

    python -m benchmarks.gpucheck.probe env                # step 1
    python -m benchmarks.gpucheck.probe p2p DEVICE         # step 6: gloo send/recv of a DEVICE tensor
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import socket
import subprocess
import sys


def _imports(module: str) -> str:
    """"ok <version>" or the import error's first line (Transformer Engine, Apex)."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import is the answer
        return f"no: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return f"ok {getattr(mod, '__version__', '')}".strip()


def environment() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
            "megatron_core": _imports("megatron.core"), "nltk": _imports("nltk"),
            "transformer_engine": _imports("transformer_engine.pytorch"), "apex": _imports("apex")}
    import megatron.core

    info["megatron_core_path"] = os.path.dirname(megatron.core.__file__)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    device_count=torch.cuda.device_count(), capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    bf16=torch.cuda.is_bf16_supported(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def _p2p_rank(rank: int, port: int, device: str) -> None:
    """One rank of the probe: rank 0 sends 0..n-1 from ``device``, rank 1 receives on ``device``."""
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    n = 1 << 16
    if rank == 0:
        dist.send(torch.arange(n, dtype=torch.float32, device=device), dst=1)
    else:
        got = torch.zeros(n, dtype=torch.float32, device=device)
        dist.recv(got, src=0)
        ok = torch.equal(got.cpu(), torch.arange(n, dtype=torch.float32))
        print(json.dumps({"device": device, "received_correctly": ok}), flush=True)
        if not ok:
            sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()


def p2p(device: str) -> int:
    """Two ranks on this node exchange one tensor over gloo: can the runtime's gloo transport
    carry CUDA tensors (staged through host memory) between processes sharing one GPU?"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-m", "benchmarks.gpucheck.probe", "p2p-rank", str(r), str(port), device])
             for r in range(2)]
    codes = [p.wait() for p in ranks]
    print(json.dumps({"rank_exit_codes": codes}), flush=True)
    return 0 if codes == [0, 0] else 1


def main(argv: list[str]) -> int:
    if argv[0] == "env":
        print(json.dumps(environment()), flush=True)
        return 0
    if argv[0] == "p2p":
        return p2p(argv[1])
    if argv[0] == "p2p-rank":
        _p2p_rank(int(argv[1]), int(argv[2]), argv[3])
        return 0
    raise SystemExit(f"unknown probe {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
