"""A rank that dies mid-training takes the whole job down promptly, and every survivor
says which stage and op it was at -- instead of hanging in a receive forever.

The first test starts the ranks itself, as torchrun would (RANK, WORLD_SIZE, ... per
process), so nothing of ours is there to kill the survivors: they must fail on their own.
The second goes through ``python pretrain_gpt.py``'s local launcher.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from process_tree import alive as _alive, children as _children, rank_of as _rank_of

REPO = Path(__file__).resolve().parents[1]
STAGES = 3  # the victim has a live neighbour on each side
VICTIM = 1  # stage (= rank: one data-parallel replica) whose process is killed
STARTUP_TIMEOUT_S = 180
EXIT_TIMEOUT_S = 120
ERROR_LINE = re.compile(r"\[megatron-async\] error: stage (\d+) \(rank (\d+)\) at (F|BW|OPT)\S*")

FLAGS = [
    "--pipeline-model-parallel-size", str(STAGES), "--num-layers", str(STAGES),
    "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "64",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "1000000",
    "--log-interval", "1", "--num-threads", "1", "--device", "cpu",
    "--pipeline-timeout-seconds", "60",
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "MEGATRON_ASYNC_LAUNCHED")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "<missing>"


def _wait_for_training(log_json: Path, alive: list[subprocess.Popen], logs: list[Path]) -> int:
    """Block until rank 0 has logged an iteration; return that iteration."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if log_json.exists():
            lines = log_json.read_text().splitlines()
            if lines and lines[0].endswith("}"):
                return json.loads(lines[0])["iteration"]
        for proc, log in zip(alive, logs):
            if proc.poll() is not None:
                pytest.fail(f"a process exited with {proc.returncode} before training started:\n{_tail(log)}")
        time.sleep(0.2)
    pytest.fail("training did not start within %ds:\n%s" % (STARTUP_TIMEOUT_S, "\n".join(_tail(l) for l in logs)))


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start_ranks(tmp_path: Path, flags: list[str]) -> tuple[list[subprocess.Popen], list[Path], Path]:
    """One process per rank with torchrun's environment; returns (procs, stderr paths, log)."""
    log_json = tmp_path / "log.jsonl"
    port = _free_port()
    procs, errs = [], []
    for rank in range(STAGES):
        env = _base_env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(STAGES),
                   LOCAL_WORLD_SIZE=str(STAGES), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        errs.append(tmp_path / f"rank{rank}.err")
        with open(tmp_path / f"rank{rank}.out", "w") as out, open(errs[-1], "w") as err:
            cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *flags, "--log-json", str(log_json)]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err))
    return procs, errs, log_json


