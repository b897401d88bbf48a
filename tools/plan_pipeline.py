"""Which schedule should I run? Rank every schedule x micro-batch size x virtual stages x
recompute x layer split by simulated tokens/s, per-stage memory and weight-version drift.

    python tools/plan_pipeline.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
        --seq-length 2048 --vocab-size 51200 --micro-batch-size 1 --global-batch-size 1536 --bf16 \\
        --pipeline-sizes 8,16 --tensor-model-parallel-size 8 --data-parallel-size 8 \\
        --use-distributed-optimizer --device h100 --device-memory-gb 80

Takes pretrain_gpt.py's model, batch and precision flags unchanged (the trainer's own parser),
plus the target (``--pipeline-sizes``, ``--data-parallel-size``, ``--tensor-model-parallel-size``,
``--device-memory-gb``) and one cost source: ``--device h100|a100|h200|cpu`` (analytic, from the
datasheet table in :mod:`megatron.pipeline.costs.devices`), ``--costs FILE`` (a saved profile)
or ``--profile`` (time one layer, the embedding, the head and a P2P message on this machine;
``--save-costs FILE`` keeps them). Prints the top 10 synchronous and asynchronous candidates with
the flags that select them; ``--json`` prints the object of ``docs/planning.md`` instead;
``--png FILE`` plots tokens/s against peak memory with the Pareto front.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.job_config import JobConfig, build_job_config  # noqa: E402
from megatron.pipeline.planner.candidates import RECOMPUTES, SPLITS, enumerate_candidates  # noqa: E402
from megatron.pipeline.costs.devices import DEVICES, analytic_unit_costs  # noqa: E402
from megatron.pipeline.planner.evaluate import Problem, evaluate  # noqa: E402
from megatron.pipeline.planner.ranking import rank, split_by_semantics  # noqa: E402
from megatron.pipeline.planner.report import plan_dict, table  # noqa: E402
from megatron.pipeline.costs.stages import Parallelism  # noqa: E402
from megatron.pipeline.costs.unit_costs import load_unit_costs, save_unit_costs  # noqa: E402
from megatron.pipeline.replay import ScheduleError  # noqa: E402
from megatron.pipeline.schedules import SCHEDULES, ScheduleConfigError  # noqa: E402


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(allowed: tuple[str, ...] | list[str]):
    def parse(text: str) -> list[str]:
        names = [v for v in text.split(",") if v]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(allowed)}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser (model, batch, precision flags unchanged) plus the planner's."""
    from megatron.trainer.config.arguments import build_parser as trainer_parser

    p = trainer_parser(description="Megatron-Async pipeline planner")
    p.conflict_handler = "resolve"  # --device: the planner's cost source replaces the trainer's
    g = p.add_argument_group("planner")
    g.add_argument("--pipeline-sizes", type=_int_list, default=None, metavar="N1,N2,..",
                   help="pipeline depths to plan for (default: --pipeline-model-parallel-size)")
    g.add_argument("--device-memory-gb", type=float, default=None, help="memory per device (default: --device's)")
    g.add_argument("--device", choices=sorted(DEVICES), default=None,
                   help="analytic costs on this datasheet device (megatron/pipeline/costs/devices.py)")
    g.add_argument("--costs", default=None, metavar="FILE", help="unit costs saved by --profile --save-costs")
    g.add_argument("--profile", action="store_true", help="time one layer, embedding, head and P2P here")
    g.add_argument("--save-costs", default=None, metavar="FILE", help="write the unit costs used to FILE")
    g.add_argument("--host-cores", type=float, default=None, metavar="C",
                   help="cores a node's ranks share when they outnumber them (a CPU host; 0: a device per "
                        "rank); default: the cost source's (a CPU --profile records this host's)")
    g.add_argument("--schedules", type=_names(list(SCHEDULES)), default=None, help="comma-separated subset")
    g.add_argument("--recompute", type=_names(RECOMPUTES), default=list(RECOMPUTES), dest="plan_recompute",
                   help="recompute choices to plan (default: none,selective,full)")
    g.add_argument("--layer-splits", type=_names(SPLITS), default=list(SPLITS), help="splits to plan")
    g.add_argument("--top", type=int, default=10)
    g.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    g.add_argument("--png", default=None, metavar="FILE", help="tokens/s against peak memory, Pareto front")
    g.add_argument("--export-csv", default=None, metavar="DIR",
                   help="write each ranked synchronous candidate's order (the top --top) as torch's compute-only "
                        "CSV into DIR, with a README.md of the matching torchtitan settings")
    g.add_argument("--probe-convergence", type=int, default=None, metavar="N_UPDATES",
                   help="train 1F1B and each asynchronous candidate N_UPDATES updates at reduced width on the "
                        "emulator with your data flags; loss gap and time to 1F1B's loss (docs/planning.md)")
    from megatron.trainer.optim.registry import OPTIMIZERS

    g.add_argument("--probe-optimizers", type=_names(list(OPTIMIZERS)), default=None, metavar="NAMES",
                   help="with --probe-convergence: probe every candidate with each of these optimizers (comma-"
                        "separated; delay-aware ones only on asynchronous schedules) against 1F1B with --optimizer, "
                        "e.g. adamw,muon,delay-nesterov")
    return p


