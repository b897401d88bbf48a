"""Our op streams <-> ``torch.distributed.pipelining``'s compute-only action lists (issue #44).

torch's ``_PipelineScheduleRuntime`` runs any order loaded from a compute-only CSV
(``_load_csv``): one row per rank, one cell per action, written ``<stage><type><microbatch>``
(``_Action.from_str``), e.g. ``0F0,0F1,1I0,1W0``. Types: ``F`` forward, ``I`` backward for the
input only, ``W`` the deferred weight gradient, ``B`` the full backward. An empty cell is an
idle step (torch's own orders pad with them); ``(a;b)OVERLAP_F_B`` runs ``a`` then ``b``
(DualPipeV's overlapped slots). Micro-batch indices count from 0 in every iteration.

Mapping of ops (one iteration of a synchronous schedule; its OPT and post-validation ops are
dropped: torch's runtime steps the optimizer outside ``step()``):

==========  ===========================================
ours        torch
==========  ===========================================
``F``       ``F``
``B``       ``I`` (the input-gradient half of the split)
``W``       ``W``
``BW``      ``B`` (fused backward)
==========  ===========================================

Stage numbering. torch numbers the model parts ``0 .. S-1`` along the model and infers which
rank holds each part from the rows that name it (``_validate_schedule``). Our
(stage, chunk) -> model part is :meth:`PipelineLayout.virtual`, and it is torch's numbering
for the three placements both sides have:

* chain: rank ``r`` holds part ``r`` (``S = N``);
* loop (interleaved, torch's default ``generate_stage_to_rank_mapping``): rank ``r`` holds
  parts ``r, r + N, ...`` (chunk ``c`` is part ``c N + r``);
* V (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, style ``"v"``): rank ``r`` holds
  parts ``r`` (chunk 0) and ``2N - 1 - r`` (chunk 1), :class:`VShapeLayout`.

An imported CSV gets its layout from the part-to-rank mapping the same way; a mapping that is
none of the three is refused. Pure: standard library and the IR only (no torch).
"""
from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from megatron.pipeline.ir import POST_VALIDATION_KINDS, MultiPipelineLayout, Op, OpKind, PipelineLayout, VShapeLayout

#: our op kind -> torch's computation type
TORCH_TYPE: dict[OpKind, str] = {OpKind.F: "F", OpKind.B: "I", OpKind.W: "W", OpKind.BW: "B"}
#: torch's computation type -> our op kind
OUR_KIND: dict[str, OpKind] = {v: k for k, v in TORCH_TYPE.items()}

#: why an asynchronous schedule cannot be exported
ASYNC_REFUSAL = ("{name} is asynchronous: its stages step the optimizer inside the op stream (stage-local, "
                 "between micro-batches), and torch's _PipelineScheduleRuntime has no optimizer step inside "
                 "an iteration (step() runs the compute order only; the optimizer steps after it)")

