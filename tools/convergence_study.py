"""Convergence studies on the emulator: schedules x depths x optimizers on real text.

    python tools/convergence_study.py --output-dir runs/convergence                 # full (~95 min, 2 cores)
    python tools/convergence_study.py --output-dir /tmp/conv-ci --preset ci          # reduced (CI)
    python tools/convergence_study.py --output-dir runs/convergence --study depth    # one study

Studies (docs/convergence.md):
  paci   1F1B-flush vs async 1F1B vs PACI a = 4, 8 at N = 8, same global batch: loss vs tokens.
  depth  async 1F1B at P = 1..32 with AdamW, PipeMare-LR and basis rotation (2 sources x 2
         geometries), one 32-layer model: iterations to a target loss and slowdown vs P = 1.

Every run shares the model, seed, data order and token budget of the preset. Without
``--data-path`` the corpus is CPython's documentation with a BPE tokenizer trained on it, built
offline under ``OUTPUT_DIR/data``. Writes ``convergence.json`` (curves, metrics), ``summary.md``
(tables) and PNG plots to OUTPUT_DIR; saved runs with unchanged flags are reused.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.studies.grid import PRESETS, STUDIES, study_runs  # noqa: E402
from megatron.studies.report import (  # noqa: E402
    depth_summary,
    depth_tables,
    paci_summary,
    paci_table,
    plot_depth,
    plot_paci,
)
from megatron.studies.runner import StudyData, prepare_data, run_study  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--output-dir", required=True, type=Path)
    p.add_argument("--preset", choices=sorted(PRESETS), default="full")
    p.add_argument("--study", choices=STUDIES, nargs="+", default=list(STUDIES))
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    p.add_argument("--data-path", default=None, help="an indexed GPT dataset prefix (with --tokenizer-dir)")
    p.add_argument("--tokenizer-dir", default=None, help="vocab.json + merges.txt of --data-path's tokenizer")
    args = p.parse_args(argv)
    if (args.data_path is None) != (args.tokenizer_dir is None):
        p.error("--data-path and --tokenizer-dir go together")
    if args.data_path and not Path(f"{args.data_path}.idx").exists():
        p.error(f"--data-path {args.data_path}: no {args.data_path}.idx (see tools/preprocess_data.py)")
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out: Path = args.output_dir
    started = time.perf_counter()
    data = (StudyData(args.data_path, args.tokenizer_dir) if args.data_path else prepare_data(out / "data"))
    preset = PRESETS[args.preset]
    runs = run_study(study_runs(preset, tuple(args.study)), data, out, args.jobs)
    report: dict = {"preset": preset.name, "tokens_per_update": preset.tokens_per_update, "runs": runs}
    sections = [f"# Convergence study ({preset.name} preset)", ""]
    if "paci" in args.study:
        paci_runs = [r for r in runs if r["study"] == "paci"]
        report["paci"] = paci_summary(paci_runs)
        plot_paci(paci_runs, out / "paci_loss.png")
        sections += ["## PACI vs 1F1B-flush", "", paci_table(report["paci"]), "", "![](paci_loss.png)", ""]
    if "depth" in args.study:
        depth_runs = [r for r in runs if r["study"] == "depth"]
        report["depth"] = depth_summary(depth_runs)
        plot_depth(depth_runs, report["depth"], out / "depth_loss.png", out / "depth_slowdown.png")
        sections += ["## Depth sweep (async 1F1B)", "", depth_tables(report["depth"]), "",
                     "![](depth_slowdown.png)", "", "![](depth_loss.png)", ""]
    report["wall_s"] = time.perf_counter() - started
    (out / "convergence.json").write_text(json.dumps(report, indent=1))
    summary = "\n".join(sections) + f"\nStudy wall time: {report['wall_s']:.0f} s.\n"
    (out / "summary.md").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
