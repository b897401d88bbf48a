"""The launcher owns its ranks; signals stop a run cleanly, or save it first.

- Killing ``python pretrain_gpt.py``'s local launcher by SIGTERM, SIGINT or SIGKILL leaves no
  rank alive 5 s later (forked ranks: the real trainer; exec'd ranks and torchrun's workers: a
  tiny rank script that only ties itself to its parent, as ``pretrain()`` does first).
- ``--exit-signal-handler``: SIGTERM to the launcher mid-training saves a checkpoint and exits
  0; the rerun resumes from it and ends with the same losses as a run never interrupted.
- ``--exit-duration-in-mins`` stops at the first check and saves; for an asynchronous schedule
  the stop and resume are exact against an uninterrupted run with the same check interval.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from async_helpers import REPO, emulate, final_params, tiny_args
from process_tree import children

from megatron.trainer.plan.parse import parse_args, parse_run_plan
from megatron.trainer.loop.segments import plan_segments

GONE_WITHIN_S = 5.0
STARTUP_TIMEOUT_S = 180
TINY = ["--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "64",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--log-interval", "1", "--num-threads", "1",
        "--device", "cpu"]


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "MEGATRON_ASYNC_LAUNCHED", "MEGATRON_ASYNC_LAUNCHER_PID", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    return dict(env, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status and "\nState:\tX" not in status


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "<gone>"


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def _assert_all_gone(pids: list[int], since: float) -> None:
    deadline = since + GONE_WITHIN_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [(p, _comm(p)) for p in pids if _alive(p)]
    for p, _ in survivors:
        os.kill(p, signal.SIGKILL)  # leave nothing behind even when failing
    assert not survivors, f"alive {GONE_WITHIN_S} s after the launcher was killed: {survivors}"


def _first_logged_iteration(log: Path, proc: subprocess.Popen) -> None:
    def logged() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the run exited with {proc.returncode} before training:\n{proc.stderr.read()[-3000:]}")
        return log.exists() and log.read_text().endswith("}\n")
    _wait_until(logged, STARTUP_TIMEOUT_S, "the first logged iteration")


# ------------------------------------------------------------------ killing the launcher

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_killing_the_local_launcher_leaves_no_rank(tmp_path, sig):
    log = tmp_path / "log.jsonl"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "pretrain_gpt.py"), *TINY, "--pipeline-model-parallel-size", "3",
         "--num-layers", "3", "--train-iters", "1000000", "--log-json", str(log)],
        env=_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        _first_logged_iteration(log, proc)
        ranks = children(proc.pid)
        assert sorted(_comm(p) for p in ranks) == ["megatron-rank0", "megatron-rank1", "megatron-rank2"]
        killed_at = time.monotonic()
        os.kill(proc.pid, sig)  # the launcher only, as `kill PID` or a container stop does
        rc = proc.wait(timeout=GONE_WITHIN_S)
        _assert_all_gone(ranks, killed_at)
    finally:
        for p in [proc.pid, *ranks]:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        proc.wait()
    assert rc == -sig, proc.stderr.read()[-2000:]  # the launcher dies of the signal, as a shell expects
    if sig != signal.SIGKILL:
        assert f"launcher got {sig.name}: forwarding it to 3 rank(s)" in proc.stderr.read()


RANK_SCRIPT = """
import os, signal, sys
from megatron.trainer.launch.process_guard import guard_rank_process
guard_rank_process()
with open(os.path.join(sys.argv[1], "rank%s.pid" % os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
while True:
    signal.pause()
"""


def _kill_parent_and_check_ranks(tmp_path: Path, cmd: list[str], world: int) -> None:
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    proc = subprocess.Popen(cmd, env=_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    files = [tmp_path / f"rank{r}.pid" for r in range(world)]
    pids: list[int] = []
    try:
        _wait_until(lambda: all(f.exists() and f.read_text() for f in files) or proc.poll() is not None,
                    STARTUP_TIMEOUT_S, "every rank to start")
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        pids = [int(f.read_text()) for f in files]
        killed_at = time.monotonic()
        proc.kill()
        proc.wait()
        _assert_all_gone(pids, killed_at)
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_exec_ranks_die_with_a_killed_launcher(tmp_path):
    """GPU runs exec a fresh python per rank: those die with the launcher too."""
    launcher = ("import sys; from megatron.trainer.launch.launcher import launch_local; "
                "sys.exit(launch_local(2, ['rank.py', sys.argv[1]]))")
    _kill_parent_and_check_ranks(tmp_path, [sys.executable, "-c", launcher, str(tmp_path)], 2)


def test_torchrun_workers_die_with_a_killed_agent(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "static",
           "--rdzv-endpoint", "127.0.0.1:0", "--nnodes", "1", "--node-rank", "0", "rank.py", str(tmp_path)]
    _kill_parent_and_check_ranks(tmp_path, cmd, 2)


# ------------------------------------------------------------------ graceful stop and resume

def _losses(log: Path) -> dict[int, float]:
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv], env=_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S)


def test_sigterm_saves_exits_zero_and_the_rerun_resumes_exactly(tmp_path):
    iters = 60
    base = [*TINY, "--pipeline-model-parallel-size", "2", "--num-layers", "2", "--train-iters", str(iters),
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    ckpt, log = tmp_path / "ckpt", tmp_path / "stopped.jsonl"
    flags = [*base, "--save", str(ckpt), "--load", str(ckpt), "--exit-signal-handler"]
    proc = subprocess.Popen([sys.executable, str(REPO / "pretrain_gpt.py"), *flags, "--log-json", str(log)],
                            env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _first_logged_iteration(log, proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=STARTUP_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    stopped_at = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= stopped_at < iters, out[-2000:]
    assert f"exiting after iteration {stopped_at}: got SIGTERM (--exit-signal-handler)" in out
    assert max(_losses(log)) == stopped_at

    resumed = _run([*flags, "--log-json", str(tmp_path / "resumed.jsonl")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at iteration {stopped_at}" in resumed.stdout and "resumed from" in resumed.stdout
    straight = _run([*base, "--log-json", str(tmp_path / "straight.jsonl")], tmp_path)  # no flag, no stop
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference = _losses(tmp_path / "straight.jsonl")
    got = {**_losses(log), **_losses(tmp_path / "resumed.jsonl")}
    assert sorted(got) == sorted(reference) == list(range(1, iters + 1))
    assert got == reference  # bitwise: a synchronous schedule's extra stop checks change nothing


def _pointer(directory: Path) -> int:
    return int((directory / "latest_checkpointed_iteration.txt").read_text())


def test_exit_duration_stops_an_async_schedule_where_it_drains_and_resumes_exactly(tmp_path, megatron_world1):
    """paci checks every 2 iterations (a drain there); an elapsed budget stops it at the first
    check, and the resumed run equals an uninterrupted run with the same check interval."""
    flags = tiny_args(2, "paci", 2, 6, "--exit-check-interval", "2")
    stopped = tmp_path / "stopped"
    emulate([*flags, "--save", str(stopped), "--exit-duration-in-mins", "1e-9"])
    assert _pointer(stopped) == 2
    resumed = final_params(emulate([*flags, "--save", str(stopped), "--load", str(stopped),
                                    "--exit-duration-in-mins", "1000"]))
    assert _pointer(stopped) == 6
    straight = final_params(emulate([*flags, "--save", str(tmp_path / "straight"), "--exit-duration-in-mins", "1000"]))
    assert resumed.keys() == straight.keys()
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name


def test_stop_checks_add_segment_ends_only():
    plain = plan_segments(0, 6, save_interval=4, saving=True)
    checked = plan_segments(0, 6, save_interval=4, saving=True, check_interval=1)
    assert [s.end for s in plain] == [4, 6]
    assert [s.end for s in checked] == [1, 2, 3, 4, 5, 6]
    assert [s.end for s in checked if s.save] == [4, 6]


@pytest.mark.parametrize("extra, message", [
    (["--exit-signal-handler"], "--exit-signal-handler needs --save DIR"),
    (["--exit-duration-in-mins", "5"], "--exit-duration-in-mins needs --save DIR"),
    (["--exit-duration-in-mins", "0", "--save", "d"], "--exit-duration-in-mins must be > 0"),
    (["--exit-duration-in-mins", "nan", "--save", "d"], "--exit-duration-in-mins must be a finite number"),
    (["--exit-signal", "SIGUSR1", "--save", "d"], "--exit-signal needs --exit-signal-handler"),
    (["--exit-check-interval", "2"], "--exit-check-interval needs --exit-signal-handler"),
    (["--exit-signal-handler", "--save", "d", "--exit-check-interval", "0"], "--exit-check-interval must be >= 1"),
    (["--exit-signal-handler", "--save", "d", "--pipeline-schedule", "paci"],
     "needs --save-interval, --eval-interval or --exit-check-interval"),
])
def test_exit_flags_are_refused_up_front(capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "2", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_the_launcher_forwards_the_exit_signal_too():
    from megatron.trainer.launch.exit_control import launcher_signals

    base = ["--pipeline-model-parallel-size", "2", "--num-layers", "2", "--save", "d"]
    assert launcher_signals(parse_run_plan(base)) == (signal.SIGTERM, signal.SIGINT)
    assert signal.SIGUSR1 in launcher_signals(parse_run_plan([*base, "--exit-signal-handler", "--exit-signal",
                                                                "SIGUSR1"]))
