"""``--pipeline-schedule auto`` choosing a V or interleaved layout and rebuilding the run in it.

References, each independent of the code under test:

* pricing: per-layer and head costs computed by hand from a chain's stage costs;
* the V's optimum with every chain stage costing ``T_F = T_B = T_W = t`` (no head cost): on a V
  each stage holds two half-stage chunks, so stage ``N - 1`` cannot start before micro-batch 0's
  forward has passed ``N - 1`` chunks of ``t / 2``, and then has ``3 m t`` of work:
  ``(N - 1) t / 2 + 3 m t``, below the chain's ``(N - 1) t + 3 m t`` (tests/test_auto_schedule.py);
* the rebuilt run equals a run of the user's flags saved at the decision boundary and resumed
  with the chosen schedule (bitwise in the emulator), and the distributed runtime equals it too;
* a resumed ``auto`` run keeps the layout: it equals the run that saved, continued.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import megatron.pipeline.planner.auto_schedule as auto_schedule
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.planner.relayout import Relayout, part_costs
from megatron.pipeline.costs.unit_costs import layer_and_head
from megatron.pipeline.planner.runtime_choice import Choice, rank_choices
from megatron.pipeline.schedules import ScheduleConfig, build_schedule
from megatron.trainer.loop.auto.candidates import without_flags
from tests.async_helpers import TINY_GPT, final_params, run_pretrain

auto_schedule.register_auto_selectors()  # auto, auto-async

V_SCHEDULES = ("zb-v", "v-half", "v-min", "dualpipev")


def _v_relayouts(n: int, layers_per_part: int = 1) -> list[Relayout]:
    parts = (layers_per_part,) * (2 * n)
    return [Relayout(name, 2, parts) for name in V_SCHEDULES] + [Relayout("interleaved-1f1b", 2, parts)]


def test_layer_and_head_costs_are_derived_from_the_chain() -> None:
    """Stage 0: 2 layers (F 2, B 4, W 1); stage 1: 2 layers and the head (F 5, B 9, W 1.5):
    a layer is (1, 2, 0.5), the head (3, 5, 0.5); a V's parts of one layer each cost a layer,
    the last also the head, and keep the last stage's M_W / M_B."""
    chain = [OpCosts(2.0, 4.0, 1.0, t_comm=0.1, m_w=0.8), OpCosts(5.0, 9.0, 1.5, t_comm=0.1, m_w=0.6)]
    layer, head = layer_and_head([dataclasses.asdict(c) for c in chain], [2, 2])
    assert (layer.f, layer.b, layer.w) == pytest.approx((1.0, 2.0, 0.5))
    assert (head.f, head.b, head.w) == pytest.approx((3.0, 5.0, 0.5))
    parts = part_costs(chain, [2, 2], [1, 1, 1, 1])
    assert [p.t_f for p in parts] == pytest.approx([1.0, 1.0, 1.0, 4.0])
    assert [p.t_b for p in parts] == pytest.approx([2.0, 2.0, 2.0, 7.0])
    assert [p.m_w for p in parts] == pytest.approx([0.8, 0.8, 0.8, 0.6]) and all(p.t_comm == 0.1 for p in parts)
    # three stages of 1, 3 and 2 layers: the first two give the layer (F (1 + 3) / 4 = 1 per layer)
    three = [OpCosts(1.0, 1.0, 1.0), OpCosts(3.0, 3.0, 3.0), OpCosts(6.0, 2.0, 2.0)]
    layer, head = layer_and_head([dataclasses.asdict(c) for c in three], [1, 3, 2])
    assert layer.f == pytest.approx(1.0) and (head.f, head.b, head.w) == pytest.approx((4.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="no layers"):
        layer_and_head([dataclasses.asdict(OpCosts())] * 2, [0, 4])


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8), (3, 6)])
def test_a_v_reaches_its_analytic_optimum_and_auto_rebuilds_in_it(n: int, m: int) -> None:
    equal = (OpCosts(1.0, 1.0, 1.0, m_w=1.0),) * n
    ranked, _ = rank_choices(ScheduleConfig(n, m, 1), equal, None, relayouts=_v_relayouts(n), stage_layers=(2,) * n)
    assert ranked[0].relayout is not None and ranked[0].relayout.schedule in V_SCHEDULES
    assert ranked[0].iteration_time == pytest.approx((n - 1) / 2 + 3 * m, rel=1e-12)
    chain = next(c for c in ranked if c.relayout is None)
    assert chain.iteration_time == pytest.approx((n - 1) + 3 * m, rel=1e-12)
    # the schedule: the decision names the rebuild, and the stream ends where it happens
    options = auto_schedule.AutoOptions(profile_iters=2, relayouts=tuple(_v_relayouts(n)), stage_layers=(2,) * n)
    auto = build_schedule("auto", ScheduleConfig(n, m, 5, options=options))
    auto.set_costs(equal)
    assert auto.relayout == ranked[0].relayout
    assert auto.decision_lines()[0].startswith(f"auto: chose {ranked[0].schedule} (stages rebuilt as {ranked[0].label})")
    assert auto.checkpoint_state()["relayout"] == ranked[0].label
    opts = [op for op in auto.stage_ops(0) if op.kind.value == "OPT"]
    assert [op.update for op in opts] == [0, 1]  # nothing after the boundary: the trainer rebuilds there


