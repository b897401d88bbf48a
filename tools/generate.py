"""Generate tokens from a checkpoint of any layout, all stages in one process (CPU or one GPU).

    python tools/generate.py --load CKPT (--prompt TEXT | --prompt-ids 1,2,3) --max-new-tokens N \\
        [--greedy | --top-k K --top-p P --temperature T] [--seed S] [--device cpu|cuda]

To look at what a run learned without a cluster or a conversion: the checkpoint's stages and
TP shards are joined into one model (megatron/trainer/generation.py; it recomputes the whole
sequence per token, its docstring says why). ``--prompt`` is encoded with the run's own
tokenizer (recorded in the checkpoint) and the output decoded with it; ``--prompt-ids`` covers
runs without a text tokenizer (mock data, NullTokenizer) and prints ids. Greedy unless a
sampling flag is given; a seed reproduces a sample.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {text!r}") from None


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint directory (--save of a run, or tools/import_hf.py's)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded with the run's tokenizer")
    prompt.add_argument("--prompt-ids", type=_ids, help="token ids, comma-separated (runs without a tokenizer)")
    p.add_argument("--max-new-tokens", type=int, required=True, help="tokens to generate after the prompt")
    p.add_argument("--greedy", action="store_true", help="argmax at every step (the default without sampling flags)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample within the smallest set of mass >= P")
    p.add_argument("--temperature", type=float, default=None, help="divide the logits by T before sampling")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    args = p.parse_args(argv)
    sampling = [f for f, v in (("--top-k", args.top_k), ("--top-p", args.top_p), ("--temperature", args.temperature))
                if v is not None]
    if args.greedy and sampling:
        p.error(f"--greedy and {sampling[0]} exclude each other")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    args.sample = bool(sampling)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    from megatron.trainer.checkpointing.checkpoint import CheckpointError
    from megatron.trainer.checkpointing.full_state import read_full_state
    from megatron.trainer.generation import GenerationError, Sampling, full_model, generate
    from megatron.trainer.tokenizer import TokenizerError
    from megatron.trainer.tokenizer.factory import tokenizer_from_record

    if not Path(args.load).is_dir():
        print(f"error: --load {args.load}: no such directory", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sampling = Sampling(greedy=not args.sample, temperature=args.temperature or 1.0, top_k=args.top_k or 0,
                        top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed)
    try:
        signature, state, iteration = read_full_state(args.load)
        record = signature.get("tokenizer")
        tokenizer = None
        if args.prompt is not None:
            if record is None:
                raise GenerationError(f"--prompt needs the run's tokenizer and {args.load} recorded none "
                                      f"(mock data or an older checkpoint): pass --prompt-ids")
            tokenizer = tokenizer_from_record(record)
        prompt = tokenizer.tokenize(args.prompt) if tokenizer is not None else args.prompt_ids
        if any(not 0 <= i < signature["vocab_size"] for i in prompt):
            raise GenerationError(f"--prompt-ids outside the model's vocabulary 0..{signature['vocab_size'] - 1}")
        model = full_model(signature, state, device)
        new = generate(model, prompt, args.max_new_tokens, sampling, signature["max_position_embeddings"],
                       signature.get("tokenizer_vocab_size") if record is not None else None)
    except (CheckpointError, GenerationError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"# iteration {iteration} of {args.load}, {'greedy' if sampling.greedy else f'sampled, seed {args.seed}'}",
          file=sys.stderr)
    if tokenizer is not None:
        print(args.prompt + tokenizer.detokenize(new))
    else:
        print(",".join(str(i) for i in [*prompt, *new]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
