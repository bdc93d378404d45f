"""Export: checkpoints the package wrote (sharded directory, one file, a run directory) as Hugging Face
``save_pretrained`` folders that ``AutoModelForCausalLM.from_pretrained`` loads with the trained logits.

The checkpoints are real: ``CausalLM`` (a tiny Llama from ``model_config``) trained 2 AdamW steps under
``UlyssesFPDTStrategy(sequence_parallel_size=2, data_parallel="fsdp")`` on 2 gloo ranks, saved in both formats;
a peft LoRA model (a LightningModule that is not a ``CausalLM``) trained 1 step at sp 2; a ``CausalLM`` from a
local ``pretrained_path`` with a tokenizer and a yarn ``config_overrides``, and one with ``lora``, trained on one
process. The reference is the trained module's own state (gathered from the ranks) loaded into a plain Hugging Face
model: logits equal bit for bit (a LoRA merge: within 1e-6).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from helpers.hf_models import TINY_LLAMA as TINY
from helpers.hf_models import HFModule, TokenDataset, tiny_config, tiny_model
from helpers.lightning import SEQ, lightning_env
from helpers.lora import lora_model
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.cli import main as cli_main
from lightning_longctx.cli.export import export_pretrained, hf_config
from lightning_longctx.lightning.checkpoint import PARTIAL_PREFIX, commit_info, step_checkpoint_path
from lightning_longctx.recipes import CausalLM, RecallDataModule

DATA = dict(
    seq_len=32, vocab_size=64, num_pairs=2, num_queries=2, batch_size=2, train_samples=4, val_samples=2
)
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.Generator().manual_seed(7)
    batch = torch.randint(0, 64, (2, 40), generator=ids)
    with torch.no_grad():
        return model.eval()(input_ids=batch).logits


def _plain(state: dict, config: dict | None = None) -> torch.nn.Module:
    """A plain Hugging Face model holding the trained module's state (``model.``-prefixed keys)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config or TINY)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return model


def _loaded(out: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)


# ---- CausalLM under sp 2 x FSDP on 2 ranks: a sharded directory and a single file ----


def _fit_causal_lm(root: str) -> dict:
    lightning_env()
    out = {}
    for fmt in ("sharded", "full"):
        torch.manual_seed(0)
        trainer = L.Trainer(
            strategy=UlyssesFPDTStrategy(sequence_parallel_size=2, data_parallel="fsdp", checkpoint_format=fmt),
            accelerator="cpu", devices=2, max_steps=2, default_root_dir=f"{root}/{fmt}", **QUIET,
        )  # fmt: skip
        module = CausalLM(model_config=TINY, lr=1e-2)
        trainer.fit(module, RecallDataModule(**DATA))
        path = step_checkpoint_path(f"{root}/{fmt}/checkpoints", trainer.global_step)
        trainer.save_checkpoint(path)
        out[fmt] = (str(path), trainer.strategy.full_state_dict())  # rank 0: the trained state, gathered
    return out


