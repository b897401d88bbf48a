"""Import from Hugging Face transformers: tools/import_hf.py, then tools/export_hf.py, gives the
same tensors bit for bit, at every TP x PP layout, and the checkpoint fine-tunes.

One tiny transformers model per architecture (randomly initialised by transformers, saved) is
imported at TP in {1, 2} x PP in {1, 2, 4} and exported again. Those imported checkpoints are
how the export is tested on every TP 2 layout: the import writes them with the checkpoint's own
writer (one file per stage and TP rank, shards cut by ``take_shard``, the function a TP run's
initialisation uses). That they are what a TP run writes is checked three ways: the layouts
against megatron's own marks on the built layers (:func:`test_import_shards_as_megatron_does`),
the files against a trained PP 2 run's index (:func:`test_import_writes_a_runs_files`), and
one real TP 2 x PP 2 run (4 gloo ranks) whose export computes our logits and whose index the
import reproduces entry for entry (:func:`test_a_tp2_runs_checkpoint_exports_and_matches_the_imports_files`).
Real runs for all six TP x PP layouts would need up to 8 gloo processes each, every one paying
megatron-core's import: minutes of CI for what the index equality already pins down.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_hf_export import GPT2, LLAMA, _tool, _train, assert_logits_match

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

# GQA with 2 query groups of 2 heads: the groups split over 2 TP ranks (megatron needs groups % TP == 0).
LLAMA_GQA2 = [*LLAMA[:LLAMA.index("--num-query-groups")], "--num-query-groups", "2",
              *LLAMA[LLAMA.index("--num-query-groups") + 2:]]
ARCHS = {"gpt2": GPT2, "llama": LLAMA_GQA2}


def hf_model(arch: str, directory: Path, tied: bool) -> Path:
    """A tiny transformers model of ``arch`` (4 layers, h 32, 4 heads, vocab 32, 8 positions;
    Llama with 2 query groups), randomly initialised by transformers itself and saved."""
    torch.manual_seed(0)
    common = {"vocab_size": 32, "tie_word_embeddings": tied, "bos_token_id": None, "eos_token_id": None}
    if arch == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=8, activation_function="gelu",
                                         **common)
    else:
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
                                          **common)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a swapped one shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> a model directory: GPT-2 tied, Llama untied."""
    root = tmp_path_factory.mktemp("hf")
    return {arch: hf_model(arch, root / arch, tied=arch == "gpt2") for arch in ARCHS}


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return safetensors.load_file(str(directory / "model.safetensors"))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_import_then_export_is_bitwise(megatron_world1, exported, tmp_path: Path, arch: str, tp: int, pp: int, capsys) -> None:
    source = exported[arch]
    ckpt = tmp_path / "ckpt"
    assert _tool("import_hf")(["--input", str(source), "--save", str(ckpt), "--tensor-model-parallel-size", str(tp),
                               "--pipeline-model-parallel-size", str(pp)]) == 0
    files = sorted(p.name for p in (ckpt / "iter_0000000").glob("*.pt"))
    assert len(files) == tp * pp
    again = tmp_path / "again"
    assert _tool("export_hf")(["--load", str(ckpt), "--output", str(again)]) == 0
    before, after = _weights(source), _weights(again)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    # the TP/PP files compute the exported model's logits (export of a TP 2 checkpoint)
    assert_logits_match(ckpt, again, seed=1)


def test_import_shards_as_megatron_does(megatron_world1) -> None:
    """The TP layout the import gives each name is the one megatron marks on its layers."""
    from megatron.trainer.hf.importer import shard_layout_of
    from megatron.trainer.models.gpt import GPTModelArgs, build_gpt_stage
    from megatron.trainer.models.tensor_parallel import mark_tensor_parallel, shard_layout

    for swiglu, extra in ((False, {}), (True, {"swiglu": True, "add_bias_linear": False, "ffn_hidden_size": 48})):
        args = GPTModelArgs(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8,
                            max_position_embeddings=8, vocab_size=32, **extra)
        stage = build_gpt_stage(args, range(1), True, True, 0, "cpu")
        mark_tensor_parallel(stage.model, swiglu)
        layouts = {name: shard_layout(p) for name, p in stage.global_named_parameters()}
        assert layouts == {name: shard_layout_of(name, swiglu) for name in layouts}


def test_import_writes_a_runs_files(megatron_world1, exported, tmp_path: Path) -> None:
    """Per file the same names and shapes as a trained PP 2 checkpoint of the same model."""
    trained = _train(tmp_path / "run", 2, *LLAMA_GQA2, "--num-layers", "4", "--untie-embeddings-and-output-weights")
    ckpt = tmp_path / "ckpt"
    assert _tool("import_hf")(["--input", str(exported["llama"]), "--save", str(ckpt),
                               "--pipeline-model-parallel-size", "2"]) == 0
    index = {}
    for root in (trained, ckpt):
        point = (root / "latest_checkpointed_iteration.txt").read_text().strip()
        metadata = json.loads((root / f"iter_{int(point):07d}" / "metadata.json").read_text())
        index[root] = {f: {n: e["global_shape"] for n, e in entry["params"].items()}
                       for f, entry in metadata["index"].items()}
    assert index[trained] == index[ckpt]


