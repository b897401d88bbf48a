"""``--dump-config`` / ``--config-file`` (issue 41 item 1): a dumped command line read back
gives the same :class:`JobConfig` (equality of the frozen dataclasses, every section, the
schedule's and the task's flags included), argv overrides the file, bad files are refused with
one line before any rank starts, and a run started from a dumped file trains bitwise like the
original command (emulator in-process; the distributed runtime through ``pretrain_gpt.py``).

References: the parser itself (the JobConfig of the plain command line), ``tomllib`` for the
TOML writer, and the run's own ``--log-json`` records and final parameters.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from megatron.trainer.config.arguments import build_parser
from megatron.trainer.plan.parse import parse_args, parse_job_config
from megatron.trainer.config.config_file import toml_text
from megatron.trainer.tasks.bert import BertTask
from tests.async_helpers import REPO, TINY_GPT, emulate, final_params, read_log, run_pretrain, tiny_args

# Varied command lines: an asynchronous schedule with its own flags, a searched schedule with
# post-validation, model chunks, repeatable and list flags, and BERT with its own flags.
CASES = {
    "pipemare": (tiny_args(2, "pipemare", 2, 3, "--pipemare-lr-anneal-iters", "2", "--pipemare-discrepancy-decay",
                           "0.5", "--pipemare-delay-model", "stream", "--inject-nonfinite-loss", "1",
                           "--inject-nonfinite-loss", "4", "--lr-decay-style", "linear"), None),
    "zb-2p-post-validation": (tiny_args(2, "zb-2p", 4, 2, "--enable-optimizer-post-validation", "--fp16",
                                        "--initial-loss-scale", "256", "--pipeline-layer-split", "1", "1"), None),
    "interleaved": (tiny_args(2, "interleaved-1f1b", 4, 2, "--num-layers", "4",
                              "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-executor", "emulator",
                              "--microbatch-group-size-per-virtual-pipeline-stage", "2",
                              "--split", "98,2,0", "--rampup-batch-size", "2", "2", "8"),
                    None),
    "bert": (tiny_args(2, "1f1b", 2, 2, "--bert-no-binary-head", "--mask-prob", "0.2", "--pipeline-partition",
                       "auto", "--max-position-embeddings", "16"), BertTask()),
}


def _parser(task=None):
    parser = build_parser()
    if task is not None:
        task.add_arguments(parser)
    return parser


def _config(argv: list[str], task=None):
    return parse_job_config(argv, _parser(task))


def _dump(argv: list[str], path: Path, task=None) -> str:
    """``argv --dump-config path``: exits 0 after writing ``path``; returns its text."""
    with pytest.raises(SystemExit) as exc:
        parse_args([*argv, "--dump-config", str(path)], _parser(task))
    assert exc.value.code == 0
    return path.read_text()


@pytest.mark.parametrize("suffix", [".toml", ".json"])
@pytest.mark.parametrize("case", CASES)
def test_a_dumped_command_line_reads_back_to_the_same_job_config(case, suffix, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv, task = CASES[case]
    text = _dump(argv, tmp_path / f"run{suffix}", task)
    original = _config(argv, task)
    assert _config(["--config-file", str(tmp_path / f"run{suffix}")], task) == original
    # The file is the flags, nothing else: every section's keys are flag dests of this parser.
    data = json.loads(text) if suffix == ".json" else tomllib.loads(text)
    dests = {a.dest for a in _parser(task)._actions}
    keys = [key for section in data.values() for key in section]
    flags = dests - {"config_file", "dump_config", "help"}
    assert set(keys) <= flags and len(keys) == len(set(keys))
    if suffix == ".json":  # JSON writes unset flags too (null): every flag, every schedule's and the task's
        assert set(keys) == flags
    if task is not None:
        assert data["task"]["bert_binary_head"] is False and data["task"]["mask_prob"] == 0.2


def test_the_dump_holds_no_derived_or_host_dependent_value(tmp_path, monkeypatch):
    """The same command line on 2 and on 4 processes: the JobConfigs differ (data-parallel
    size, global batch, world), the dumped files do not; a tokenizer-free run's resolved
    ``--adam-kernel`` and mock data stay as asked."""
    argv = [*TINY_GPT, "--num-layers", "2", "--pipeline-model-parallel-size", "2", "--train-iters", "2"]
    texts, configs = [], []
    for world in ("2", "4"):
        monkeypatch.setenv("WORLD_SIZE", world)
        texts.append(_dump(argv, tmp_path / f"w{world}.toml"))
        configs.append(_config(argv))
    assert configs[0].parallel.data_parallel_size == 1 and configs[1].parallel.data_parallel_size == 2
    assert texts[0] == texts[1]
    data = tomllib.loads(texts[0])
    assert "data_parallel_size" not in data["parallel"] and "global_batch_size" not in data["training"]
    assert data["optimizer"]["adam_kernel"] == "auto" and data["data"]["mock_data"] is False
    assert configs[0].optimizer.adam_kernel != "auto" and configs[0].data.mock_data is True
    monkeypatch.setenv("WORLD_SIZE", "4")  # read on 4 processes, it derives what 4 processes derive
    assert _config(["--config-file", str(tmp_path / "w2.toml")]) == configs[1]


def test_argv_overrides_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = tiny_args(2, "pipemare", 2, 3, "--inject-nonfinite-loss", "1", "--pipemare-lr-anneal-iters", "2")
    _dump(argv, tmp_path / "run.toml")
    overrides = ["--lr", "0.005", "--pipemare-lr-anneal-iters", "1", "--inject-nonfinite-loss", "3"]
    # A repeatable flag on the command line replaces the file's list (it does not extend it).
    expected = tiny_args(2, "pipemare", 2, 3, "--inject-nonfinite-loss", "3", *overrides[:4])
    got = _config(["--config-file", str(tmp_path / "run.toml"), *overrides])
    assert got == _config(expected) != _config(argv)
    # Dumped again, the file and its overrides are one file.
    _dump(["--config-file", str(tmp_path / "run.toml"), *overrides], tmp_path / "again.json")
    assert _config(["--config-file", str(tmp_path / "again.json")]) == got
    assert got.optimizer.lr == 0.005 and got.logging.inject_nonfinite_loss == [3]
    # Not given on the command line, the file's list stays.
    assert _config(["--config-file", str(tmp_path / "run.toml")]).logging.inject_nonfinite_loss == [1]
    # The file's flags count as given: another schedule refuses the file's pipemare flag.
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config-file", str(tmp_path / "run.toml"), "--pipeline-schedule", "1f1b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--pipemare-lr-anneal-iters needs" in err[0], err


def test_reading_a_file_leaves_the_parser_as_it_was(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _dump(tiny_args(2, "1f1b", 2, 2, "--inject-nonfinite-loss", "1", "--lr", "0.5"), tmp_path / "run.toml")
    parser = _parser()
    parse_args(["--config-file", str(tmp_path / "run.toml")], parser)
    assert vars(parse_args([], parser)) == vars(parse_args([]))


# ------------------------------------------------------------------------ refusals


def _write(tmp_path: Path, text: str, name: str = "bad.toml") -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


REFUSALS = [
    ("missing", None, "No such file or directory"),
    ("syntax", "[model]\nnum_layers = = 2\n", "not valid TOML"),
    ("json-syntax", "{", "not valid JSON"),
    ("top-level-key", "num_layers = 2\n", "num_layers is outside a section (it belongs to [model])"),
    ("section-not-table", '{"model": 3}', "[model] must be a table of flags, got a int"),
    ("unknown-section", "[modle]\nnum_layers = 2\n", "unknown section [modle]"),
    ("unknown-key", "[model]\nnum_layerz = 2\n", "[model] num_layerz: unknown key"),
    ("flag-name-key", "[model]\nnum-layers = 2\n", "keys are flags' dests: num_layers"),
    ("wrong-section", "[model]\nlr = 0.1\n", "[model] lr: belongs to [optimizer]"),
    ("task-key-without-task", "[task]\nmask_prob = 0.2\n", "unknown section [task]"),
    ("file-flag-in-file", "[launch]\nconfig_file = \"x.toml\"\n", "[launch] config_file: unknown key"),
    ("int-as-string", "[model]\nnum_layers = \"2\"\n", "[model] num_layers: expected an integer, got '2'"),
    ("int-as-float", "[model]\nnum_layers = 2.0\n", "expected an integer, got 2.0"),
    ("int-as-bool", "[model]\nnum_layers = true\n", "expected an integer, got True"),
    ("float-as-string", "[optimizer]\nlr = \"1e-3\"\n", "[optimizer] lr: expected a number"),
    ("bool-as-int", "[model]\nswiglu = 1\n", "[model] swiglu: expected true or false, got 1"),
    ("string-as-int", "[optimizer]\noptimizer = 3\n", "expected a string, got 3"),
    ("choice", "[model]\nnormalization = \"BatchNorm\"\n", "'BatchNorm' is not one of LayerNorm, RMSNorm"),
    ("list-as-scalar", "[parallel]\npipeline_layer_split = 2\n", "expected a list, got 2"),
    ("list-element", "[parallel]\npipeline_layer_split = [1, \"1\"]\n", "expected an integer, got '1'"),
    ("list-length", "[training]\nrampup_batch_size = [1, 1]\n", "expected 3 values, got 2"),
    ("empty-plus-list", "[parallel]\npipeline_layer_split = []\n", "expected at least one value"),
    ("json-null", '{"model": {"num_layers": null}}', "null, but the flag is never unset"),
    ("json-nan", '{"optimizer": {"lr": NaN}}', "must be a finite number"),
    ("out-of-domain", "[model]\nnum_layers = 0\n", "--num-layers must be >= 1, got 0"),
]


@pytest.mark.parametrize("name,text,fragment", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_bad_file_is_refused_in_one_line(name, text, fragment, tmp_path, capsys):
    path = str(tmp_path / "absent.toml") if text is None else _write(
        tmp_path, text, "bad.json" if name.startswith("json") or name == "section-not-table" else "bad.toml")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config-file", path])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and fragment in err[0], err
    assert err[0].startswith("error: ")


def test_an_unwritable_dump_path_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--dump-config", str(tmp_path / "no" / "such" / "dir.toml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--dump-config" in err[0] and "No such file" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_a_dump_to_standard_output_is_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv, task = CASES["bert"]
    with pytest.raises(SystemExit) as exc:
        parse_args([*argv, "--dump-config", "-"], _parser(task))
    assert exc.value.code == 0
    assert capsys.readouterr().out == _dump(argv, tmp_path / "bert.toml", task)


def test_a_bert_file_is_refused_by_gpt(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv, task = CASES["bert"]
    path = tmp_path / "bert.toml"
    _dump(argv, path, task)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--config-file", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "unknown section [task]" in err[0], err


def test_pretrain_refuses_a_bad_file_before_any_rank(tmp_path):
    """Through the entry point: status 2, one line, no log written (no rank started)."""
    path = _write(tmp_path, "[model]\nhidden_size = \"big\"\n")
    log = tmp_path / "log.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), "--config-file", path,
                           "--pipeline-model-parallel-size", "2", "--log-json", str(log)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --config-file {path}: [model] hidden_size: expected an integer, got 'big'"]
    assert not log.exists()


# ------------------------------------------------------------------------ the TOML writer


def test_toml_writer_round_trips_through_tomllib():
    values = {
        "strings": {"plain": "a", "quotes": 'say "hi" \\ there', "controls": "tab\tnew\nline\x01\x7f\x1b",
                    "unicode": "caf\u00e9 \U0001f600", "empty": "", "path": "C:\\data\\x"},
        "numbers": {"zero": 0, "negative": -3, "big": 2**62, "small": 1e-8, "huge": 1e300, "third": 1 / 3,
                    "negzero": -0.0, "whole": 5.0, "tiny": 5e-324},
        "lists": {"empty": [], "ints": [1, 2, 3], "strs": ["a", "b,c"], "floats": [0.1, 2.5]},
        "bools": {"yes": True, "no": False},
    }
    text = toml_text({**values, "unset": {"x": None, "y": 1}}, "a header\nof two lines")
    back = tomllib.loads(text)
    assert back == {**values, "unset": {"y": 1}}
    assert all(type(back[s][k]) is type(v) for s in values for k, v in values[s].items())
    assert str(back["numbers"]["negzero"]) == "-0.0"


# ------------------------------------------------------------------------ training from a dumped file


TRAINED = {
    "gpt-pipemare": (tiny_args(2, "pipemare", 2, 3, "--pipemare-lr-anneal-iters", "2", "--log-params-norm"), None),
    "bert": (tiny_args(2, "1f1b", 2, 2, "--bert-no-binary-head", "--mask-prob", "0.3",
                       "--max-position-embeddings", "16", "--log-params-norm"), BertTask()),
}


@pytest.mark.parametrize("case", TRAINED)
def test_a_run_from_a_dumped_file_trains_bitwise_like_the_command_line(case, megatron_world1, tmp_path,
                                                                        monkeypatch):
    """Emulator: the command line, and its dump read back (with another --log-json on the
    command line, so it also overrides): the same records, bitwise, and the same parameters."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags, task = TRAINED[case]
    argv = [*flags, "--pipeline-executor", "emulator", "--log-json", str(tmp_path / "argv.jsonl")]
    _dump(argv, tmp_path / "run.toml", task)
    params = final_params(emulate(argv, task))
    from_file = final_params(emulate(["--config-file", str(tmp_path / "run.toml"),
                                      "--log-json", str(tmp_path / "file.jsonl")], task))
    _assert_same_training(read_log(tmp_path / "argv.jsonl"), read_log(tmp_path / "file.jsonl"))
    assert params.keys() == from_file.keys() and all(torch.equal(params[k], from_file[k]) for k in params)


