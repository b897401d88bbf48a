"""Write a Hugging Face transformers model directory from a checkpoint of any layout.

    python tools/export_hf.py --load CKPT --output DIR

GPT-2 architecture for learned positions + LayerNorm + GeLU, Llama for RoPE + RMSNorm + SwiGLU
(+ GQA); tied or untied as trained (megatron/trainer/hf/export.py); with the tokenizer files when
the run's tokenizer has a transformers equivalent (megatron/trainer/hf/tokenizer.py), so the
directory is usable on its own. Needs ``pip install -e ".[hf]"``.
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
    p.add_argument("--load", required=True, help="checkpoint directory (--save of a run)")
    p.add_argument("--output", required=True, help="transformers model directory to write")
    args = p.parse_args(argv)
    from megatron.trainer.hf import require_transformers

    if not require_transformers("tools/export_hf.py"):
        return 2
    from megatron.trainer.checkpointing.checkpoint import CheckpointError
    from megatron.trainer.checkpointing.full_state import read_full_state
    from megatron.trainer.hf.export import ExportError, check_output_dir, export
    from megatron.trainer.hf.tokenizer import export_tokenizer

    try:
        check_output_dir(args.output)
        signature, state, iteration = read_full_state(args.load)
        arch = export(signature, state, args.output)
    except (CheckpointError, ExportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported iteration {iteration} of {args.load} as a transformers {arch} model to {args.output}")
    print(export_tokenizer(signature.get("tokenizer"), args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
