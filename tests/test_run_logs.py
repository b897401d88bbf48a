"""Start banner, end summary, --log-json per run, per-stage optimizer clocks, BERT's sop loss,
and megatron-core's optional-package notices (issue 13, logs).

References: the emulator's own stage workers (parameter counts, each stage's last update in
its ``update_log``) and the run's own ``--log-json`` records; nothing hard-coded but the
run's sizes.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from async_helpers import emulate, read_log, tiny_args


def _run(capsys, tmp_path: Path, *extra: str, task=None, log: str = "log.jsonl"):
    argv = [*tiny_args(2, "paci", 2, 3, "--log-json", str(tmp_path / log)), *extra]
    workers = emulate(argv, task)
    return workers, capsys.readouterr().out, read_log(tmp_path / log)


def test_banner_and_summary(megatron_world1, capsys, tmp_path: Path) -> None:
    workers, out, records = _run(capsys, tmp_path, "--eval-interval", "3", "--eval-iters", "1", "--log-activation-memory")
    lines = out.splitlines()
    start, end = lines.index("------------------------ arguments ------------------------"), \
        lines.index("-------------------- end of arguments ---------------------")
    names = [line.split()[0] for line in lines[start + 1:end]]
    assert names == sorted(names) and {"pipeline_schedule", "train_iters", "seq_length"} <= set(names)
    counts = [sum(p.numel() for c in w.setup.chunks for p in c.parameters()) for w in workers]
    assert f"parameters per stage: [{counts[0]:,}, {counts[1]:,}] | total: {sum(counts):,}" in out
    assert "WARNING: training on MOCK data (no --data-path)" in out
    # The summary comes after the last iteration line and agrees with the records.
    summary = out[out.index("run summary"):]
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if r.get("eval_split") == "valid"]
    tokens = 3 * 2 * 8  # iterations x global batch x seq length
    assert re.search(rf"iterations: 3 \(0 -> 3\) \| tokens: {tokens} \|", summary)
    assert f"final train loss: {train[-1]['loss']:.6E}" in summary
    assert f"final validation loss: {valid[-1]['eval_loss']:.6E} (iteration 3)" in summary
    mem = ", ".join(f"{max(r['peak_activation_mb'][s] for r in train):.1f}" for s in range(2))
    assert f"peak act (MB) per stage: [{mem}]" in summary
    rate = float(re.search(r"mean tokens/s: ([\d,]+)", summary).group(1).replace(",", ""))
    assert rate > 0


def test_activation_memory_is_measured_and_logged_only_when_asked(megatron_world1, capsys, tmp_path: Path) -> None:
    """Off by default: no saved-tensor hook runs (the meters saw no byte), no line or record claims
    a peak; the in-flight micro-batch count is logged either way. On: bytes in both."""
    workers, out, records = _run(capsys, tmp_path)
    assert all(w.meter.run_peak_bytes == 0 and w.meter.run_peak_count > 0 for w in workers)
    assert all("peak_activation_mb" not in r and r["peak_inflight_microbatches"] for r in records if "loss" in r)
    assert "peak act" not in out
    workers, out, records = _run(capsys, tmp_path, "--log-activation-memory", log="on.jsonl")
    assert all(w.meter.run_peak_bytes > 0 for w in workers)
    assert all(min(r["peak_activation_mb"]) > 0 for r in records if "loss" in r)
    assert out.count("peak act (MB) per stage: [") == len(records) + 1  # every line and the summary


def test_log_json_starts_a_new_file_per_run(megatron_world1, capsys, tmp_path: Path) -> None:
    _, _, first = _run(capsys, tmp_path)
    _, out, second = _run(capsys, tmp_path, "--seed", "7")
    assert [r["iteration"] for r in second] == [1, 2, 3]  # not appended to the first run
    assert read_log(tmp_path / "log.jsonl.1") == first  # the first run's file is kept
    assert "log.jsonl.1" in out


def test_log_json_of_a_resumed_run_continues_from_its_checkpoint(megatron_world1, capsys, tmp_path: Path) -> None:
    """Checkpoint at 2, the attempt went on to 3 (not in the checkpoint): the resumed run's
    log is 1, 2 of the first attempt and its own 3; the first attempt's whole log is kept."""
    ckpt = str(tmp_path / "ckpt")
    _, _, first = _run(capsys, tmp_path, "--save", ckpt, "--save-interval", "2")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    _, _, resumed = _run(capsys, tmp_path, "--load", ckpt)
    assert [r["iteration"] for r in resumed] == [1, 2, 3]
    assert resumed[:2] == first[:2] and read_log(tmp_path / "log.jsonl.1") == first


