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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--input", required=True, help="transformers model directory (config.json, weights)")
    p.add_argument("--save", required=True, help="checkpoint directory to write")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size of the files written")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages of the files written")
    args = p.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print('error: tools/import_hf.py needs transformers: pip install -e ".[hf]"', file=sys.stderr)
        return 2
    transformers.utils.logging.disable_progress_bar()  # stderr keeps to one line per error
    from megatron.trainer.checkpointing.checkpoint import POINTER, CheckpointError
    from megatron.trainer.hf.importer import ImportHFError, import_hf, model_flags

    if not (Path(args.input) / "config.json").is_file():
        print(f"error: --input {args.input}: no config.json (not a transformers model directory)", file=sys.stderr)
        return 2
    if (Path(args.save) / POINTER).exists():
        print(f"error: --save {args.save} already holds a checkpoint; pick an empty directory", file=sys.stderr)
        return 2
    if min(args.tensor_model_parallel_size, args.pipeline_model_parallel_size) < 1:
        print("error: --tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1", file=sys.stderr)
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
