"""``pretrain_gpt.py`` with the receive-buffer pool observed or deliberately broken (tests only).

Environment (read here, never by the runtime):
- ``P2P_BUFFERS_STATS``: a directory; every rank appends ``{"taken", "allocated"}`` of each
  channel's pool and its ``sends`` and ``copies`` (sends of a non-contiguous tensor, which
  ``P2PChannel.send`` copies) to ``rank<R>.jsonl`` when the channel flushes (a segment's end).
- ``P2P_BUFFERS_MODE``: ``pool`` (the runtime as shipped), ``off`` (no reuse) or ``unsafe``
  (every lent buffer counts as free at the next receive, whoever still holds it: the bug the
  pool's reference check exists to prevent, so a test can show that its comparison catches it).

The ranks are forked from this process (the launcher's CPU path), so they inherit the patches.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _patch(mode: str, stats: Path) -> None:
    from megatron.pipeline.runtime.transport.distributed import P2PChannel
    from megatron.pipeline.runtime.transport.recv_buffers import ReceiveBuffers

    if mode == "off":
        P2PChannel.reuse_receive_buffers = False
    elif mode == "unsafe":
        def reclaim_everything(self: ReceiveBuffers) -> None:
            for key, buf in self._lent:
                self._free.setdefault(key, []).append(buf)
            self._lent = []
        ReceiveBuffers._reclaim = reclaim_everything  # type: ignore[method-assign]
    elif mode != "pool":
        raise SystemExit(f"P2P_BUFFERS_MODE={mode!r}: expected pool, off or unsafe")
    flush, send = P2PChannel.flush, P2PChannel.send
    counts = {"sends": 0, "copies": 0}

    def counted_send(self: P2PChannel, msg: Any, tensor: Any) -> None:
        counts["sends"] += 1
        counts["copies"] += not tensor.is_contiguous()
        send(self, msg, tensor)

    def flush_and_record(self: P2PChannel) -> None:
        flush(self)
        record = {"taken": self.buffers.taken, "allocated": self.buffers.allocated, **counts}
        with open(stats / f"rank{os.environ.get('RANK', '0')}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    P2PChannel.send, P2PChannel.flush = counted_send, flush_and_record  # type: ignore[method-assign]


def main() -> int:
    from megatron.trainer.launch.launcher import fork_is_safe
    from megatron.trainer.loop.training import pretrain
    from megatron.trainer.tasks.gpt import GPTTask

    _patch(os.environ["P2P_BUFFERS_MODE"], Path(os.environ["P2P_BUFFERS_STATS"]))
    if not fork_is_safe():  # exec'd ranks would run without the patches
        raise SystemExit("p2p_buffers_driver: the launcher cannot fork its ranks here")
    return pretrain(GPTTask(), sys.argv[1:], script=__file__)


if __name__ == "__main__":
    sys.exit(main())
