"""Run example command lines (``DRY_RUN=1 EXECUTOR=emulator bash examples/...``) in this one process.

Reads one shell-quoted command line per stdin line, ``python SCRIPT --pipeline-executor
emulator FLAGS...``, and calls the script's ``pretrain`` in-process, so torch and
megatron-core are imported once for all examples. Prints one JSON line per command:
``{"line": i, "schedule": ..., "status": "ok" | "unregistered" | "failed", "rc": ..., "error": ...}``.
"""
from __future__ import annotations

import json
import shlex
import sys
import traceback
from pathlib import Path

# This checkout's megatron.pipeline / megatron.trainer, not whatever an editable install points at
# (running `python tests/examples_driver.py` puts tests/, not the repository, on sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from megatron.pipeline.schedules import SCHEDULES
    from megatron.trainer.tasks.bert import BertTask
    from megatron.trainer.tasks.gpt import GPTTask
    from megatron.trainer.loop.training import pretrain

    for i, line in enumerate(sys.stdin):
        argv = shlex.split(line)
        schedule = argv[argv.index("--pipeline-schedule") + 1]
        result = {"line": i, "schedule": schedule, "script": argv[1]}
        if argv[0] != "python" or argv[2] != "--pipeline-executor":
            result.update(status="failed", error=f"not an emulator command line: {argv[:3]}")
        elif schedule not in SCHEDULES:
            result.update(status="unregistered")
        else:
            task = BertTask() if argv[1].endswith("pretrain_bert.py") else GPTTask()
            try:
                rc = pretrain(task, argv[2:], script=argv[1])
            except SystemExit as exc:
                rc = exc.code
            except Exception:  # noqa: BLE001 - reported, the next example still runs
                rc, result["error"] = 1, traceback.format_exc()[-3000:]
            result.update(status="ok" if rc == 0 else "failed", rc=rc)
        print("EXAMPLE-RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
