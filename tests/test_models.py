"""CausalLM: construction, optimisation, checkpoints, and exact evaluation under the strategy."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.distributed as dist

from helpers.hf_models import TINY_LLAMA as TINY
from helpers.lightning import lightning_env
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.recipes import CausalLM, RecallDataModule, warmup_cosine

DATA = dict(
    seq_len=64, vocab_size=64, num_pairs=4, num_queries=4, batch_size=2, train_samples=8, val_samples=8
)


def _tiny(seed: int = 0, **kw) -> CausalLM:
    torch.manual_seed(seed)
    module = CausalLM(model_config=TINY, **kw)
    module.configure_model()
    return module


def _quiet_trainer(**kw) -> L.Trainer:
    kw.setdefault("accelerator", "cpu")
    kw.setdefault("devices", 1)
    return L.Trainer(
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kw
    )


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="exactly one of model_config"):
        CausalLM()
    with pytest.raises(ValueError, match="exactly one of model_config"):
        CausalLM(model_config=TINY, pretrained_path="/x")
    with pytest.raises(ValueError, match="'model_type'"):
        CausalLM(model_config={"hidden_size": 8})
    with pytest.raises(ValueError, match="dtype='fp8'"):
        CausalLM(model_config=TINY, dtype="fp8")
    with pytest.raises(ValueError, match="max_steps_schedule=10 must exceed warmup_steps=10"):
        CausalLM(model_config=TINY, warmup_steps=10, max_steps_schedule=10)
    with pytest.raises(RuntimeError, match="configure_model"):
        _ = CausalLM(model_config=TINY).hf_model


def test_builds_from_config_once_with_dtype_and_checkpointing():
    module = _tiny(dtype="bfloat16", activation_checkpointing=True)
    model = module.model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.hidden_size == 32 and model.config.use_cache is False
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    module.configure_model()
    assert module.model is model, "configure_model must be idempotent (load_from_checkpoint calls it again)"


def test_pretrained_path_loads_local_weights(tmp_path):
    source = _tiny(seed=3).model
    source.save_pretrained(tmp_path)
    module = CausalLM(pretrained_path=str(tmp_path))
    module.configure_model()
    for name, want in source.state_dict().items():
        torch.testing.assert_close(module.model.state_dict()[name], want, rtol=0, atol=0)


def test_warmup_cosine_schedule():
    f = lambda s: warmup_cosine(s, warmup_steps=10, total_steps=110, min_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert warmup_cosine(1000, warmup_steps=0, total_steps=None, min_ratio=0.1) == 1.0


def test_optimizer_groups_and_scheduler():
    module = _tiny(lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9), warmup_steps=2, max_steps_schedule=20)
    conf = module.configure_optimizers()
    opt = conf["optimizer"]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert opt.defaults["betas"] == (0.8, 0.9)
    assert conf["lr_scheduler"]["interval"] == "step"
    assert isinstance(_tiny().configure_optimizers(), torch.optim.AdamW)  # no schedule asked: none


def test_eval_loss_from_labelled_logits_equals_model_loss():
    """The validation path (logits at labelled positions only) gives the HF loss exactly."""
    module = _tiny()
    batch = next(iter(RecallDataModule(**DATA).val_dataloader()))
    want = module.model(**batch).loss
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, value)
    got = module.validation_step(batch, 0)
    torch.testing.assert_close(got, want)
    assert 0.0 <= float(module.val_acc.compute()) <= 1.0 and module.val_acc.total == 8


def test_vocab_smaller_than_data_is_refused():
    module = CausalLM(model_config={**TINY, "vocab_size": 32})
    trainer = _quiet_trainer(max_steps=1)
    with pytest.raises(ValueError, match=r"model_config\.vocab_size >= 64"):
        trainer.fit(module, RecallDataModule(**DATA))


def test_fit_checkpoint_and_load(tmp_path):
    torch.manual_seed(0)
    module = CausalLM(model_config=TINY, lr=1e-2)
    trainer = _quiet_trainer(max_steps=2, limit_val_batches=1, val_check_interval=2)
    trainer.fit(module, RecallDataModule(**DATA))
    assert {"train/loss", "val/loss", "val/recall_acc"} <= set(trainer.callback_metrics)
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = CausalLM.load_from_checkpoint(path)
    for name, want in module.model.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], want, rtol=0, atol=0)


# ---- under the strategy (gloo pool) ----


def _validate(strategy_kwargs: dict | None) -> dict:
    if strategy_kwargs is None:
        trainer = _quiet_trainer()
    else:
        lightning_env()
        strategy = UlyssesFPDTStrategy(sequence_parallel_size=dist.get_world_size(), **strategy_kwargs)
        trainer = _quiet_trainer(strategy=strategy, devices=dist.get_world_size())
    (metrics,) = trainer.validate(_tiny(), RecallDataModule(**DATA), verbose=False)
    return metrics


@pytest.mark.parametrize("strategy_kwargs", [{}, {"fpdt_chunk_size": 8}], ids=["ulysses", "fpdt"])
def test_validation_under_sp2_matches_single_process(dist_pool, strategy_kwargs):
    want = _validate(None)
    for got in dist_pool(2).run(_validate, strategy_kwargs):
        assert got["val/loss"] == pytest.approx(want["val/loss"], rel=1e-5)
        assert got["val/recall_acc"] == pytest.approx(want["val/recall_acc"], abs=1e-6)
