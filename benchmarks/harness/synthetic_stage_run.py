"""Run the synthetic-cost benchmark model (sleeps stand in for compute) through the real trainer.

Same flags as ``pretrain_gpt.py`` plus ``--synthetic-forward-ms`` / ``--synthetic-backward-ms``;
the model flags that matter are ``--seq-length``, ``--micro-batch-size`` and ``--hidden-size``
(the size of the tensors crossing stages). Not a model: see ``megatron/trainer/tasks/synthetic.py``.

    python benchmarks/harness/synthetic_stage_run.py --pipeline-model-parallel-size 4 --num-layers 4 \\
        --global-batch-size 8 --micro-batch-size 1 --num-threads 1 --log-json /tmp/run.jsonl
"""
import sys
from pathlib import Path

# Spawned ranks run this file directly, so the repository root is not on sys.path by itself.
_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from megatron.trainer.tasks.synthetic import SyntheticCostTask  # noqa: E402
from megatron.trainer.loop.training import pretrain  # noqa: E402

if __name__ == "__main__":
    sys.exit(pretrain(SyntheticCostTask(), sys.argv[1:], script=__file__))
