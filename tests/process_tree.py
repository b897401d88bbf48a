"""The processes a test started, seen through /proc: a launcher's children, their ranks,
whether one is still alive (a zombie is not), every descendant of a job."""
from __future__ import annotations

import subprocess
from pathlib import Path


def children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, timeout=10).stdout
        return [int(x) for x in out.split()]
    except (OSError, subprocess.SubprocessError):
        pass
    found = []  # fall back to /proc: field 4 of /proc/PID/stat is the parent pid
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def rank_of(pid: int) -> int | None:
    """The rank a launcher child runs: forked ranks name themselves, exec'd ones carry RANK."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if comm.startswith("megatron-rank"):
        return int(comm.removeprefix("megatron-rank"))
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), found now."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def session_members(session: int) -> list[int]:
    """Live processes of session ``session`` (a job started with ``start_new_session``): its
    ranks stay in it even if they outlive their parent and are reparented to init."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":
                found.append(int(entry.name))
    return found
