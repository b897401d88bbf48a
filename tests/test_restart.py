"""A job survives a killed rank, a hung rank and a kill during a checkpoint save (issue 28).

Every case runs a real job (torchrun, or ``python pretrain_gpt.py --max-restarts``), breaks one
rank mid-run and checks that the job ends with status 0 after a restart, that the restart said
``restart k of N: resuming from iteration I (lost J iterations)`` with I the last *complete*
checkpoint, and that every loss logged -- the dead attempt's and the restarted one's -- is
bitwise the loss of the same run trained straight through. The reference is independent of
the runtime: the in-process emulator (one process, all stages) with the same flags and the
same save interval (an asynchronous schedule drains at every save, so the save boundaries are
part of its numbers). Afterwards no process of the job is left (its session is empty).

Kept fast: tiny GPT, 60 iterations, a 10 s pipeline timeout; 2 stages PACI and 4 stages 1F1B
under torchrun (static and c10d rendezvous), the hung rank and the kill during a save under
the local launcher.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from async_helpers import REPO, emulate, read_log, tiny_args
from megatron.trainer.launch.launcher import supervise
from megatron.trainer.launch.rendezvous import attempt_prefix, rank_store
from megatron.trainer.loop.restart_report import ProgressRecord, read_progress, restart_line
from process_tree import alive, descendants, rank_of, session_members

ITERS, SAVE_INTERVAL, KILL_AT = 60, 10, 25
PIPELINE_TIMEOUT_S = 10
JOB_TIMEOUT_S = 420  # three starts of up to 4 ranks importing torch on 2 loaded cores, and training
ERROR_LINE = re.compile(r"\[megatron-async\] error: stage (\d+) \(rank (\d+)\) at (F|BW|B|W|OPT)\S*")
# A survivor torchrun ends (SIGTERM) between two iterations has no op to name.
SURVIVOR_LINE = re.compile(r"\[megatron-async\] error: stage (\d+) \(rank (\d+)\)( at (F|BW|B|W|OPT)\S*)?: ")
RESTART_LINE = re.compile(r"\[megatron-async\] restart (\d+) of (\d+): resuming from iteration (\d+) "
                          r"\(lost (\d+) iterations?\)")

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the job's ranks in /proc")


def _flags(stages: int, schedule: str) -> list[str]:
    return tiny_args(stages, schedule, 4, ITERS, "--device", "cpu", "--save-interval", str(SAVE_INTERVAL),
                     "--pipeline-timeout-seconds", str(PIPELINE_TIMEOUT_S))


def _reference_losses(flags: list[str], tmp_path: Path) -> dict[int, float]:
    """The uninterrupted run's loss per iteration (emulator, in this process)."""
    log = tmp_path / "reference.jsonl"
    emulate([*flags, "--save", str(tmp_path / "reference-ckpt"), "--log-json", str(log)])
    return {r["iteration"]: r["loss"] for r in read_log(log) if "eval_split" not in r}


def _free_port() -> int:
    from megatron.trainer.launch.launcher import free_port
    return free_port()


