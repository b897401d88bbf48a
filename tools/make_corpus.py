"""Write the offline pydoc corpus (CPython's documentation topics) as JSONL.

    python tools/make_corpus.py --output corpus.jsonl
    python tools/make_corpus.py --output corpus.jsonl --granularity paragraph --json-key text

The output feeds ``tools/preprocess_data.py --input corpus.jsonl`` and
``tools/train_tokenizer.py --input corpus.jsonl``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.trainer.data.corpus import GRANULARITIES, pydoc_corpus, write_jsonl  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--output", required=True, help="JSONL file to write")
    p.add_argument("--granularity", choices=GRANULARITIES, default="topic",
                   help="one document per help topic (~80) or per paragraph (~thousands)")
    p.add_argument("--json-key", default="text")
    args = p.parse_args(argv)
    docs = pydoc_corpus(args.granularity)
    n = write_jsonl(docs, args.output, args.json_key)
    print(f"wrote {n} documents ({sum(len(d) for d in docs)} characters) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
