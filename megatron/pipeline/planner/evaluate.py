"""Simulate one candidate's steady state and measure what the planner reports about it.

Why steady state: a long run's throughput sees neither the first fill nor the last drain of an
asynchronous schedule; :func:`steady_span` takes the marginal time of the last half of ``k``
updates, as :func:`megatron.pipeline.simulator.steady_time_per_update` does (a synchronous
schedule flushes every iteration, so its marginal iteration is a whole one, fill and drain
included). The longer run also gives the activation peak and the weight-version drift.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron.pipeline.comm_volume import CommShapes, step_comm_volume
from megatron.pipeline.costs import cost_model as ce
from megatron.pipeline.costs.cost_model import ModelShape
from megatron.pipeline.ir import OpKind
from megatron.pipeline.costs import stages as st
from megatron.pipeline.planner.candidates import Candidate
from megatron.pipeline.costs.memory import StageMemory, fits, stage_memory
from megatron.pipeline.planner.shared_cores import cores_per_pipeline, is_shared, shared_core_makespan
from megatron.pipeline.costs.unit_costs import UnitCosts
from megatron.pipeline.schedules import ScheduleOptions, build_schedule, schedule_class
from megatron.pipeline.schedules.zero_bubble.flags import ZeroBubbleOptions, with_order_costs
from megatron.pipeline.costs.op_costs import CostsLike, OpCosts
from megatron.pipeline.simulator import SimulationResult, simulate_schedule


def update_count(cand: Candidate) -> int:
    """Updates to simulate, ``k``: a synchronous schedule repeats the same iteration, so 2 give
    one marginal iteration. An asynchronous one fills over ``N - 1`` micro-batches, i.e.
    ``ceil((N-1)/a)`` updates, and drains as long; with ``k/2`` at least that plus one, the runs of
    ``k/2`` and ``k`` updates have the same fill and drain and differ by ``k/2`` steady updates."""
    if not cand.asynchronous:
        return 2
    n, a = cand.pipeline_model_parallel_size, cand.microbatches
    return 2 * max(2, -(-(n - 1) // a) + 1)


@dataclass(frozen=True)
class Problem:
    """Everything but the candidate: the model at the user's micro-batch size, the unit costs,
    the global batch, the sharding and the device's memory (bytes; None: no limit)."""

    shape: ModelShape
    unit: UnitCosts
    global_batch: int
    parallel: st.Parallelism = st.Parallelism()
    device_bytes: float | None = None
    host_cores: float | None = None  # cores a node's ranks share (a CPU host); None: the unit costs' own
    tied: bool = True  # the user's flags ask for tied embeddings (no --untie-embeddings-and-output-weights)
    post_validation: bool = False  # --enable-optimizer-post-validation

    def pipeline_cores(self) -> float | None:
        """The cores one pipeline's stages share (every replica's ranks run on the host), or None
        where each has a device: ``host_cores``, else the host the unit costs were profiled on."""
        cores = self.host_cores if self.host_cores is not None else self.unit.host_cores
        if cores is None:
            return None
        return cores_per_pipeline(cores, self.parallel.data_parallel, self.parallel.tensor_parallel)


@dataclass
class CandidateResult:
    """What the planner reports about one candidate (``docs/planning.md`` defines each field)."""

    candidate: Candidate
    iteration_time_ms: float
    tokens_per_s: float
    bubble_fraction: float
    memory: list[StageMemory]
    fits: bool
    max_drift: list[int]
    semantics: str
    comm_bytes_per_step: list[float] = field(default_factory=list)
    stage_costs: list[OpCosts] = field(default_factory=list, repr=False)

    @property
    def peak_memory_gb(self) -> list[float]:
        return [m.total_gb for m in self.memory]


def semantics(schedule: str) -> str:
    """``exact`` (synchronous: every stage computes the same numbers as one device),
    ``bounded-stale`` (asynchronous with a drift bound: every registered one, PACI's
    ``ceil((N-1-s)/a)``, AMDP's one step, 2BW's stash, PipeMare's PACI bound) or ``unbounded``
    (an asynchronous schedule whose traits declare no bound: ``drift_bounded=False``)."""
    cls = schedule_class(schedule)
    if not cls.traits.asynchronous:
        return "exact"
    return "bounded-stale" if cls.traits.drift_bounded else "unbounded"


ASYNCHRONOUS_UNTIED = ("each stage steps on its own clock, and tying would make the first and last stage "
                       "meet at every update")


UNTIED_BY_FLAG = "--untie-embeddings-and-output-weights"