@pytest.fixture(scope="module")
def trained(dist_pool, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("runs")
    return dist_pool(2).run(_fit_causal_lm, str(root))[0]


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_export_loads_in_transformers_with_the_trained_logits(trained, tmp_path, fmt):
    path, state = trained[fmt]
    assert commit_info(path)["format"] == fmt and commit_info(path)["global_step"] == 2
    out = export_pretrained(path, tmp_path / "hf")
    assert {"model.safetensors", "config.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in TINY} == TINY
    got, want = _logits(_loaded(out)), _logits(_plain(state))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _init_state() -> dict:
    torch.manual_seed(1)
    module = CausalLM(model_config=TINY)
    module.configure_model()
    return module.state_dict()


def test_cli_exports_the_newest_checkpoint_of_a_run_directory_in_bfloat16(trained, tmp_path, capsys):
    path, state = trained["sharded"]
    run = Path(path).parents[1]  # default_root_dir: the resolver finds checkpoints/step-00000002.ckpt
    assert cli_main(["export", str(run), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    assert f"exported {path} (step 2)" in capsys.readouterr().out
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    for key, value in saved.items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(value, state[f"model.{key}"].to(torch.bfloat16), rtol=0, atol=0)
    # an existing, non-empty OUT: refused (exit 2, the fix named), then replaced whole with --overwrite
    assert cli_main(["export", path, str(tmp_path / "hf")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["export", path, str(tmp_path / "hf"), "--overwrite"]) == 0
    got = _logits(_loaded(tmp_path / "hf"))
    torch.testing.assert_close(got, _logits(_plain(state)), rtol=0, atol=0)


# ---- a peft LoRA model (a user's LightningModule): merged, or its adapter folder ----


def _fit_lora(root: str) -> tuple[str, dict]:
    lightning_env()
    module = HFModule(lora_model("llama"), dataset=TokenDataset(1, SEQ), adam=True)
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=2, checkpoint_format="full"),
        accelerator="cpu", devices=2, max_steps=1, **QUIET,
    )  # fmt: skip
    trainer.fit(module)
    path = f"{root}/lora.ckpt"
    trainer.save_checkpoint(path)
    return path, {k: v.clone() for k, v in trainer.strategy.full_state_dict().items()}


def test_lora_exports_merged_or_as_its_adapter(dist_pool, tmp_path):
    from peft import PeftModel

    path, state = dist_pool(2).run(_fit_lora, str(tmp_path))[0]
    trained = lora_model("llama")
    trained.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    want = _logits(trained)
    config = tiny_config("llama").to_dict()  # the module records neither config: the caller gives both
    lora = trained.peft_config["default"].to_dict()
    with pytest.raises(ValueError, match=r"LoRA weights .* lora_config"):
        export_pretrained(path, tmp_path / "x", model_config=config)
    with pytest.raises(ValueError, match=r"does not say how to build its model.*model_config"):
        export_pretrained(path, tmp_path / "x", lora_config=lora)

    merged = export_pretrained(
        path, tmp_path / "merged", model_config=config, lora_config=lora, merge_lora=True
    )
    assert {"model.safetensors", "config.json"} <= {p.name for p in merged.iterdir()}
    got = _logits(_loaded(merged))
    assert not any("lora" in n for n, _ in _loaded(merged).named_parameters())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # W + s·BA vs W x + s·B(A x): 2.1e-7 measured

    (tmp_path / "config.json").write_text(json.dumps(config))  # a config.json path works as well as a dict
    adapter = export_pretrained(path, tmp_path / "adapter", model_config=tmp_path, lora_config=lora)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in adapter.iterdir()}
    reloaded = PeftModel.from_pretrained(tiny_model("llama"), adapter)  # the frozen base is the seeded one
    torch.testing.assert_close(_logits(reloaded), want, rtol=0, atol=0)


# ---- pretrained_path: the config (with the run's overrides) and the tokenizer come from there ----


def _tokenizer(path: Path) -> None:
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4, "world": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.save_pretrained(path)


#: context extension: yarn x2 from the base's 128 positions, its rope_theta (500000) kept
BASE_ROPE = {"rope_type": "default", "rope_theta": 500000.0}
OVERRIDES = {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}, "max_position_embeddings": 256}


@pytest.fixture
def pretrained_run(tmp_path) -> tuple[Path, CausalLM]:
    """A ``CausalLM`` from a local folder (weights, config, tokenizer) with ``config_overrides``, 1 step on one
    process, saved as one file."""
    base = tmp_path / "base"
    _plain(_init_state(), {**TINY, "rope_parameters": BASE_ROPE}).save_pretrained(base)
    _tokenizer(base)
    module = CausalLM(pretrained_path=str(base), config_overrides=OVERRIDES, lr=1e-2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, **QUIET)
    trainer.fit(module, RecallDataModule(**DATA))
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return path, module


def test_pretrained_path_gives_the_config_with_its_overrides_and_the_tokenizer(pretrained_run, tmp_path):
    from transformers import AutoTokenizer

    path, module = pretrained_run
    out = export_pretrained(path, tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("world") == 5
    loaded = _loaded(out)
    assert loaded.config.rope_parameters == module.model.config.rope_parameters
    assert loaded.config.rope_parameters["rope_theta"] == 500000.0
    assert loaded.config.rope_parameters["original_max_position_embeddings"] == 128
    assert loaded.config.max_position_embeddings == 256
    torch.testing.assert_close(_logits(loaded), _logits(module.model), rtol=0, atol=0)
    bare = export_pretrained(path, tmp_path / "bare", tokenizer=False)
    assert not (bare / "tokenizer.json").exists()
    with pytest.raises(FileNotFoundError, match=r"tokenizer .* not on this machine.*--no-tokenizer"):
        export_pretrained(path, tmp_path / "x", tokenizer=tmp_path / "nowhere")


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}


def test_causal_lm_lora_exports_merged_from_its_hyper_parameters(tmp_path, capsys):
    """``CausalLM(lora=...)`` records its LoRA config: ``export --merge-lora`` needs no ``--lora-config``."""
    from peft import AutoPeftModelForCausalLM

    base = tmp_path / "base"
    _plain(_init_state()).save_pretrained(base)
    torch.manual_seed(2)
    module = CausalLM(pretrained_path=str(base), lora=LORA, lr=1e-2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, **QUIET)
    trainer.fit(module, RecallDataModule(**DATA))
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    want = _logits(module.model)

    assert cli_main(["export", str(path), str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged = _loaded(tmp_path / "merged")
    assert type(merged).__name__ == "LlamaForCausalLM" and not any(
        "lora" in n for n, _ in merged.named_parameters()
    )
    error = (_logits(merged) - want).abs().max().item()
    assert error < 1e-6, error  # W + s·BA vs W x + s·B(A x)
    print(f"CausalLM(lora=...) merged export: logits max error {error:.1e}")

    adapter = export_pretrained(path, tmp_path / "adapter")  # names its base: peft's Auto class finds it
    assert json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    torch.testing.assert_close(
        _logits(AutoPeftModelForCausalLM.from_pretrained(adapter)), want, rtol=0, atol=0
    )


def test_pretrained_model_without_a_tokenizer_is_refused(tmp_path):
    """Text through the byte tokenizer (no ``tokenizer``) into a pretrained model: refused before the first step,
    the fix named; with the model's folder as the tokenizer it trains."""
    from lightning_longctx.data import TextFilesDataModule

    base = tmp_path / "base"
    _plain(_init_state()).save_pretrained(base)
    _tokenizer(base)
    (tmp_path / "corpus.txt").write_text("hello world " * 40)
    module = CausalLM(pretrained_path=str(base), lr=1e-2)
    data = dict(paths=[str(tmp_path / "corpus.txt")], seq_len=16)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, **QUIET)
    with pytest.raises(ValueError, match=rf"byte tokenizer.*--data\.tokenizer {base}"):
        trainer.fit(module, TextFilesDataModule(**data))
    assert trainer.global_step == 0
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, **QUIET)
    trainer.fit(
        CausalLM(pretrained_path=str(base), lr=1e-2), TextFilesDataModule(**data, tokenizer=str(base))
    )
    assert trainer.global_step == 1


def test_refusals(pretrained_run, tmp_path):
    path, _ = pretrained_run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"not empty.*overwrite=True"):
        export_pretrained(path, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    partial = tmp_path / f"{PARTIAL_PREFIX}step-00000003.ckpt"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=r"uncommitted checkpoint.*latest_checkpoint"):
        export_pretrained(partial, tmp_path / "x")
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "notes.txt").write_text("no checkpoint here")
    with pytest.raises(ValueError, match=r"no checkpoint.*latest_checkpoint"):
        export_pretrained(tmp_path / "random", tmp_path / "x")
    with pytest.raises(ValueError, match="overlaps the checkpoint"):
        export_pretrained(path, tmp_path, overwrite=True)
    with pytest.raises(FileNotFoundError, match="no such file"):
        export_pretrained(tmp_path / "missing.ckpt", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    # a pretrained_path that is not on this machine: its config is asked for
    with pytest.raises(FileNotFoundError, match=r"pretrained_path=.*--model-config"):
        hf_config({"pretrained_path": str(tmp_path / "elsewhere")})


def test_config_overrides_are_applied_as_causal_lm_applies_them():
    module = CausalLM(model_config={**TINY, "rope_parameters": BASE_ROPE}, config_overrides=OVERRIDES)
    module.configure_model()
    want = {**module.model.config.to_dict(), "use_cache": True}  # CausalLM turns the cache off for training
    assert hf_config(dict(module.hparams)).to_dict() == want
    assert want["rope_parameters"]["original_max_position_embeddings"] == 128


def test_help_lists_every_subcommand(capsys):
    assert cli_main(["--help"]) == 0
    text = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", "plan", "slurm", "export"):
        assert f"\n  {name} " in text, name
    with pytest.raises(SystemExit) as exit_:
        cli_main(["export", "--help"])
    assert exit_.value.code == 0
    assert "--merge-lora" in capsys.readouterr().out
