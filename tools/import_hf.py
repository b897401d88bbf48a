"""Write a Megatron-Async checkpoint from a Hugging Face transformers model directory.

    python tools/import_hf.py --input DIR --save CKPT [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P]

So a GPT-2 or Llama model trained elsewhere fine-tunes here: ``--load CKPT --finetune`` with the
model flags this prints (any TP/PP/schedule: the checkpoint reshards like a run's). Weights
only (no optimizer state, RNG or data position), hence ``--finetune``; the model directory's
tokenizer (``tokenizer.json``) is copied into the checkpoint and recorded as the run's
``HuggingFaceTokenizer``. Import then export gives the same tensors bit for bit
(megatron/trainer/hf/importer.py). Needs ``pip install -e ".[hf]"``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The flags, the layout sizes checked (argparse's one-line error, exit 2)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--input", required=True, help="transformers model directory (config.json, weights)")
    parser.add_argument("--save", required=True, help="checkpoint directory to write")
    for flag, what in (("--tensor-model-parallel-size", "TP size"), ("--pipeline-model-parallel-size", "stages")):
        parser.add_argument(flag, type=int, default=1, help=f"{what} of the files written")
    args = parser.parse_args(argv)
    if min(args.tensor_model_parallel_size, args.pipeline_model_parallel_size) < 1:
        parser.error("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from megatron.trainer.hf import require_transformers

    if not require_transformers("tools/import_hf.py"):
        return 2
    from megatron.trainer.checkpointing.checkpoint import POINTER, CheckpointError
    from megatron.trainer.hf.importer import ImportHFError, import_hf, model_flags

    if not (Path(args.input) / "config.json").is_file():
        print(f"error: --input {args.input}: no config.json (not a transformers model directory)", file=sys.stderr)
        return 2
    if (Path(args.save) / POINTER).exists():
        print(f"error: --save {args.save} already holds a checkpoint; pick an empty directory", file=sys.stderr)
        return 2
    try:
        sig = import_hf(args.input, args.save, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    except (ImportHFError, CheckpointError, OSError) as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"imported {args.input} into {args.save} (TP{args.tensor_model_parallel_size} "
          f"PP{args.pipeline_model_parallel_size}, weights only)")
    print(f"fine-tune with: --load {args.save} --finetune {' '.join(model_flags(sig))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