def _check_survivors(procs: list[subprocess.Popen], errs: list[Path], since: float, limit_s: float) -> dict[int, str]:
    """Every rank but the victim exits non-zero within ``limit_s`` with an error line naming
    its own stage and the op it was at; returns each survivor's last such line."""
    survivors = [r for r in range(STAGES) if r != VICTIM]
    exit_s, lines = {}, {}
    for rank in survivors:
        try:
            procs[rank].wait(timeout=max(0.1, since + limit_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {rank} still running {limit_s}s after rank {VICTIM} failed:\n{_tail(errs[rank])}")
        exit_s[rank] = round(time.monotonic() - since, 1)
    for rank in survivors:
        stderr = errs[rank].read_text(errors="replace")
        assert procs[rank].returncode != 0, f"rank {rank} exited 0:\n{stderr[-3000:]}"
        matches = list(ERROR_LINE.finditer(stderr))
        assert matches, f"rank {rank}: no '[megatron-async] error: stage S (rank R) at OP' line:\n{stderr[-3000:]}"
        assert (int(matches[-1][1]), int(matches[-1][2])) == (rank, rank), matches[-1][0]
        lines[rank] = stderr[matches[-1].start():].splitlines()[0]
    print("survivor exit times after the failure (s):", exit_s)
    return lines


def test_survivors_fail_naming_stage_and_op_when_a_rank_is_killed(tmp_path: Path) -> None:
    procs, errs, log_json = _start_ranks(tmp_path, FLAGS)
    try:
        _wait_for_training(log_json, procs, errs)
        assert all(p.poll() is None for p in procs), "a rank ended while the run should go on"
        os.kill(procs[VICTIM].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        procs[VICTIM].wait()
        _check_survivors(procs, errs, killed_at, EXIT_TIMEOUT_S)
    finally:
        _stop(procs)


def test_a_rank_ended_by_sigterm_says_where_it_was(tmp_path: Path) -> None:
    """torchrun ends the survivors of a dead rank with SIGTERM, often before their own
    receive has failed: a rank so ended must still name its stage, and its op when it was in
    the pipeline, rather than vanish without a line (the default action of SIGTERM)."""
    procs, errs, log_json = _start_ranks(tmp_path, FLAGS)
    try:
        _wait_for_training(log_json, procs, errs)
        os.kill(procs[VICTIM].pid, signal.SIGTERM)
        try:
            code = procs[VICTIM].wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {VICTIM} still running {EXIT_TIMEOUT_S}s after SIGTERM:\n{_tail(errs[VICTIM])}")
        stderr = errs[VICTIM].read_text(errors="replace")
        line = re.search(rf"\[megatron-async\] error: stage {VICTIM} \(rank {VICTIM}\)( at \S+)?: .*got SIGTERM", stderr)
        assert code != 0 and line, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        _check_survivors(procs, errs, time.monotonic(), EXIT_TIMEOUT_S)
    finally:
        _stop(procs)


def test_survivors_time_out_when_a_rank_hangs(tmp_path: Path) -> None:
    """A peer that stops answering (SIGSTOP: sockets stay open, so nothing reports a closed
    connection) must be detected by the timeouts: --pipeline-timeout-seconds for activations
    and gradients, --distributed-timeout-minutes for the optimizer step's collectives."""
    flags = [*FLAGS, "--pipeline-timeout-seconds", "5", "--distributed-timeout-minutes", "1"]
    procs, errs, log_json = _start_ranks(tmp_path, flags)
    try:
        _wait_for_training(log_json, procs, errs)
        os.kill(procs[VICTIM].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        lines = _check_survivors(procs, errs, stopped_at, EXIT_TIMEOUT_S)
        # Somebody has to notice by timing out (gloo: "Timed out waiting ..."); the others may
        # then see that survivor's closed connection instead.
        assert any("timed out" in line.lower() for line in lines.values()), lines
    finally:
        _stop(procs)  # SIGKILL ends a stopped process too


def test_local_launcher_exits_nonzero_when_a_rank_is_killed(tmp_path: Path) -> None:
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc to find the launcher's ranks")
    log_json = tmp_path / "log.jsonl"
    out_path, err_path = tmp_path / "launcher.out", tmp_path / "launcher.err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *FLAGS, "--log-json", str(log_json)]
        launcher = subprocess.Popen(cmd, cwd=REPO, env=_base_env(), stdout=out, stderr=err)
    children: list[int] = []
    try:
        _wait_for_training(log_json, [launcher], [err_path])
        children = _children(launcher.pid)
        ranks = {_rank_of(pid): pid for pid in children}
        if VICTIM not in ranks:
            pytest.skip(f"could not identify the launcher's rank processes (children {children}, ranks {ranks})")
        assert sorted(r for r in ranks if r is not None) == list(range(STAGES)), ranks

        os.kill(ranks[VICTIM], signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            code = launcher.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher still running {EXIT_TIMEOUT_S}s after a rank was killed:\n{_tail(err_path)}")
        elapsed = time.monotonic() - killed_at
        stderr = err_path.read_text(errors="replace")
        assert code != 0, stderr[-3000:]
        assert ERROR_LINE.search(stderr), stderr[-3000:]
        assert not [pid for pid in children if _alive(pid)], "the launcher left ranks running"
        print(f"launcher exited {code} {elapsed:.1f}s after the kill")
    finally:
        _stop([launcher])
        for pid in children:  # only the launcher's own children, found above
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