def test_a_rebuild_must_beat_the_chain_by_the_margin() -> None:
    chain = Choice("zb-h1", 100.0, (2.0,), True, "exact")
    v = Choice("zb-v", 100.0 / (1 + auto_schedule.RELAYOUT_MARGIN) + 0.01, (2.0,), True, "exact",
               Relayout("zb-v", 2, (1, 1, 1, 1)))
    assert auto_schedule._pick([v, chain]) is chain
    faster = Choice("zb-v", 100.0 / (1 + auto_schedule.RELAYOUT_MARGIN) - 0.01, (2.0,), True, "exact", v.relayout)
    assert auto_schedule._pick([faster, chain]) is faster


def test_a_rebuilt_layout_is_held_to_the_memory_limit_in_the_chain_units() -> None:
    """Every part keeps half a chain stage's bytes: a V stage's peak in chain units is half its
    peak in its own parts' (both chunks alike); without the bytes it is refused under a limit."""
    n, m = 2, 4
    equal = (OpCosts(1.0, 1.0, 1.0, m_w=1.0),) * n
    half = [Relayout(r.schedule, 2, r.part_layers, part_bytes=(50.0,) * (2 * n)) for r in _v_relayouts(n)]
    free, _ = rank_choices(ScheduleConfig(n, m, 1), equal, None, relayouts=_v_relayouts(n), stage_layers=(2,) * n)
    own = {c.label: max(c.peak) for c in free if c.relayout is not None}
    held, refused = rank_choices(ScheduleConfig(n, m, 1), equal, 1.5, relayouts=half, stage_layers=(2,) * n,
                                 stage_bytes=(100.0,) * n)
    for c in held:
        if c.relayout is not None:
            assert max(c.peak) == pytest.approx(own[c.label] / 2) and max(c.peak) <= 1.5
    assert any("over the limit 1.5" in r for r in refused) or all(v / 2 <= 1.5 for v in own.values())
    _, unknown = rank_choices(ScheduleConfig(n, m, 1), equal, 100.0, relayouts=_v_relayouts(n), stage_layers=(2,) * n)
    assert sum("activation bytes are unknown" in r for r in unknown) == len(_v_relayouts(n))


