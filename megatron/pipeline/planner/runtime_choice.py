"""``--pipeline-schedule auto``'s decision: the planner's ranking over the schedules a running
job can switch to, from per-stage costs the run profiled (or was given).

Why a subset of the planner's grid: a run has built its stages already, so only what runs on
the same stages can be chosen: the same layout (one chain of ``N`` model parts, the run's layer
split), the same micro-batch count, and, for an asynchronous schedule (``auto-async``), no state
of its own in the stage workers (no weight stash or delta: ``weight_copies == 1``, no weight
policy) and the run's learning-rate schedule. Everything else (interleaving, V placement, AMDP's
replicas, recompute, another split) needs another model build: the V placements and
interleaving the trainer can rebuild in at the decision (:mod:`~megatron.pipeline.planner.relayout`,
given as ``relayouts`` with the chain's ``stage_layers``) are ranked beside the chain's
schedules, priced from the chain's profile; the rest stays with ``tools/plan_pipeline.py``.

Each candidate is simulated as the planner does (:func:`~megatron.pipeline.planner.evaluate.steady_span`:
a synchronous iteration, an asynchronous schedule's steady update) with the per-stage costs, a
Zero Bubble greedy searched under the memory limit; a candidate fits when its simulated peak
activations (in the profiler's units of one micro-batch's activations ``M_B``) stay within the
limit on every stage. The fitting ones are ranked by :func:`~megatron.pipeline.planner.ranking.rank`
(throughput, ties by peak memory, then fewer micro-batches, then registry order).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron.pipeline.planner.candidates import Candidate
from megatron.pipeline.planner.evaluate import CandidateResult, ordering_costs, semantics, steady_span
from megatron.pipeline.costs.memory import StageMemory
from megatron.pipeline.planner.ranking import rank
from megatron.pipeline.planner.relayout import Relayout, peaks_in_chain_units, relayout_stage_costs
from megatron.pipeline.schedules import SCHEDULES, ScheduleConfig, ScheduleConfigError, schedule_class
from megatron.pipeline.schedules.zero_bubble.flags import memory_limited, without_order_costs
from megatron.pipeline.costs.op_costs import OpCosts

def switchable(name: str, config: ScheduleConfig, include_async: bool) -> bool:
    """Whether a run built for ``config``'s one-chain layout can switch to schedule ``name``
    at a drained iteration boundary (module docstring)."""
    cls = schedule_class(name)
    if cls.traits.asynchronous and not include_async:
        return False
    probe = ScheduleConfig(config.num_stages, config.num_microbatches, 1 if not cls.traits.asynchronous else None,
                           data_parallel_size=config.data_parallel_size)
    try:
        cls.check_config(probe)
        policy = cls.traits.policy_for(probe)
        if policy.layout != config.layout or config.num_chunks != 1:
            return False
    except ScheduleConfigError:
        return False
    return not policy.adds_weight_or_lr_policy


@dataclass(frozen=True)
class Choice:
    """One simulated candidate: its marginal time per update (the costs' unit, ms when
    profiled), its peak activations per stage (``M_B`` of its own layout) and whether they fit
    the limit; ``relayout``: the layout to rebuild the run in (None: the run's own chain)."""

    schedule: str
    iteration_time: float
    peak: tuple[float, ...]
    fits: bool
    semantics: str
    relayout: Relayout | None = None

    @property
    def label(self) -> str:
        return self.schedule if self.relayout is None else self.relayout.label

    def candidate(self, config: ScheduleConfig) -> Candidate:
        if self.relayout is not None:
            return self.relayout.candidate(config.num_stages, config.num_microbatches)
        return Candidate(self.schedule, config.num_stages, 1, config.num_microbatches, 1, "none", "even")


def _result(choice: Choice, cand: Candidate) -> CandidateResult:
    """The planner's result record of ``choice`` (activations in ``M_B`` units: the ranking only
    compares them), so the ranking is the planner's own."""
    return CandidateResult(candidate=cand, iteration_time_ms=choice.iteration_time,
                           tokens_per_s=cand.microbatches / choice.iteration_time if choice.iteration_time else 0.0,
                           bubble_fraction=0.0, memory=[StageMemory(0.0, 0.0, 0.0, p) for p in choice.peak],
                           fits=choice.fits, max_drift=[], semantics=choice.semantics)


def simulate_choice(name: str, config: ScheduleConfig, costs: Sequence[OpCosts], memory_limit: float | None,
                    cores: float | None = None) -> Choice:
    """Simulate schedule ``name`` on ``config``'s stages with ``costs`` (ScheduleConfigError when
    it cannot run, e.g. a greedy with no order under the limit); ``cores``: the cores the
    pipeline's stages share on a CPU host (None: a device each)."""
    cand = Candidate(name, config.num_stages, 1, config.num_microbatches, 1, "none", "even")
    options = memory_limited(schedule_class(name).traits.options, memory_limit)
    per_update, result, _ = steady_span(cand, list(costs), config.data_parallel_size, options, cores)
    peak = tuple(float(p) for p in result.peak_memory)
    fits = memory_limit is None or max(peak) <= memory_limit * (1 + 1e-9)  # the limit itself fits
    return Choice(name, per_update, peak, fits, semantics(name))


def simulate_relayout(relayout: Relayout, config: ScheduleConfig, costs: Sequence[OpCosts],
                      stage_layers: Sequence[int], memory_limit: float | None, cores: float | None = None,
                      stage_bytes: Sequence[float] = ()) -> Choice:
    """Simulate ``relayout`` with its parts priced from the chain's ``costs`` (``stage_layers``
    layers per stage), its ops ordered as its flags will order them (ScheduleConfigError when
    it cannot run). Its peaks are in the chain's ``M_B`` per stage where the activation bytes
    are known (``relayout.part_bytes``, ``stage_bytes``: the chain's), else in its own parts'
    (then it fits only without a limit)."""
    cand = relayout.candidate(config.num_stages, config.num_microbatches)
    layout, per_part, priced = relayout_stage_costs(relayout, config.num_stages, config.num_microbatches, costs,
                                                    stage_layers)
    options = without_order_costs(relayout.options)
    per_update, result, _ = steady_span(cand, priced, config.data_parallel_size, options, cores,
                                        order_costs=ordering_costs(relayout.options, priced))
    if relayout.part_bytes and stage_bytes:
        peak = peaks_in_chain_units(relayout, layout, result, per_part, stage_bytes)
        fits = memory_limit is None or max(peak) <= memory_limit * (1 + 1e-9)
    else:
        peak, fits = tuple(float(p) for p in result.peak_memory), memory_limit is None
    return Choice(relayout.schedule, per_update, peak, fits, semantics(relayout.schedule), relayout)


def rank_choices(config: ScheduleConfig, costs: Sequence[OpCosts], memory_limit: float | None,
                 include_async: bool = False, cores: float | None = None,
                 relayouts: Sequence[Relayout] = (), stage_layers: Sequence[int] = (),
                 stage_bytes: Sequence[float] = ()) -> tuple[list[Choice], list[str]]:
    """(every switchable candidate that fits, best first; one line per candidate that cannot run
    or does not fit); ``cores`` as for :func:`simulate_choice`; ``relayouts``: layouts the run
    can be rebuilt in, priced from ``costs`` with the chain's ``stage_layers`` and, under a
    memory limit, its ``stage_bytes`` (:func:`simulate_relayout`)."""
    choices: dict[str, Choice] = {}
    refused: list[str] = []
    for relayout in relayouts:
        try:
            choice = simulate_relayout(relayout, config, costs, stage_layers, memory_limit, cores, stage_bytes)
        except ScheduleConfigError as e:
            refused.append(f"{relayout.label}: {e}")
            continue
        if choice.fits:
            choices[relayout.label] = choice
        else:
            refused.append(f"{relayout.label}: peak {max(choice.peak):g} M_B over the limit {memory_limit:g} M_B"
                           if relayout.part_bytes and stage_bytes else
                           f"{relayout.label}: its activation bytes are unknown, so it cannot be held to a memory limit")
    for name in SCHEDULES:
        if not switchable(name, config, include_async):
            continue
        try:
            choices[name] = simulate_choice(name, config, costs, memory_limit, cores)
        except ScheduleConfigError as e:
            refused.append(str(e))
            continue
        if not choices[name].fits:
            refused.append(f"{name}: peak {max(choices[name].peak):g} M_B over the limit {memory_limit:g} M_B")
    by_candidate = {c.candidate(config): c for c in choices.values()}
    ranked = rank([_result(c, cand) for cand, c in by_candidate.items()])
    return [by_candidate[r.candidate] for r in ranked], refused


def split_text(part_layers: Sequence[int]) -> str:
    """A rebuilt layout's layers per model part and which split that is (even, or balanced:
    the trainer's default moves layers off the ranks holding the embedding and the head)."""
    return f"{list(part_layers)} ({'even' if len(set(part_layers)) == 1 else 'balanced'})"


def choice_table(ranked: Sequence[Choice], unit: str = "ms") -> list[str]:
    """The candidates as log lines (best first)."""
    lines = [f"auto: {'#':>2} {'schedule':<14} {'semantics':<13} {'iteration ' + unit:>13} {'peak M_B':>9}  layers per part"]
    for i, c in enumerate(ranked, 1):
        split = split_text(c.relayout.part_layers) if c.relayout is not None else "the run's split"
        lines.append(f"auto: {i:>2} {c.label:<14} {c.semantics:<13} {c.iteration_time:>13.3f} {max(c.peak):>9.2f}  {split}")
    return lines