_ACTION = re.compile(r"^(\d+)(F|I|W|B)(\d+)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
#: an op as our messages print it (``str(Op)``): kind, micro-batch, chunk, stage
_OP_TEXT = re.compile(r"\b(BW|F|B|W)(\d+)(?:\.c(\d+))?@s(\d+)")


class TorchOrderError(ValueError):
    """An order that cannot be exported or imported; the message is one line meant for the user."""


@dataclass(frozen=True, slots=True)
class TorchAction:
    """One compute action of torch's schedule IR (``_Action`` without sub-actions)."""

    stage: int  # torch's stage index: the model part
    kind: str  # F, I, W or B
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def placement(layout: PipelineLayout) -> str:
    """``chain``, ``loop`` or ``v``: the torch placement of ``layout`` (module docstring)."""
    if isinstance(layout, MultiPipelineLayout):
        raise TorchOrderError("a layout of several replicated pipelines (AMDP) has no torch placement")
    if isinstance(layout, VShapeLayout):
        return "v"
    if type(layout) is not PipelineLayout:
        raise TorchOrderError(f"layout {type(layout).__name__} has no torch placement (chain, loop or V)")
    return "chain" if layout.num_chunks == 1 else "loop"


def torch_stage(layout: PipelineLayout, stage: int, chunk: int) -> int:
    """torch's stage index of chunk ``chunk`` of our stage ``stage``."""
    placement(layout)
    return layout.virtual(stage, chunk)


def layout_from_mapping(stage_to_rank: dict[int, int], num_ranks: int) -> PipelineLayout:
    """Our layout from torch's part -> rank mapping (as ``_validate_schedule`` infers it from
    which row names each part); :class:`TorchOrderError` when it is not chain, loop or V."""
    parts = len(stage_to_rank)
    if sorted(stage_to_rank) != list(range(parts)):
        missing = min(set(range(max(stage_to_rank) + 1)) - set(stage_to_rank))
        raise TorchOrderError(f"no rank runs stage {missing} (stages must be numbered 0..S-1 without gaps)")
    if parts % num_ranks:
        raise TorchOrderError(f"{parts} stages do not divide over {num_ranks} ranks")
    candidates = [PipelineLayout(num_ranks, parts // num_ranks)]
    if parts == 2 * num_ranks:
        candidates.append(VShapeLayout(num_ranks))
    for layout in candidates:
        if all(layout.physical(s)[0] == r for s, r in stage_to_rank.items()):
            return layout
    loop = candidates[0]
    wrong = next(s for s, r in sorted(stage_to_rank.items()) if loop.physical(s)[0] != r)
    raise TorchOrderError(
        f"rank {stage_to_rank[wrong]} runs stage {wrong}: the stage-to-rank mapping is neither the loop placement "
        f"(stage s on rank s mod {num_ranks}) nor the V (stages r and {2 * num_ranks - 1}-r on rank r)")


@dataclass(frozen=True)
class TorchOrder:
    """One iteration's compute order, per rank, in torch's terms, with the layout it implies."""

    ranks: tuple[tuple[TorchAction, ...], ...]
    layout: PipelineLayout
    num_microbatches: int

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def stages_per_rank(self) -> int:
        return self.layout.num_chunks

    @property
    def placement(self) -> str:
        return placement(self.layout)

    def to_csv(self) -> str:
        """torch's compute-only CSV (``_dump_csv(format="compute_only")`` without idle cells)."""
        return "".join(",".join(str(a) for a in row) + "\n" for row in self.ranks)

    def op(self, action: TorchAction, first_microbatch: int = 0) -> Op:
        stage, chunk = self.layout.physical(action.stage)
        return Op(OUR_KIND[action.kind], stage, first_microbatch + action.microbatch, chunk)

    def iteration_ops(self, rank: int, first_microbatch: int = 0) -> Iterator[Op]:
        """Rank ``rank``'s ops of one iteration whose micro-batch 0 is ``first_microbatch``."""
        for action in self.ranks[rank]:
            yield self.op(action, first_microbatch)

    def streams(self) -> list[list[Op]]:
        """Every rank's ops of one iteration (micro-batches 0..m-1), no optimizer step."""
        return [list(self.iteration_ops(r)) for r in range(self.num_ranks)]

    def torch_text(self, message: str) -> str:
        """``message`` (the schedule check's, which prints ops as ``B3.c1@s0``) with every op
        written as torch's action on its rank (``rank 0 action 7B3``)."""
        def sub(match: re.Match[str]) -> str:
            kind, mb, chunk, stage = match.group(1), int(match.group(2)), int(match.group(3) or 0), int(match.group(4))
            action = TorchAction(self.layout.virtual(stage, chunk), TORCH_TYPE[OpKind(kind)], mb)
            return f"action {action} (rank {stage})"
        return re.sub(r"^(?:deadlock: )?stage (\d+):", lambda m: m.group(0).replace("stage", "rank"),
                      _OP_TEXT.sub(sub, message))


def order_from_streams(streams: Sequence[Iterable[Op]], layout: PipelineLayout, num_microbatches: int,
                       first_microbatch: int = 0) -> TorchOrder:
    """One iteration of synchronous streams (micro-batches ``first_microbatch ..
    first_microbatch + m - 1``) as torch's order. Each stream is read up to its first
    optimizer step (OPT or post-validation's PSTEP); post-validation's other ops are dropped."""
    placement(layout)
    ranks = []
    for stage, stream in enumerate(streams):
        row = []
        for op in stream:
            if op.kind in (OpKind.OPT, OpKind.PSTEP):
                break
            if op.kind in POST_VALIDATION_KINDS:
                continue
            if op.kind not in TORCH_TYPE:
                raise TorchOrderError(f"stage {stage}: {op} has no torch action (only F, B, W, BW export)")
            mb = op.microbatch - first_microbatch
            if not 0 <= mb < num_microbatches:
                raise TorchOrderError(f"stage {stage}: {op} is outside the iteration's micro-batches "
                                      f"{first_microbatch}..{first_microbatch + num_microbatches - 1}")
            row.append(TorchAction(torch_stage(layout, op.stage, op.chunk), TORCH_TYPE[op.kind], mb))
        ranks.append(tuple(row))
    return TorchOrder(tuple(ranks), layout, num_microbatches)


def order_from_schedule(schedule: object) -> TorchOrder:
    """The first iteration of a built synchronous schedule (read through ``streams()``, its layout
    and config); asynchronous schedules are refused with the reason."""
    name = schedule.name
    if schedule.traits.asynchronous:
        raise TorchOrderError(ASYNC_REFUSAL.format(name=name))
    config = schedule.config  # type: ignore[attr-defined]
    m = config.num_microbatches
    return order_from_streams(schedule.streams(), schedule.layout, m,  # type: ignore[attr-defined]
                              first_microbatch=config.first_iteration * m)


# --------------------------------------------------------------------------- reading a CSV


def _parse_cell(cell: str, rank: int, index: int) -> list[TorchAction]:
    text = cell.strip()
    if not text:
        return []  # an idle step
    overlap = _OVERLAP.match(text)
    if overlap:
        out = []
        for sub in overlap.group(1).split(";"):
            out.extend(_parse_cell(sub, rank, index))
        return out
    match = _ACTION.match(text)
    if match is None:
        raise TorchOrderError(
            f"rank {rank}, action {index} {text!r}: unknown action (a compute-only CSV has "
            f"<stage><F|I|W|B><microbatch> cells, e.g. 0F1, or (a;b)OVERLAP_F_B)")
    return [TorchAction(int(match.group(1)), match.group(2), int(match.group(3)))]


def _check_rank(rank: int, row: Sequence[tuple[int, TorchAction]], num_microbatches: int) -> None:
    """Per rank, per part: each micro-batch forwarded once, then backwarded once (``B``, or ``I``
    then ``W``) -- what torch's ``_validate_schedule`` and our schedule check both require."""
    forwarded: set[tuple[int, int]] = set()
    backward: dict[tuple[int, int], str] = {}  # -> "B", "I" or "IW"

    def fail(index: int, action: TorchAction, why: str) -> None:
        raise TorchOrderError(f"rank {rank}, action {index} {action}: {why}")

    for index, action in row:
        key = (action.stage, action.microbatch)
        if action.kind == "F":
            if key in forwarded:
                fail(index, action, "runs the forward of its micro-batch twice")
            forwarded.add(key)
        elif action.kind in ("B", "I"):
            if key not in forwarded:
                fail(index, action, f"runs before the forward {action.stage}F{action.microbatch}")
            if key in backward:
                fail(index, action, "runs a backward of its micro-batch twice")
            backward[key] = action.kind
        else:  # W
            if backward.get(key) != "I":
                why = ("has no preceding backward-input " f"{action.stage}I{action.microbatch}"
                       if key not in backward or backward[key] == "B"
                       else "runs the weight gradient of its micro-batch twice")
                fail(index, action, why)
            backward[key] = "IW"
    parts = sorted({a.stage for _, a in row})
    for part in parts:
        for mb in range(num_microbatches):
            key = (part, mb)
            if key not in forwarded:
                raise TorchOrderError(f"rank {rank}: stage {part} never runs {part}F{mb} "
                                      f"(every stage forwards micro-batches 0..{num_microbatches - 1})")
            if key not in backward:
                raise TorchOrderError(f"rank {rank}: {part}F{mb} never has a backward ({part}B{mb} or {part}I{mb})")
            if backward[key] == "I":
                raise TorchOrderError(f"rank {rank}: {part}I{mb} never gets its {part}W{mb}")


def parse_csv(text: str, source: str = "CSV") -> TorchOrder:
    """A compute-only CSV as an order: placement inferred from which row names each stage (as
    torch does), per-rank dependencies checked; :class:`TorchOrderError` (one line, naming the
    rank and the action) otherwise. Cross-rank faults (deadlock) are :func:`check_order`'s."""
    rows = [row for row in csv.reader(io.StringIO(text))]
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()  # trailing blank lines
    if not rows:
        raise TorchOrderError(f"{source}: no rows (one row of actions per rank)")
    parsed: list[list[tuple[int, TorchAction]]] = []
    stage_to_rank: dict[int, int] = {}
    for rank, row in enumerate(rows):
        try:
            actions = [(index, a) for index, cell in enumerate(row) for a in _parse_cell(cell, rank, index)]
        except TorchOrderError as exc:
            raise TorchOrderError(f"{source}: {exc}") from None
        if not actions:
            raise TorchOrderError(f"{source}: rank {rank} has no actions")
        for index, action in actions:
            owner = stage_to_rank.setdefault(action.stage, rank)
            if owner != rank:
                raise TorchOrderError(
                    f"{source}: rank {rank}, action {index} {action}: stage {action.stage} is also run by rank {owner}")
        parsed.append(actions)
    try:
        layout = layout_from_mapping(stage_to_rank, len(rows))
    except TorchOrderError as exc:
        raise TorchOrderError(f"{source}: {exc}") from None
    m = 1 + max(a.microbatch for row in parsed for _, a in row)
    for rank, row in enumerate(parsed):
        try:
            _check_rank(rank, row, m)
        except TorchOrderError as exc:
            raise TorchOrderError(f"{source}: {exc}") from None
        held = {a.stage for _, a in row}
        want = {layout.virtual(rank, c) for c in range(layout.num_chunks)}
        if held != want:  # cannot happen after layout_from_mapping, kept as a guard
            raise TorchOrderError(f"{source}: rank {rank} runs stages {sorted(held)}, its placement holds {sorted(want)}")
    return TorchOrder(tuple(tuple(a for _, a in row) for row in parsed), layout, m)


def read_csv(path: str) -> TorchOrder:
    """:func:`parse_csv` of a file (one-line :class:`TorchOrderError` if it cannot be read)."""
    try:
        with open(path, newline="") as f:
            text = f.read()
    except OSError as exc:
        raise TorchOrderError(f"{path}: cannot read the schedule CSV ({exc.strerror})") from None
    return parse_csv(text, source=path)


def check_order(order: TorchOrder, source: str = "CSV") -> None:
    """The schedule check (:func:`megatron.pipeline.schedule_check.check_streams`, the preflight's
    replay: deadlocks, unmatched or misordered messages) over one iteration of ``order``; a fault
    is one line naming the rank and the action in torch's notation."""
    from megatron.pipeline.preflight import one_line
    from megatron.pipeline.replay import ScheduleError
    from megatron.pipeline.schedule_check import check_streams

    try:
        check_streams(order.streams(), order.layout)
    except ScheduleError as exc:
        raise TorchOrderError(f"{source}: {order.torch_text(one_line(exc))}") from None


def write_csv(order: TorchOrder, path: str) -> None:
    with open(path, "w", newline="") as f:
        f.write(order.to_csv())


__all__ = [
    "ASYNC_REFUSAL",
    "OUR_KIND",
    "TORCH_TYPE",
    "TorchAction",
    "TorchOrder",
    "TorchOrderError",
    "check_order",
    "layout_from_mapping",
    "order_from_schedule",
    "order_from_streams",
    "parse_csv",
    "placement",
    "read_csv",
    "torch_stage",
    "write_csv",
]
