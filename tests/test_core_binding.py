"""``--bind-cores``: each CPU rank on its own share of the cores, and only when that is safe."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.trainer.launch import core_binding
from megatron.trainer.launch.core_binding import bind_cores, cores_for_rank

REPO = Path(__file__).resolve().parent.parent


def test_each_local_rank_gets_its_own_equal_run_of_cores() -> None:
    allowed = [0, 1, 2, 3, 4, 5, 6, 7]
    shares = [cores_for_rank(allowed, r, 3) for r in range(3)]
    assert shares == [[0, 1], [2, 3], [4, 5]]  # 2 each; cores 6 and 7 stay unused
    assert [cores_for_rank([4, 9], r, 2) for r in range(2)] == [[4], [9]]
    with pytest.raises(ValueError):
        cores_for_rank([0, 1], 0, 3)
    with pytest.raises(ValueError):
        cores_for_rank([0, 1], 2, 2)


@pytest.fixture
def private_claims(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Core claims in a directory of this test's own, given back afterwards (the real ones are
    machine-wide: a claim held by this test process would keep real ranks from binding)."""
    monkeypatch.setattr(core_binding, "claim_dir", lambda: tmp_path)
    yield tmp_path
    while core_binding._held:
        core_binding._held.pop().close()


@pytest.fixture
def fake_machine(monkeypatch: pytest.MonkeyPatch, private_claims: Path):
    """A 4-core machine whose affinity calls are recorded instead of made."""
    state = {"allowed": {0, 1, 2, 3}, "set": None}
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(state["allowed"]), raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: state.__setitem__("set", sorted(cores)),
                        raising=False)
    return state


def test_auto_binds_cpu_ranks_and_leaves_everything_else_alone(fake_machine) -> None:
    assert bind_cores("auto", True, 1, 2).endswith("(local rank 1: cores 2-3)")
    assert fake_machine["set"] == [2, 3]
    fake_machine["set"] = None
    assert bind_cores("none", True, 1, 2) == "none"
    assert bind_cores("auto", False, 1, 2).startswith("none (the device")
    assert bind_cores("auto", True, 4, 5).startswith("none (5 local ranks on 4 cores")
    fake_machine["allowed"] = {2, 3}  # srun --cpu-bind, taskset, a cpuset: respected
    assert bind_cores("auto", True, 0, 2).startswith("none (already bound to 2 of 4 cores")
    assert fake_machine["set"] is None


def test_a_second_run_leaves_claimed_cores_to_the_first(fake_machine) -> None:
    assert bind_cores("auto", True, 1, 2).endswith("cores 2-3)")  # this run's local rank 1
    fake_machine["set"] = None
    # Another run's local rank 1 wants the same cores; its rank 0 may still bind.
    assert bind_cores("auto", True, 1, 2) == "none (another run's rank holds cores 2-3)"
    assert fake_machine["set"] is None
    assert bind_cores("auto", True, 0, 2).endswith("cores 0-1)")
    assert fake_machine["set"] == [0, 1]


HOLD = """
import sys, time
from pathlib import Path
from megatron.trainer.launch.core_binding import claim_cores
print(claim_cores([int(sys.argv[2])], Path(sys.argv[1])), flush=True)
sys.stdin.readline()
"""


def test_a_claim_ends_with_its_process(private_claims: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(private_claims), "5"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "True"
        assert not core_binding.claim_cores([4, 5], private_claims)  # 5 is held: 4 is given back
        assert core_binding.claim_cores([4], private_claims)
    finally:
        holder.communicate("\n", timeout=60)
    assert core_binding.claim_cores([5], private_claims)  # the holder exited: its claim is gone


PROBE = """
import os, sys
from pathlib import Path
import megatron.trainer.launch.core_binding as core_binding
from megatron.trainer.plan.parse import parse_run_plan
from megatron.trainer.loop.training import prepare_host
core_binding.claim_dir = lambda: Path(sys.argv[2])  # not the machine's: concurrent tests bind there
config = parse_run_plan(["--mock-data", "--device", "cpu", *sys.argv[3:]])
config = prepare_host(config, 2, int(sys.argv[1]))
print(sorted(os.sched_getaffinity(0)), config.host.core_binding)
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or len(os.sched_getaffinity(0)) < (os.cpu_count() or 0),
                    reason="needs 2+ cores, all of them usable by this process")
def test_a_rank_process_ends_up_on_its_share(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2

    def affinity(*argv: str) -> str:
        out = subprocess.run([sys.executable, "-c", PROBE, argv[0], str(tmp_path), *argv[1:]], capture_output=True, text=True, check=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        return out.stdout.strip().splitlines()[-1]

    assert affinity("1").startswith(str(cores[half:2 * half]))
    assert affinity("1", "--bind-cores", "none").startswith(f"{cores} none")


def test_the_flag_is_refused_with_a_bad_value(capsys) -> None:
    from megatron.trainer.plan.parse import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--mock-data", "--bind-cores", "all"])
    assert "--bind-cores" in capsys.readouterr().err


def test_module_reports_platforms_without_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    assert core_binding.bind_cores("auto", True, 0, 1) == "none (this platform cannot bind)"