def tied_embeddings(schedule: str, problem: "Problem | None" = None) -> str:
    """Whether ``schedule`` ties the input embedding and the output layer under the user's flags
    (``problem``; None: Megatron-LM's defaults), as the trainer's banner and ``--log-json`` say:
    ``tied`` (every synchronous schedule, Megatron-LM's default, post-validated or not), or
    ``untied: <why>`` (asynchronous schedules keep the two apart; so does the user's
    ``--untie-embeddings-and-output-weights``)."""
    if problem is not None and not problem.tied:
        return f"untied: {UNTIED_BY_FLAG}"
    if schedule_class(schedule).traits.asynchronous:
        return f"untied: {ASYNCHRONOUS_UNTIED}"
    return "tied"


def model_parameters(shape: ModelShape, tied: bool) -> int:
    """Parameters of the whole model (one data-parallel replica, all tensor-parallel shards),
    the vocabulary matrix once when ``tied``: an untied model has ``vocab x hidden`` more."""
    total = (ce.embedding_parameters(shape) + shape.num_layers * ce.layer_parameters(shape)
             + ce.head_parameters(shape))
    return int(total - (shape.vocab * shape.hidden if tied else 0))


def same_model(schedule: str, problem: "Problem | None") -> bool:
    """Whether the candidate trains the model the user's flags ask for: tied unless they untie."""
    asked = problem is None or problem.tied
    return (tied_embeddings(schedule, problem) == "tied") == asked


def candidate_costs(problem: Problem, cand: Candidate) -> tuple[list[st.PartSizes], list[OpCosts], list[OpCosts]]:
    """The candidate's part sizes, each part's costs, and the simulator's per-stage (or per-part)
    costs; stages that time-share the host's cores pay a message's CPU as measured there."""
    shape = dataclasses.replace(problem.shape, micro_batch=cand.micro_batch_size)
    unit = problem.unit.at_micro_batch(cand.micro_batch_size)
    layout = schedule_class(cand.schedule).traits.layout_of(cand.config(1, data_parallel=problem.parallel.data_parallel))
    if is_shared(problem.pipeline_cores(), layout):
        unit = unit.time_sliced()
    parts = st.part_sizes(shape, cand.counts, problem.parallel.tensor_parallel, unit.activations)
    per_part = st.part_costs(shape, unit, parts, problem.parallel, cand.recompute)
    costs = st.simulator_costs(layout, per_part, unit.sync)
    if st.hosts_replicas(layout):
        costs = st.replica_step_costs(layout, parts, costs, unit)
    return parts, per_part, costs


def activation_peaks(result: SimulationResult, layout: object, parts: list[st.PartSizes],
                     per_part: list[OpCosts]) -> list[float]:
    """Each stage's activation peak in bytes, walking its ops in order with each op's own
    part's bytes (``M_B`` of that part times its op's memory delta). Why not the simulator's
    peak in ``M_B`` units times a stage's mean ``M_B``: a stage hosting several parts of unequal
    size (a V's stage 0 holds the embedding's part and the head's) peaks at a mix the mean
    misprices (by up to 40 % on the CPU GPT of docs/planning.md); with one part per stage both
    are the same number."""
    peaks = []
    for spans in result.spans:
        live = peak = 0.0
        for span in spans:
            op = span.op
            if op.kind is OpKind.OPT:
                continue
            part = layout.model_stage(op.stage, op.chunk)  # type: ignore[attr-defined]
            live += per_part[part].memory_delta(op.kind) * parts[part].activation_bytes
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def flag_order_costs(cand: Candidate, costs: list[OpCosts], data_parallel: int) -> CostsLike:
    """The costs the runtime orders ``cand``'s ops by when it runs the planner's flags (every
    schedule flag at its default): ``costs`` where those flags profile first (zb-1p, zb-2p) or
    the schedule takes no costs from its flags, else the costs the flags give (zb-v, which does
    not profile by default: the placeholder ``T_F = T_B = T_W``).

    Why: a cost-driven order differs with its costs, and so do its time and its activation peak
    (zb-v at N = 4, m = 8 on the CPU GPT: 13 % more activations ordered by the profile than the
    runtime's placeholder order holds). The planner predicts what its flags will run."""
    traits = schedule_class(cand.schedule).traits
    defaults = {flag.dest: flag.default_value for group in traits.flag_groups for flag in group.flags}
    return ordering_costs(traits.options_from_flags(defaults, cand.config(1, data_parallel=data_parallel)), costs)