def test_finetune_starts_from_the_import(megatron_world1, exported, tmp_path: Path, capsys) -> None:
    """``--load CKPT --finetune`` with the flags the import prints, another layout (PP 2 files,
    PP 4 run): it loads and trains; without ``--finetune`` it is refused with one line."""
    from async_helpers import emulate

    ckpt = tmp_path / "ckpt"
    assert _tool("import_hf")(["--input", str(exported["gpt2"]), "--save", str(ckpt),
                               "--pipeline-model-parallel-size", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("fine-tune with: --load")
    flags = line.split(": ", 1)[1].split()
    base = ["--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "4", "--num-threads", "1",
            "--lr", "1e-3", "--pipeline-model-parallel-size", "4", "--pipeline-executor", "emulator",
            "--hidden-dropout", "0", "--attention-dropout", "0", *flags]
    workers = emulate([*base, "--train-iters", "1"])
    assert "(weights only, from iteration 0)" in capsys.readouterr().out
    assert len(workers) == 4
    with pytest.raises(SystemExit):
        emulate([*[f for f in base if f != "--finetune"], "--train-iters", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: checkpoint") and err[-1].endswith("load it with --finetune")


def test_models_that_compute_otherwise_are_refused(tmp_path: Path, capsys) -> None:
    """GPT-2's own tanh GeLU (``gelu_new``) is not our GeLU: refused with one line."""
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=8)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    assert _tool("import_hf")(["--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "activation_function gelu_new" in err[0], err
    assert _tool("import_hf")(["--input", str(tmp_path / "none"), "--save", str(tmp_path / "ckpt")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_tokenizer_travels_through_import_and_export(megatron_world1, tmp_path: Path, capsys) -> None:
    """A model directory's tokenizer.json is copied into the checkpoint as the run's
    HuggingFaceTokenizer: ``tools/generate.py --prompt`` encodes with it, the export writes it back."""
    from test_generate import _tiny_bpe

    from megatron.trainer.hf.tokenizer import gpt2_tokenizer

    vocab, merges = _tiny_bpe(tmp_path / "tok")
    source = tmp_path / "hf"
    gpt2_tokenizer(str(vocab), str(merges)).save_pretrained(source)
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, n_positions=8, vocab_size=262,
                                     activation_function="gelu", bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(source)
    ckpt = tmp_path / "ckpt"
    assert _tool("import_hf")(["--input", str(source), "--save", str(ckpt), "--tensor-model-parallel-size", "2"]) == 0
    capsys.readouterr()
    assert _tool("generate")(["--load", str(ckpt), "--prompt", "the", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    text = capsys.readouterr().out.strip()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    prompt = hf_tokenizer("the", return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=3,
                                pad_token_id=0, suppress_tokens=list(range(len(hf_tokenizer), 262)))
    assert text == hf_tokenizer.decode(greedy[0])
    assert _tool("export_hf")(["--load", str(ckpt), "--output", str(tmp_path / "again")]) == 0
    assert "tokenizer: HuggingFaceTokenizer" in capsys.readouterr().out
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "again")
    assert again.encode("the hat é") == hf_tokenizer.encode("the hat é")


@pytest.mark.slow
def test_a_tp2_runs_checkpoint_exports_and_matches_the_imports_files(megatron_world1, tmp_path: Path) -> None:
    """A real TP 2 x PP 2 run (4 gloo ranks, the runtime's own save): its export computes our
    logits, and importing that export at TP 2 x PP 2 writes the same files (names, shard
    offsets and TP entries in the index) as the run did."""
    from async_helpers import TINY_GPT, run_pretrain

    ckpt = tmp_path / "run"
    run_pretrain([*TINY_GPT, *LLAMA_GQA2, "--hidden-size", "32", "--num-attention-heads", "4", "--num-layers", "2",
                  "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--device", "cpu",
                  "--global-batch-size", "2", "--train-iters", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
                  "--save", str(ckpt), "--save-interval", "2"], tmp_path / "out")
    hf = tmp_path / "hf"
    assert _tool("export_hf")(["--load", str(ckpt), "--output", str(hf)]) == 0
    assert_logits_match(ckpt, hf, seed=2)
    imported = tmp_path / "imported"
    assert _tool("import_hf")(["--input", str(hf), "--save", str(imported), "--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2"]) == 0

    def index(root: Path) -> dict:
        point = int((root / "latest_checkpointed_iteration.txt").read_text())
        metadata = json.loads((root / f"iter_{point:07d}" / "metadata.json").read_text())
        return {f: entry["params"] for f, entry in metadata["index"].items()}

    assert index(imported) == index(ckpt)
