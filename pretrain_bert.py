"""Pretrain BERT with Megatron-Async pipeline schedules.

    torchrun --nproc-per-node 4 pretrain_bert.py --pipeline-model-parallel-size 4 --mock-data ...
    python pretrain_bert.py --pipeline-model-parallel-size 4 ...        # spawns 4 local ranks
    python pretrain_bert.py --pipeline-executor emulator --pipeline-model-parallel-size 16 ...
"""
import sys

from megatron.trainer.tasks.bert import BertTask
from megatron.trainer.loop.trainer import pretrain

if __name__ == "__main__":
    sys.exit(pretrain(BertTask(), sys.argv[1:], script=__file__))