def test_auto_only_flags_are_dropped_from_the_rebuilt_command_line() -> None:
    """The rebuilt layout's flags are the user's with ``auto``'s own back at their defaults (as
    if not given), those the target takes kept; the user's flags themselves unchanged."""
    from megatron.trainer.config.arguments import build_parser

    parser = build_parser()  # the user's flags as given: parsed, nothing derived yet
    argv = ["--lr", "1e-2", "--zb-profile-iters", "2", "--zb-memory-limit=3", "--zb-costs", "c.json", "--seed", "3"]
    flags = parser.parse_args(["--pipeline-schedule", "auto", *argv])
    given = vars(parser.parse_args(["--pipeline-schedule", "auto", *argv]))
    plain = vars(parser.parse_args(["--pipeline-schedule", "auto", "--lr", "1e-2", "--seed", "3"]))
    assert vars(without_flags(flags, "auto", "dualpipev")) == plain
    assert vars(without_flags(flags, "auto", "zb-v")) == given  # zb-v takes the Zero Bubble flags itself
    assert vars(flags) == given


def _offered(*extra: str) -> list[str]:
    """The rebuildable layouts the launch hands an ``auto`` run of these flags (PP2, DP2, 8 layers)."""
    from megatron.trainer.loop.training import preflight
    from megatron.trainer.tasks.gpt import GPTTask

    argv = [*TINY_GPT[:-1], "--num-layers", "8", "--global-batch-size", "8", "--mock-data", "--device", "cpu",
            "--pipeline-schedule", "auto", "--pipeline-model-parallel-size", "2", "--data-parallel-size", "2", *extra]
    config = preflight(GPTTask(), argv)
    return [r.label for r in auto_schedule.auto_options(config.run.schedule.options).relayouts]


