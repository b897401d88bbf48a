"""Pretrain GPT with Megatron-Async pipeline schedules.

    torchrun --nproc-per-node 4 pretrain_gpt.py --pipeline-model-parallel-size 4 --mock-data ...
    python pretrain_gpt.py --pipeline-model-parallel-size 4 ...        # spawns 4 local ranks
    python pretrain_gpt.py --pipeline-executor emulator --pipeline-model-parallel-size 16 ...
"""
import sys

from megatron.trainer.tasks.gpt import GPTTask
from megatron.trainer.loop.trainer import pretrain

if __name__ == "__main__":
    sys.exit(pretrain(GPTTask(), sys.argv[1:], script=__file__))