def planner_options(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """The planner group's option strings, each with whether it takes a value."""
    group = next(g for g in parser._action_groups if g.title == "planner")
    return {opt: a.nargs != 0 for a in group._group_actions for opt in a.option_strings}


def planner_dests(parser: argparse.ArgumentParser) -> set[str]:
    """The ``dest`` of every planner flag (the rest of the namespace is the trainer's)."""
    group = next(g for g in parser._action_groups if g.title == "planner")
    return {a.dest for a in group._group_actions} - {"device"}  # --device replaces the trainer's


def trainer_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` without the planner's own flags: what the user's ``pretrain_gpt.py`` command had."""
    options, out, skip = planner_options(parser), [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in options:
            skip = options[name] and "=" not in token
            continue
        out.append(token)
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse and refuse a bad target with one line (exit 2) before anything is simulated."""
    from megatron.trainer.config.arguments import finalize_args

    p = build_parser()
    args = p.parse_args(argv)
    if args.config_file is not None or args.dump_config is not None:  # the trainer's (config_file.py)
        p.error("--config-file and --dump-config are the trainers'; give the planner its flags on the command line")
    del args.config_file, args.dump_config  # no part of the run's JobConfig
    sources = [s for s in ("device", "costs", "profile") if getattr(args, s)]
    if len(sources) != 1:
        p.error("give exactly one cost source: --device NAME, --costs FILE or --profile")
    if args.device_memory_gb is not None and args.device_memory_gb <= 0:
        p.error("--device-memory-gb must be positive")
    if args.top < 1:
        p.error("--top must be at least 1")
    if args.probe_convergence is not None and args.probe_convergence < 2:
        p.error("--probe-convergence needs at least 2 updates")
    if args.probe_optimizers is not None and args.probe_convergence is None:
        p.error("--probe-optimizers chooses the optimizers of --probe-convergence; give --probe-convergence N")
    if args.host_cores is not None and args.host_cores < 0:
        p.error("--host-cores must be non-negative (0: a device per rank)")
    args.pipeline_sizes = args.pipeline_sizes or [args.pipeline_model_parallel_size]
    try:
        args = finalize_args(args)
    except ConfigError as e:
        p.error(str(e))
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        p.error(f"--global-batch-size {args.global_batch_size} is not a multiple of micro-batch x data-parallel size")
    for flag, path in (("--png", args.png), ("--save-costs", args.save_costs)):
        if path is not None and (problem := output_path_problem(path)):
            p.error(f"{flag} {path}: {problem}")
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--png needs matplotlib: pip install 'megatron-async[tools]'")
    return args


def output_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be written as a file (checked before planning, which can take minutes
    with --profile), or None."""
    target = Path(path)
    if target.is_dir():
        return "is a directory"
    parent = target.parent
    if not parent.exists():
        return f"{parent} does not exist"
    if not parent.is_dir():
        return f"{parent} is a file, not a directory"
    return None


def unranked_sizes(sizes: list[int], results, num_layers: int) -> list[str]:
    """Why each pipeline size has no simulated candidate: the reason a user needs when a size
    they asked for is missing from the table (the per-schedule refusals are listed separately)."""
    ranked = {r.candidate.pipeline_model_parallel_size for r in results}
    return [f"--pipeline-sizes {n}: {num_layers} layers cannot fill {n} stages (each needs a layer at least)"
            if n > num_layers else f"--pipeline-sizes {n}: every schedule was refused at {n} stages"
            for n in sizes if n not in ranked]


def unit_costs(args: argparse.Namespace, config: JobConfig, shape):
    if args.costs:
        return load_unit_costs(args.costs)
    if args.profile:
        from megatron.trainer.tasks.plan_profile import profile_unit_costs, rank_threads

        ranks = min(args.pipeline_sizes) * args.data_parallel_size * args.tensor_model_parallel_size
        return profile_unit_costs(config, rank_threads(ranks))  # as many threads as the smallest plan's ranks get
    return analytic_unit_costs(shape, DEVICES[args.device], args.tensor_model_parallel_size)


def draw(results, path: str, title: str) -> None:
    """tokens/s against the largest stage's peak memory; marker by semantics; the Pareto front."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron.pipeline.planner.ranking import pareto_front

    markers = {"exact": "o", "bounded-stale": "^", "unbounded": "x"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sem, marker in markers.items():
        pts = [r for r in results if r.semantics == sem]
        if pts:
            ax.scatter([max(r.peak_memory_gb) for r in pts], [r.tokens_per_s for r in pts], marker=marker,
                       s=14, alpha=0.6, label=sem)
    front = pareto_front(results)
    ax.plot([max(r.peak_memory_gb) for r in front], [r.tokens_per_s for r in front], "k-", lw=1, label="Pareto front")
    for r in front:
        ax.annotate(r.candidate.schedule, (max(r.peak_memory_gb), r.tokens_per_s), fontsize=6)
    ax.set_xlabel("peak memory of the largest stage (GB)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from megatron.trainer.config.tied_args import asks_for_tied
    from megatron.trainer.tasks.balanced_partition import model_shape

    args = parse(argv)
    config = build_job_config(args, ignore=planner_dests(build_parser()))  # the trainer's flags, typed
    shape = model_shape(config)
    try:
        unit = unit_costs(args, config, shape)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.host_cores is not None:
        unit = dataclasses.replace(unit, host_cores=args.host_cores or None)
    if args.save_costs:
        save_unit_costs(unit, args.save_costs)
    memory = args.device_memory_gb or (DEVICES[args.device].memory_gb if args.device else None)
    problem = Problem(shape, unit, args.global_batch_size,
                      Parallelism(args.data_parallel_size, args.tensor_model_parallel_size,
                                  config.parallel.use_distributed_optimizer),
                      None if memory is None else memory * 1e9, tied=asks_for_tied(config.model),
                      post_validation=bool(getattr(args, "enable_optimizer_post_validation", False)))
    results, refused = [], []
    for cand, reason in enumerate_candidates(shape, args.pipeline_sizes, args.global_batch_size,
                                             args.data_parallel_size, args.schedules, args.plan_recompute,
                                             args.layer_splits):
        if cand is None:
            refused.append(reason)
            continue
        try:
            results.append(evaluate(problem, cand))
        except (ScheduleConfigError, ScheduleError) as e:
            refused.append(f"{cand.schedule}: {e}")
    missing = unranked_sizes(args.pipeline_sizes, results, shape.num_layers)
    refused += missing
    if not results:
        print("error: no candidate can be ranked:", file=sys.stderr)
        for reason in [*missing, *sorted(set(refused) - set(missing))]:
            print(f"  {reason}", file=sys.stderr)
        return 1
    for reason in missing:
        print(f"note: {reason}", file=sys.stderr)
    sync, asyn = split_by_semantics(rank(results))
    probe_rows = None
    if args.probe_convergence:
        from megatron.trainer.tasks.convergence_probe import probe, table as probe_table

        argv = sys.argv[1:] if argv is None else argv
        try:
            probe_rows = probe(trainer_argv(argv, build_parser()), config, sync, asyn, args.probe_convergence,
                               args.probe_optimizers)
        except (RuntimeError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.json:
        plan = plan_dict(problem, results, refused)
        if probe_rows is not None:
            plan["convergence_probe"] = probe_rows
        print(json.dumps(plan, indent=1))
    else:
        fitting = sum(r.fits for r in results)
        print(f"{len(results)} candidates simulated, {fitting} fit {memory} GB; costs: {unit.source}\n")
        print(table(sync, shape.num_layers, "synchronous (exact semantics), by tokens/s", args.top, problem))
        print()
        print(table(asyn, shape.num_layers, "asynchronous (stale weights, drift per stage), by tokens/s", args.top,
                    problem))
        if probe_rows is not None:
            print()
            print(probe_table(probe_rows))
    if args.png:
        draw(results, args.png, f"{shape.num_layers} layers, h={shape.hidden}; {unit.source}")
    if args.export_csv:
        return export_csvs(args.export_csv, sync[:args.top], args.data_parallel_size, shape.num_layers)
    return 0


def export_csvs(directory: str, ranked: list, data_parallel: int, num_layers: int) -> int:
    """``--export-csv DIR``: the ranked synchronous candidates' orders and the README (issue #44)."""
    from megatron.pipeline.planner.report import flags
    from megatron.pipeline.torch_actions import TorchOrderError, write_csv
    from megatron.pipeline.torch_export import candidate_file_name, candidate_order, torchtitan_settings

    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"error: --export-csv {directory}: {e.strerror}", file=sys.stderr)
        return 2
    lines = ["# Ranked synchronous candidates as torch.distributed.pipelining schedule CSVs", "",
             "Each CSV is one iteration's compute order per rank (`tools/export_schedule.py`'s format); "
             "run it in torchtitan with the settings on its line, or here with `--pipeline-schedule torch-csv:PATH`.", ""]
    for place, result in enumerate(ranked, 1):
        cand = result.candidate
        path = out / candidate_file_name(place, cand)
        try:
            order = candidate_order(result, data_parallel or 1)
        except (TorchOrderError, ScheduleConfigError) as e:
            lines.append(f"{place}. `{cand.schedule}`: not exported ({e})")
            continue
        write_csv(order, str(path))
        lines.append(f"{place}. `{path.name}` ({cand.schedule}, {result.tokens_per_s:.0f} tokens/s simulated; ours: "
                     f"`{' '.join(flags(cand, num_layers))}`): torchtitan {torchtitan_settings(order, path.name)}"
                     f"; layers per stage in order {list(cand.counts)}")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {sum(1 for p in out.glob('*.csv'))} CSVs and README.md to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