def test_only_layouts_of_the_same_model_are_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tied embeddings with --overlap-grad-reduce (with or without the distributed optimizer):
    the V layouts tie there too now (#42), so they train the chain's model and are offered beside
    interleaving, as untied. (This test used to expect interleaving only: a V untied under
    overlap.) A layout whose flags would derive another model is still not offered (its
    checkpoint signature differs): a V made to untie is dropped. An odd layer split cannot halve
    into a V's chunks, nor split interleaved stages."""
    from megatron.pipeline.schedules.v_shape.layout import VShapeSchedule
    from megatron.pipeline.schedules import schedule_class
    from megatron.trainer.config import tied_args

    every = ["interleaved-1f1b x2", "interleaved-1f1b x4", "zb-v x2", "v-half x2", "v-min x2", "dualpipev x2"]
    assert TINY_GPT[-1] == "--untie-embeddings-and-output-weights"
    assert _offered("--overlap-grad-reduce") == every
    assert _offered("--overlap-grad-reduce", "--use-distributed-optimizer") == every
    assert _offered("--overlap-grad-reduce", "--untie-embeddings-and-output-weights") == every
    untied = tied_args._untied_because
    monkeypatch.setattr(tied_args, "_untied_because", lambda config: "untied for this test" if issubclass(
        schedule_class(config.schedule.pipeline_schedule), VShapeSchedule) else untied(config))
    assert _offered("--overlap-grad-reduce") == every[:2]
    monkeypatch.undo()
    assert _offered("--pipeline-layer-split", "3", "5") == []
    assert _offered("--pipeline-layer-split", "2", "6") == every[2:]


# ------------------------------------------------------------------ end to end

pytestmark = pytest.mark.usefixtures("megatron_world1")
K = 2


def _gpt(schedule: str, *extra: str) -> list[str]:
    """A tiny PP2 GPT with m = 2: the chain's fill costs a V half as much, a ~15 % margin."""
    return [*TINY_GPT, "--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
            "--global-batch-size", "2", "--train-iters", "5", "--log-interval", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--device", "cpu", *extra]


def _emulate(argv: list[str], log: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Through the launch's own preflight (which offers the layouts), in this process."""
    from megatron.trainer.loop.training import preflight
    from megatron.trainer.loop.training import emulate
    from megatron.trainer.tasks.gpt import GPTTask

    task = GPTTask()
    threads = torch.get_num_threads()
    try:
        workers = emulate(task, preflight(task, [*argv, "--pipeline-executor", "emulator", "--log-json", str(log)]))
    finally:
        torch.set_num_threads(threads)
    return _losses(log), final_params(workers)


def _losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines() if '"loss"' in line]


def _rebuilt_as(out: str) -> tuple[str, int]:
    """The layout ``auto`` rebuilt the stages in: (schedule, model chunks per stage)."""
    found = re.search(r"auto: rebuilt the stages as (\S+) x(\d+) at iteration 2", out)
    assert found, out[-3000:]
    return found.group(1), int(found.group(2))


def _layout_flags(chosen: tuple[str, int]) -> list[str]:
    """The flags that build ``chosen`` from the start: a V holds two chunks by itself, an
    interleaving needs its layers per virtual stage (4 layers over PP 2)."""
    schedule, chunks = chosen
    return ["--num-layers-per-virtual-pipeline-stage", str(4 // (2 * chunks))] if schedule == "interleaved-1f1b" else []


def _saved_and_resumed(tmp_path: Path, chosen: tuple[str, int]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """ZB-H1 (auto's profiling order) saved and stopped at K, resumed with ``chosen``."""
    first, _ = _emulate(_gpt("zb-h1", "--save", str(tmp_path / "ck"), "--exit-interval", str(K)), tmp_path / "a.jsonl")
    rest, params = _emulate(_gpt(chosen[0], *_layout_flags(chosen), "--load", str(tmp_path / "ck")),
                            tmp_path / "b.jsonl")
    return first + rest, params


def test_the_rebuilt_run_equals_one_saved_at_the_boundary_and_resumed(tmp_path: Path, capsys) -> None:
    losses, params = _emulate(_gpt("auto", "--zb-profile-iters", str(K)), tmp_path / "auto.jsonl")
    chosen = _rebuilt_as(capsys.readouterr().out)
    ref_losses, ref_params = _saved_and_resumed(tmp_path, chosen)
    assert losses == ref_losses and len(losses) == 5
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        assert torch.equal(value, params[name]), name


def test_a_resumed_auto_run_keeps_the_rebuilt_layout(tmp_path: Path, capsys) -> None:
    ck = tmp_path / "ck"
    losses, _ = _emulate(_gpt("auto", "--zb-profile-iters", str(K), "--save", str(ck), "--save-interval", "4"),
                         tmp_path / "a.jsonl")
    chosen, chunks = _rebuilt_as(capsys.readouterr().out)
    assert not (ck / "auto-relayout").exists()  # the rebuild's checkpoint is gone
    (ck / "latest_checkpointed_iteration.txt").write_text("4\n")
    resumed, _ = _emulate(_gpt("auto", "--zb-profile-iters", str(K), "--load", str(ck)), tmp_path / "b.jsonl")
    out = capsys.readouterr().out
    assert f"auto: resuming as {chosen} x{chunks}, the layout the checkpoint's run chose" in out
    assert f"{chosen} on 2 stages" in out and "auto: chose" not in out
    assert resumed == losses[4:]


def test_the_distributed_runtime_rebuilds_too(tmp_path: Path) -> None:
    """Two gloo ranks (transport and process groups built again for the V): the numbers of the
    emulator's save-and-resume reference, bit for bit. The ranks' profile includes the real
    link's latency, which on a loaded host can tip the choice back to the chain (0.8 ms per hop
    was seen in CI); then the run must equal the chosen chain schedule's from the start."""
    records, params = run_pretrain(_gpt("auto", "--zb-profile-iters", str(K)), tmp_path / "run", timeout=300)
    out = (tmp_path / "run" / "stdout.txt").read_text()
    if "auto: rebuilt the stages as" in out:
        ref_losses, ref_params = _saved_and_resumed(tmp_path, _rebuilt_as(out))
    else:
        chosen = re.search(r"auto: chose (\S+) from iteration 2; order", out)
        assert chosen, out[-3000:]
        ref_losses, ref_params = _emulate(_gpt(chosen.group(1)), tmp_path / "ref.jsonl")
    assert [r["loss"] for r in records if "loss" in r] == ref_losses
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        assert torch.equal(value, params[name]), name