def _assert_same_training(ours: list[dict], theirs: list[dict]) -> None:
    keys = ("iteration", "loss", "grad_norm", "params_norm", "lr")
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
    assert any("loss" in r for r in ours)


def test_pretrain_dumps_and_trains_from_the_file_on_two_ranks(megatron_world1, tmp_path, monkeypatch):
    """``pretrain_gpt.py --dump-config`` writes the file and starts no rank; ``pretrain_gpt.py
    --config-file`` trains on 2 gloo ranks what the emulator trains from the command line
    (the emulator equals the runtime bitwise: tests/test_async_runtime.py)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = tiny_args(2, "1f1b", 2, 3, "--log-params-norm")
    path = tmp_path / "run.toml"
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv, "--log-json",
                           str(tmp_path / "never.jsonl"), "--dump-config", str(path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and path.exists(), proc.stderr[-2000:]
    assert not (tmp_path / "never.jsonl").exists()  # dumping trains nothing
    records, params = run_pretrain(["--config-file", str(path)], tmp_path / "dist")
    assert not (tmp_path / "never.jsonl").exists()  # run_pretrain's --log-json overrode the file's
    workers = emulate([*argv, "--pipeline-executor", "emulator", "--log-json", str(tmp_path / "emu.jsonl")])
    _assert_same_training([r for r in read_log(tmp_path / "emu.jsonl") if "eval_split" not in r], records)
    emu = final_params(workers)
    assert params.keys() == emu.keys() and all(torch.equal(params[k], emu[k]) for k in params)


# ------------------------------------------------------------------------ a command line edited and parsed again


def _offered(argv: list[str]) -> list[str]:
    """The layouts the launch offers an ``auto`` run of ``argv`` (test_auto_relayout's set-up)."""
    import megatron.pipeline.planner.auto_schedule as auto_schedule
    from megatron.trainer.loop.trainer import preflight
    from megatron.trainer.tasks.gpt import GPTTask

    return [r.label for r in auto_schedule.auto_options(preflight(GPTTask(), argv).run.schedule.options).relayouts]


def test_auto_offers_the_same_layouts_from_a_file(tmp_path, monkeypatch):
    """``auto``'s candidates drop the Zero Bubble flags a layout does not take, from the parsed
    flags: a flag the file sets is dropped like one of the command line."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [*TINY_GPT, "--num-layers", "8", "--global-batch-size", "8", "--device", "cpu", "--pipeline-schedule",
            "auto", "--pipeline-model-parallel-size", "2", "--data-parallel-size", "2", "--zb-memory-limit", "8"]
    _dump(argv, tmp_path / "auto.toml")
    offered = _offered(argv)
    assert "interleaved-1f1b x2" in offered  # a layout without the Zero Bubble flags
    assert _offered(["--config-file", str(tmp_path / "auto.toml")]) == offered