def test_async_stages_log_their_own_lr_and_grad_norm(megatron_world1, keep_update_history, capsys, tmp_path: Path) -> None:
    """PACI: each stage steps on its own clock; the log shows each stage's last update."""
    workers, out, records = _run(capsys, tmp_path, "--lr-warmup-iters", "2")
    last = records[-1]
    for w in workers:
        step = [u for u in w.update_log if not u["skipped"]][-1]
        assert last["lr_per_stage"][w.stage] == step["lr"]
        assert last["grad_norm_per_stage"][w.stage] == step["grad_norm"]
    assert "lr per stage: [" in out and "grad norm per stage: [" in out


def test_sync_schedule_keeps_one_lr(megatron_world1, capsys, tmp_path: Path) -> None:
    argv = tiny_args(2, "1f1b", 2, 2, "--log-json", str(tmp_path / "log.jsonl"))
    emulate(argv)
    assert "lr per stage" not in capsys.readouterr().out


def test_bert_logs_sentence_order_loss(megatron_world1, capsys, tmp_path: Path) -> None:
    from megatron.trainer.tasks.bert import BertTask

    argv = ["--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "64",
            "--micro-batch-size", "2", "--num-threads", "1", "--num-layers", "2",
            "--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--train-iters", "2",
            "--log-interval", "1", "--log-json", str(tmp_path / "log.jsonl"), "--tensorboard-dir", str(tmp_path / "tb")]
    emulate(argv, BertTask())
    records = read_log(tmp_path / "log.jsonl")
    # An untrained binary head on two balanced classes: cross-entropy near ln 2, and part of the loss.
    assert all(0.5 < r["sop_loss"] < 0.9 and r["sop_loss"] < r["loss"] for r in records)
    out = capsys.readouterr().out
    assert f"sop loss: {records[-1]['sop_loss']:.6E}" in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "tb").iterdir())))
    events.Reload()
    assert "train/sop-loss" in events.Tags()["scalars"]
    emulate([*argv, "--bert-no-binary-head", "--log-json", str(tmp_path / "nohead.jsonl")], BertTask())
    assert all("sop_loss" not in r for r in read_log(tmp_path / "nohead.jsonl"))


def test_optional_package_notices_filtered_and_named_once() -> None:
    """megatron-core's per-module Apex/Transformer Engine warnings are dropped (end to end:
    tests/test_readme_snippets.py checks every rank's stderr); the same text from another
    module still shows; the banner's one line names what is missing."""
    import importlib.util
    import warnings

    from megatron.trainer.optional_packages import optional_packages_line, quiet_imports

    with warnings.catch_warnings(record=True) as caught:  # restores the filters afterwards
        warnings.simplefilter("always")
        quiet_imports()  # what importing megatron.trainer does, on top of "show everything"
        for module in ("megatron.core.models.backends", "user_code"):
            warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                                   "x.py", 1, module=module)
    assert [w.filename for w in caught] == ["x.py"] and len(caught) == 1
    missing = [n for n in ("apex", "transformer_engine") if importlib.util.find_spec(n) is None]
    line = optional_packages_line()
    assert (line is not None and ", ".join(missing) in line) if missing else line is None