class Job:
    """One job in its own session, stdout/stderr to files, JSON log in ``tmp_path``."""

    def __init__(self, cmd: list[str], tmp_path: Path, env: dict[str, str] | None = None):
        self.dir, self.log = tmp_path, tmp_path / "log.jsonl"
        self.out, self.err = tmp_path / "job.out", tmp_path / "job.err"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MEGATRON_ASYNC_"))
                and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([*cmd, "--log-json", str(self.log)], cwd=tmp_path, stdout=out, stderr=err,
                                         env={**base, "PYTHONWARNINGS": "ignore", **(env or {})},
                                         start_new_session=True)

    def tail(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in (self.out, self.err))

    def last_iteration(self) -> int:
        try:
            lines = self.log.read_text().splitlines()
        except OSError:
            return 0
        complete = [line for line in lines if line.endswith("}")]
        return json.loads(complete[-1])["iteration"] if complete else 0

    def rank_pid(self, rank: int) -> int:
        """The process of ``rank`` (a torchrun worker or a launcher's rank), once training runs."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended ({self.proc.returncode}) before training:\n{self.tail()}")
            if self.last_iteration() > 0:
                ranks = {rank_of(pid): pid for pid in descendants(self.proc.pid)}
                if rank in ranks:
                    return ranks[rank]
            time.sleep(0.05)
        pytest.fail(f"no training rank {rank} within {JOB_TIMEOUT_S} s:\n{self.tail()}")

    def wait_for_iteration(self, iteration: int) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while self.last_iteration() < iteration:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"iteration {iteration} not reached:\n{self.tail()}")
            time.sleep(0.02)
        if self.last_iteration() >= ITERS:
            pytest.fail("the run finished before the fault could be injected")

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {JOB_TIMEOUT_S} s:\n{self.tail()}")

    def kill(self) -> None:
        """Teardown: whatever of this job's own session still runs."""
        for pid in session_members(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def _check_recovered(job: Job, reference: dict[int, float], restarts: int) -> list[tuple[int, int, int]]:
    """Status 0; ``restarts`` restart lines, restart k resuming from a saved iteration I within
    one save interval of where the dead attempt got (its log, set aside as log.jsonl.k, ends
    there) and saying it lost exactly the difference J; every logged loss -- this log's and
    the dead attempts' -- bitwise the reference's; no process of the job left. Returns the
    restarts' (k, I, J)."""
    code = job.finish()
    assert code == 0, job.tail()
    said = [(int(m[1]), int(m[3]), int(m[4])) for m in RESTART_LINE.finditer(job.out.read_text())]
    assert [k for k, _, _ in said] == list(range(1, restarts + 1)), (said, job.tail())
    records = [r for r in read_log(job.log) if "eval_split" not in r]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert {r["iteration"]: r["loss"] for r in records} == reference
    for k, start, lost in said:
        dead = [r for r in read_log(job.dir / f"log.jsonl.{k}") if "eval_split" not in r]
        for r in dead:
            assert r["loss"] == reference[r["iteration"]], (k, r["iteration"])
        reached = dead[-1]["iteration"]
        assert start % SAVE_INTERVAL == 0 and reached - SAVE_INTERVAL <= start <= reached, (k, start, reached)
        assert lost == reached - start, (k, lost, reached, start)  # --log-interval 1: exact
    assert session_members(job.proc.pid) == [], "a process of the job is still running"
    return said


def _torchrun(stages: int, rendezvous: list[str], flags: list[str], ckpt: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "2", "--nproc-per-node", str(stages),
            *rendezvous, str(REPO / "pretrain_gpt.py"), *flags, "--save", str(ckpt), "--load", str(ckpt)]


@pytest.mark.slow
@pytest.mark.parametrize("stages,schedule,rendezvous,victim", [
    (2, "paci", "static", 1),
    (4, "1f1b", "c10d", 2),
])
def test_torchrun_restarts_after_a_killed_rank_and_matches_the_uninterrupted_run(
        megatron_world1, tmp_path: Path, stages: int, schedule: str, rendezvous: str, victim: int) -> None:
    flags = _flags(stages, schedule)
    reference = _reference_losses(flags, tmp_path)
    port = _free_port()
    rdzv = (["--master-addr", "127.0.0.1", "--master-port", str(port)] if rendezvous == "static" else
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restart-test"])
    job = Job(_torchrun(stages, rdzv, flags, tmp_path / "ckpt"), tmp_path)
    try:
        pid = job.rank_pid(victim)
        job.wait_for_iteration(KILL_AT)
        os.kill(pid, signal.SIGKILL)
        _check_recovered(job, reference, restarts=1)
        assert SURVIVOR_LINE.search(job.err.read_text()), "no survivor named its stage"
    finally:
        job.kill()


@pytest.mark.slow
def test_local_launcher_restarts_after_a_hung_rank(megatron_world1, tmp_path: Path) -> None:
    """SIGSTOP: the peer exits within the pipeline timeout naming stage and op, the launcher
    ends the stopped rank (no grace for a process that cannot fail) and restarts."""
    flags = _flags(2, "1f1b")
    reference = _reference_losses(flags, tmp_path)
    ckpt = str(tmp_path / "ckpt")
    job = Job([sys.executable, str(REPO / "pretrain_gpt.py"), *flags, "--max-restarts", "1",
               "--save", ckpt, "--load", ckpt], tmp_path)
    try:
        stuck, peer = job.rank_pid(1), job.rank_pid(0)
        job.wait_for_iteration(KILL_AT)
        os.kill(stuck, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # Bound: the peer's pending receive started at most one iteration (< 1 s) before the
        # stop and fails PIPELINE_TIMEOUT_S after it started; 30 s cover printing and exiting
        # on a loaded host. Without the timeout it would wait forever.
        while alive(peer) and time.monotonic() - stopped_at < PIPELINE_TIMEOUT_S + 30:
            time.sleep(0.1)
        peer_exit_s = time.monotonic() - stopped_at
        assert not alive(peer), f"the peer of the stuck rank still runs {peer_exit_s:.0f} s later"
        while alive(stuck) and time.monotonic() - stopped_at < PIPELINE_TIMEOUT_S + 60:
            time.sleep(0.1)
        assert not alive(stuck), "the launcher left the stopped rank running"
        line = ERROR_LINE.search(job.err.read_text())
        assert line and (line[1], line[2]) == ("0", "0"), job.tail()
        print(f"peer exited {peer_exit_s:.1f} s after SIGSTOP (timeout {PIPELINE_TIMEOUT_S} s)")
        _check_recovered(job, reference, restarts=1)
    finally:
        job.kill()


@pytest.mark.slow
def test_kill_during_saves_resumes_from_the_previous_complete_checkpoint(megatron_world1, tmp_path: Path) -> None:
    """Two kills mid-save in one job (local launcher, --max-restarts 2):
    attempt 0, rank 1 right after writing its file of iteration 20 (``iter_0000020.tmp`` holds
    a partial checkpoint): the restart resumes from 10; attempt 1, rank 0 after renaming the
    complete ``iter_0000030`` into place but before moving the pointer: the restart resumes from
    20, what the pointer names, and saves 30 again over it."""
    from megatron.trainer.checkpointing.checkpoint import METADATA, POINTER
    from megatron.trainer.checkpointing.fault_injection import KILL_DURING_SAVE_ENV

    flags = _flags(2, "paci")
    reference = _reference_losses(flags, tmp_path)
    ckpt = tmp_path / "ckpt"
    job = Job([sys.executable, str(REPO / "pretrain_gpt.py"), *flags, "--max-restarts", "2",
               "--save", str(ckpt), "--load", str(ckpt)], tmp_path,
              env={KILL_DURING_SAVE_ENV: "0:20:1:written,1:30:0:renamed"})
    try:
        said = _check_recovered(job, reference, restarts=2)
        assert [(k, start) for k, start, _ in said] == [(1, 10), (2, 20)], said
        saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_"))
        assert saved == [f"iter_{i:07d}" for i in range(SAVE_INTERVAL, ITERS + 1, SAVE_INTERVAL)], saved
        assert all((ckpt / name / METADATA).is_file() for name in saved)
        assert (ckpt / POINTER).read_text().strip() == str(ITERS)
    finally:
        job.kill()


# ---------------------------------------------------------------- the parts, without a job


def test_each_restart_attempt_rendezvous_in_a_namespace_of_its_own() -> None:
    """The root cause of the restarted workers' "Connection refused": torchrun's agent keeps
    its store across restarts, so an unprefixed key (what ``env://`` gives every group) still
    holds the dead attempt's value. Through :func:`rank_store` attempt 1 sees none of attempt 0's."""
    from datetime import timedelta

    import torch.distributed as dist

    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=30))  # as torchrun's
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = rank_store(0, 1, timedelta(seconds=30), env)
    first.set("default_pg/0//cpu/rank_1", "address of a process that died")
    restarted = rank_store(0, 1, timedelta(seconds=30), {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not restarted.check(["default_pg/0//cpu/rank_1"])
    assert agent.check([attempt_prefix(env) + "/default_pg/0//cpu/rank_1"])  # the agent's store is the one used
    assert attempt_prefix(env) != attempt_prefix({**env, "TORCHELASTIC_RESTART_COUNT": "1"})


def test_a_stopped_rank_is_ended_without_waiting_out_the_grace(tmp_path: Path) -> None:
    """One rank failed, the other is SIGSTOPped: it can never fail by itself, so the launcher
    ends it at once (SIGTERM, then SIGCONT so that it acts) instead of after the grace."""
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        os.kill(stuck.pid, signal.SIGSTOP)
        failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        began = time.monotonic()
        code = supervise([failed, stuck], grace_seconds=600)
        # Bound: the launcher polls every 0.2 s; 60 s is for a loaded host. Without the stopped
        # check it would wait the 600 s grace (and the test's own timeout would fire first).
        assert time.monotonic() - began < 60
        assert code == 3 and stuck.returncode == -signal.SIGTERM
    finally:
        if stuck.poll() is None:
            stuck.kill()
            stuck.wait()


def test_the_restart_line_says_which_restart_where_from_and_what_was_lost(tmp_path: Path) -> None:
    progress = ProgressRecord(tmp_path / "ck")
    assert read_progress(tmp_path / "ck") is None
    progress(41, [])  # the logger's callback: update 41 is iteration 42
    assert read_progress(tmp_path / "ck") == 42
    env = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "2"}
    assert restart_line(40, 42, env) == "[megatron-async] restart 1 of 2: resuming from iteration 40 (lost 2 iterations)"
    assert restart_line(40, 41, env).endswith("(lost 1 iteration)")
    assert restart_line(0, None, env).endswith("resuming from iteration 0 (lost an unknown number of iterations)")
    assert restart_line(40, 42, {}) is None  # a first start says nothing
    assert restart_line(40, 45, {"SLURM_RESTART_COUNT": "3"}) == \
        "[megatron-async] restart 3 (Slurm requeue): resuming from iteration 40 (lost 5 iterations)"