def ordering_costs(options: ScheduleOptions, costs: Sequence[OpCosts]) -> CostsLike:
    """The costs a schedule with ``options`` (from its flags) orders its ops by: ``costs`` (what
    was profiled) where it profiles first or takes no costs, else the costs its flags give."""
    if not isinstance(options, ZeroBubbleOptions) or options.profile_iters or options.costs is None:
        # Why not a schedule that takes no costs from its flags: its order does not depend on them
        return tuple(costs)
    return options.costs  # type: ignore[no-any-return]


def steady_span(cand: Candidate, costs: list[OpCosts], data_parallel: int, options: ScheduleOptions | None = None,
                cores: float | None = None, order_costs: CostsLike = None) -> tuple[float, SimulationResult, object]:
    """(marginal time of one update, the longer run's result, its schedule); ``options``: the
    schedule's other options (a Zero Bubble greedy's ``memory_limit``); ``cores``: the cores
    the stages share (None: a device each), when fewer than the stages the marginal time comes
    from the processor-sharing replay; ``order_costs``: the
    costs a cost-driven order is built from (None: ``costs``, which always time it)."""
    k = update_count(cand)
    ordered_by = tuple(costs) if order_costs is None else order_costs
    runs = []
    for iterations in (k // 2, k):
        kind = schedule_class(cand.schedule).traits.options
        config = cand.config(iterations, with_order_costs(options or ScheduleOptions(), kind, ordered_by), data_parallel)
        schedule = build_schedule(cand.schedule, config)
        result = simulate_schedule(schedule, tuple(costs))
        span = result.makespan
        if is_shared(cores, schedule.layout):
            span = shared_core_makespan(schedule.streams(), schedule.layout, tuple(costs), cores)  # type: ignore[arg-type]
        runs.append((span, result, schedule))
    return (runs[1][0] - runs[0][0]) / (k - k // 2), runs[1][1], runs[1][2]


def evaluate(problem: Problem, cand: Candidate) -> CandidateResult:
    """Simulate ``cand`` (raises the schedule's ScheduleConfigError or the replay's ScheduleError)."""
    par = problem.parallel
    parts, per_part, costs = candidate_costs(problem, cand)
    per_update, result, schedule = steady_span(cand, costs, par.data_parallel, cores=problem.pipeline_cores(),
                                               order_costs=flag_order_costs(cand, costs, par.data_parallel))
    layout = schedule.layout
    k = update_count(cand)
    busy = max(result.busy) / k
    copies = schedule.policy.weight_copies
    own = layout.num_pipelines if st.hosts_replicas(layout) else 1  # AMDP: one stage replica per pipeline
    shards = par.data_parallel if par.distributed_optimizer else 1
    peaks = activation_peaks(result, layout, parts, per_part) if not st.hosts_replicas(layout) else \
        [result.peak_memory[s] * st.stage_activation_unit(layout, parts, s) for s in range(layout.num_stages)]
    memory = [stage_memory(st.stage_params(layout, parts, s), problem.shape.param_bytes, max(0, copies[s] - own),
                           shards, peaks[s], 1.0) for s in range(layout.num_stages)]
    tokens = cand.microbatches * cand.micro_batch_size * problem.shape.seq_length * par.data_parallel
    return CandidateResult(
        candidate=cand, iteration_time_ms=per_update, tokens_per_s=tokens / per_update * 1e3,
        bubble_fraction=max(0.0, 1.0 - busy / per_update) if per_update > 0 else 0.0,
        memory=memory, fits=fits(memory, problem.device_bytes), max_drift=result.max_drift,
        semantics=semantics(cand.schedule), comm_bytes_per_step=comm_bytes(problem, cand, parts, schedule),
        stage_costs=costs)


def comm_bytes(problem: Problem, cand: Candidate, parts: list[st.PartSizes], schedule: object) -> list[float]:
    """Per stage, the payload bytes one rank sends per step (P2P, data-parallel reduction, the
    step's collectives: :func:`megatron.pipeline.comm_volume.step_comm_volume`)."""
    layout = schedule.layout  # type: ignore[attr-defined]
    shape = problem.shape
    chunk_params = {(s, c): int(parts[layout.model_stage(s, c)].params)
                    for s in range(layout.num_stages) for c in range(layout.num_chunks)}
    shapes = CommShapes(activation_elements=shape.seq_length * cand.micro_batch_size * shape.hidden
                        // problem.parallel.tensor_parallel,
                        activation_bytes=shape.activation_bytes, chunk_params=chunk_params,
                        data_parallel_size=problem.parallel.data_parallel)
    volumes = step_comm_volume(schedule, shapes)  # type: ignore[arg-type]
    return [sum(v for key, v in vol.items() if key not in ("p2p_messages", "updates")) for vol in volumes]
