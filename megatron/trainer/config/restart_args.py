"""``--max-restarts N``: the local launcher restarts every rank after a failure, as torchrun does.

``python pretrain_gpt.py --max-restarts N --save D --load D`` gives a laptop or a single node
what ``torchrun --max-restarts N`` gives a cluster: when a rank dies (killed, out of memory) or
hangs (its peers time out after ``--pipeline-timeout-seconds``), the launcher ends every rank
and starts them all again, up to N times; they resume from D's last complete checkpoint. So a
restart must have a checkpoint to resume from: ``--save`` and ``--load`` name the same
directory. Under torchrun or one ``srun`` task per rank the ranks are not ours to restart
(torchrun's ``--max-restarts``, Slurm's requeue do it), so the flag is refused there.
"""
from __future__ import annotations

import argparse
import os


from megatron.trainer.config.errors import ConfigError
from megatron.trainer.environment import LAUNCHED_ENV


def add_restart_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("restarts")
    g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="local launcher: after a rank fails or hangs, restart every rank up to N times, "
                        "resuming from the last checkpoint (needs --save DIR --load DIR, the same DIR)")


def check_restart_flags(args: argparse.Namespace) -> None:
    """One line for a ``--max-restarts`` that could not do what it says (its range is
    :mod:`megatron.trainer.config.flag_checks`' job, checked before this)."""
    if not args.max_restarts:
        return
    if args.pipeline_executor == "emulator":
        raise ConfigError("--max-restarts restarts the local launcher's ranks; the emulator runs in one "
                          "process (rerun it with --load)")
    if "RANK" in os.environ and LAUNCHED_ENV not in os.environ:
        raise ConfigError("--max-restarts is the local launcher's: under torchrun pass torchrun --max-restarts, "
                          "under Slurm requeue the job (examples/slurm, MAX_REQUEUES)")
    if args.save is None or args.load is None or os.path.abspath(args.save) != os.path.abspath(args.load):
        raise ConfigError("--max-restarts needs --save DIR --load DIR with the same DIR: a restart resumes "
                          "from the last checkpoint saved there")
