"""The ``lightning-longctx`` console script, the example configs and sbatch files, SLURM detection."""

from __future__ import annotations

import csv
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch.distributed as dist
import yaml
from lightning.fabric.plugins.environments import SLURMEnvironment

from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.cli import LongCtxCLI, main
from lightning_longctx.recipes import RecallDataModule

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
DEMO = CONFIGS / "demo_cpu.yaml"
# Each example sbatch file and the `lightning-longctx slurm` arguments that generate it.
SBATCH_EXAMPLES = {
    "llama3_8b_4node.sbatch": ["--nodes", "4", "--gpus-per-node", "8", "--cpus-per-task", "8",
                               "--config", "examples/configs/llama3_8b_4node_slurm.yaml"],
    "llama3_8b_1m_fpdt_8gpu.sbatch": ["--nodes", "1", "--gpus-per-node", "8", "--cpus-per-task", "8",
                                      "--time", "12:00:00", "--config", "examples/configs/llama3_8b_1m_fpdt_8gpu.yaml"],
}  # fmt: skip


def _clean_env() -> dict[str, str]:
    """The environment of a fresh shell: no rank variables or SLURM job left over from the test process."""
    drop = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in drop}


def _console_script() -> list[str]:
    script = Path(sys.executable).parent / "lightning-longctx"
    if script.exists():
        return [str(script)]
    found = shutil.which("lightning-longctx")
    return [found] if found else [sys.executable, "-m", "lightning_longctx"]


def _run(cmd: list[str], timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


# ---- the demo, end to end, as a user runs it ----


@pytest.mark.slow  # a real two-process fit of the demo config: about a minute on 2 cores
def test_demo_cpu_trains_recall_well_above_chance_with_sp2(tmp_path):
    """Two processes launched by Lightning from the console script, sp=2; a short run of the demo."""
    steps = 350
    _run(
        [
            *_console_script(),
            "fit",
            f"--config={DEMO}",
            f"--trainer.max_steps={steps}",
            f"--trainer.val_check_interval={steps}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false",
            f"--model.init_args.max_steps_schedule={steps}",
        ],
        timeout=240,
    )
    (metrics_file,) = tmp_path.glob("*/version_*/metrics.csv")
    rows = list(csv.DictReader(metrics_file.open()))
    accs = [float(r["val/recall_acc"]) for r in rows if r.get("val/recall_acc")]
    tokens_per_sec = [float(r["perf/tokens_per_sec"]) for r in rows if r.get("perf/tokens_per_sec")]
    mfu = [float(r["perf/mfu"]) for r in rows if r.get("perf/mfu")]
    chance = RecallDataModule(**yaml.safe_load(DEMO.read_text())["data"]["init_args"]).chance_accuracy
    assert accs, f"no val/recall_acc in {metrics_file}"
    assert accs[-1] >= 3 * chance, f"val/recall_acc {accs[-1]:.3f} is not clearly above chance {chance:.3f}"
    assert tokens_per_sec and min(tokens_per_sec) > 0 and mfu and min(mfu) > 0


DEMO_LONG = CONFIGS / "demo_long_cpu.yaml"


def _fit_config_in_rank(config: str) -> None:
    """A pool rank: ``lightning-longctx fit --config CONFIG`` through the console script's entry point."""
    from helpers.lightning import lightning_env

    lightning_env()
    assert main(["fit", f"--config={config}"]) == 0


@pytest.mark.slow  # two warm ranks, in-process: a few seconds
def test_demo_long_cpu_short_variant_logs_the_needle_grid_and_loss_by_position(dist_pool, tmp_path):
    """The long demo's config, shortened (512 tokens, 3 steps, a 2 x 3 grid): FPDT on 2 ranks, one validation
    run, both evaluation callbacks logged and drawn."""
    cfg = yaml.safe_load(DEMO_LONG.read_text())
    trainer = cfg["trainer"]
    trainer.update(max_steps=3, val_check_interval=3, enable_checkpointing=False, enable_progress_bar=False)
    trainer["logger"]["init_args"]["save_dir"] = str(tmp_path)
    trainer["strategy"]["init_args"]["fpdt_chunk_size"] = 64
    cfg["data"]["init_args"]["seq_len"] = 512
    (needle,) = [c for c in trainer["callbacks"] if c["class_path"].endswith("NeedleRetrieval")]
    (positional,) = [c for c in trainer["callbacks"] if c["class_path"].endswith("PositionalLoss")]
    needle["init_args"].update(lengths=[256, 512], samples=2, batch_size=2)
    positional["init_args"]["buckets"] = [128, 256, 384, 512]
    config = tmp_path / "short.yaml"
    config.write_text(yaml.safe_dump(cfg))
    dist_pool(2).run(_fit_config_in_rank, str(config))
    (metrics,) = tmp_path.glob("*/version_*/metrics.csv")
    (row,) = [r for r in csv.DictReader(metrics.open()) if r.get("val/needle/mean")]
    cells = {f"val/needle/{n}/{d}" for n in (256, 512) for d in ("0", "0.5", "1")}
    buckets = {f"val/loss_by_position/{a}-{a + 127}" for a in (128, 256, 384)}
    assert cells | buckets <= {k for k, v in row.items() if v}, row
    assert all(0.0 <= float(row[k]) <= 1.0 for k in cells)
    for png in ("needle.png", "loss_by_position.png"):
        assert (metrics.parent / png).read_bytes()[:4] == b"\x89PNG"


# ---- configs and sbatch examples ----


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_example_config_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_longctx.UlyssesFPDTStrategy"
    assert printed["model"]["class_path"] == "lightning_longctx.recipes.CausalLM"


def test_llama3_8b_configs_have_the_llama3_8b_shape():
    for name, nodes in (("llama3_8b_1m_fpdt_8gpu.yaml", 1), ("llama3_8b_4node_slurm.yaml", 4)):
        cfg = yaml.safe_load((CONFIGS / name).read_text())
        model = cfg["model"]["init_args"]["model_config"]
        want = dict(
            hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=1048576,
        )  # fmt: skip
        assert {k: model[k] for k in want} == want
        assert cfg["data"]["init_args"]["seq_len"] == 1048576
        assert (cfg["trainer"]["devices"], cfg["trainer"]["num_nodes"]) == (8, nodes)
        sp = cfg["trainer"]["strategy"]["init_args"]
        assert sp["sequence_parallel_size"] == 8 and sp["offload"] is True
        assert 1048576 % (sp["fpdt_chunk_size"] * sp["sequence_parallel_size"]) == 0


@pytest.mark.parametrize("name", sorted(SBATCH_EXAMPLES))
def test_sbatch_examples_are_what_the_generator_writes(name, tmp_path):
    out = tmp_path / name
    assert main(["slurm", *SBATCH_EXAMPLES[name], "-o", str(out)]) == 0
    committed = (ROOT / "examples" / "slurm" / name).read_text()
    assert committed == out.read_text(), f"examples/slurm/{name} is stale: regenerate it"
    args = dict(zip(SBATCH_EXAMPLES[name][::2], SBATCH_EXAMPLES[name][1::2]))
    trainer = yaml.safe_load((ROOT / args["--config"]).read_text())["trainer"]
    assert f"#SBATCH --nodes={trainer['num_nodes']}" in committed
    assert f"#SBATCH --ntasks-per-node={trainer['devices']}" in committed
    assert f"#SBATCH --gres=gpu:{trainer['devices']}" in committed
    srun = next(line for line in committed.splitlines() if line.startswith("srun "))
    assert srun == (
        f"srun lightning-longctx fit --config {args['--config']} "
        f"--trainer.num_nodes={trainer['num_nodes']} --trainer.devices={trainer['devices']} --ckpt_path auto"
    )


def test_python_m_runs_the_slurm_subcommand(tmp_path, monkeypatch):
    """`python -m lightning_longctx slurm ...`, run in-process (the demo test covers a real launch)."""
    out = tmp_path / "job.sbatch"
    argv = ["slurm", "--nodes", "2", "--gpus-per-node", "4", "--config", "my.yaml", "-o", str(out)]
    monkeypatch.setattr(sys, "argv", ["lightning_longctx", *argv, "--", "--trainer.max_steps=10"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("lightning_longctx", run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 0
    assert "srun lightning-longctx fit --config my.yaml --trainer.num_nodes=2 --trainer.devices=4 " \
        "--ckpt_path auto --trainer.max_steps=10" in out.read_text()  # fmt: skip
    assert main(["slurm", "--nodes", "0", "--gpus-per-node", "8", "--config", "my.yaml"]) == 2


# ---- strategy resolution ----

_NO_IMPORT_SCRIPT = """
import sys
import lightning as L
from lightning.pytorch.cli import LightningCLI
cli = LightningCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True,
                   subclass_mode_data=True, run=False, args=["--config", sys.argv[1]])
s = cli.trainer.strategy
print("STRATEGY", type(s).__module__, type(s).__name__, s.sp_config.sequence_parallel_size)
print("BUCKET_VIEW", s._ddp_kwargs["gradient_as_bucket_view"])
print("DDP_KWARGS", sorted(s._ddp_kwargs))
(periodic,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "PeriodicCheckpoint"]
print("PERIODIC", periodic._every_n_train_steps, periodic.keep_latest_k, periodic.monitor, periodic.save_last)
"""


@pytest.mark.slow  # the CLI in a fresh process
def test_yaml_class_path_strategy_needs_no_import(tmp_path):
    """Plain LightningCLI (no `import lightning_longctx` anywhere) resolves the strategy's class_path."""
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "accelerator": "cpu",
                    "devices": 2,
                    "logger": False,
                    "strategy": {
                        "class_path": "lightning_longctx.UlyssesFPDTStrategy",
                        "init_args": {"sequence_parallel_size": 2},
                    },
                    # as the shipped GPU configs: jsonargparse passes ModelCheckpoint's defaults along
                    "callbacks": [
                        {
                            "class_path": "lightning_longctx.lightning.callbacks.PeriodicCheckpoint",
                            "init_args": {"every_n_train_steps": 100, "keep_latest_k": 2, "save_last": True},
                        }
                    ],
                },
                "model": {"class_path": "lightning.pytorch.demos.boring_classes.BoringModel"},
                "data": {"class_path": "lightning.pytorch.demos.boring_classes.BoringDataModule"},
            }
        )
    )
    script = tmp_path / "plain_cli.py"
    script.write_text(_NO_IMPORT_SCRIPT)
    out = _run([sys.executable, str(script), str(config)], timeout=120, cwd=tmp_path).stdout
    assert "STRATEGY lightning_longctx.lightning.strategy UlyssesFPDTStrategy 2" in out
    # LightningCLI passes every DDP keyword at DDP's default: ours (gradients in the buckets) must win
    assert "BUCKET_VIEW True" in out
    # DDP's arguments the strategy sets itself (process_group, ...) arrive at their defaults: not passed on
    assert "DDP_KWARGS ['gradient_as_bucket_view']" in out, out
    assert "PERIODIC 100 2 step True" in out, out


@pytest.mark.parametrize(
    ("name", "chunk"), [("ulysses", None), ("ulysses_fpdt", 4096), ("fpdt_offload", 4096)]
)
def test_strategy_names_work_in_the_cli(name, chunk):
    cli = LongCtxCLI(
        L.LightningModule,
        None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            "--trainer.logger=false",
            f"--trainer.strategy={name}",
            '--model.model_config={"model_type": "llama"}',
        ],
    )
    assert isinstance(cli.trainer.strategy, UlyssesFPDTStrategy)
    assert cli.trainer.strategy.sp_config.fpdt_chunk_size == chunk
    assert type(cli.model).__name__ == "CausalLM"  # the default --model


# ---- SLURM: detection, layout, mesh ----


def _slurm_env(*, nodes: int, tasks_per_node: int, rank: int) -> dict[str, str]:
    return {
        "SLURM_NTASKS": str(nodes * tasks_per_node),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_NNODES": str(nodes),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % tasks_per_node),
        "SLURM_NODEID": str(rank // tasks_per_node),
        "SLURM_JOB_NAME": "longctx",  # not 'bash'/'interactive', which Lightning reads as interactive
        "SLURM_JOB_ID": "4242",
        "SLURM_NODELIST": f"node[1-{nodes}]" if nodes > 1 else "node1",
    }


@pytest.mark.parametrize(
    ("nodes", "rank", "sp", "dp_rank", "sp_rank"),
    [(1, 1, 2, 0, 1), (2, 3, 2, 1, 1), (2, 2, 2, 1, 0), (2, 1, 4, 0, 1)],
)
def test_slurm_environment_is_detected_with_the_right_layout(monkeypatch, nodes, rank, sp, dp_rank, sp_rank):
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in _slurm_env(nodes=nodes, tasks_per_node=2, rank=rank).items():
        monkeypatch.setenv(key, value)
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=sp),
        accelerator="cpu",
        devices=2,
        num_nodes=nodes,
        logger=False,
    )
    strategy = trainer.strategy
    assert isinstance(strategy.cluster_environment, SLURMEnvironment)
    assert (strategy.global_rank, strategy.local_rank, strategy.node_rank) == (rank, rank % 2, rank // 2)
    assert strategy.world_size == 2 * nodes
    assert (strategy.dp_size, strategy.sp_size) == (2 * nodes // sp, sp)
    assert (strategy.dp_rank, strategy.sp_rank) == (dp_rank, sp_rank)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2 * nodes // sp, "rank": dp_rank}


def test_slurm_tasks_per_node_must_match_devices(monkeypatch):
    for key, value in _slurm_env(nodes=1, tasks_per_node=4, rank=0).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"devices=2.*--ntasks-per-node=4.*HINT: Set `devices=4`"):
        L.Trainer(strategy=UlyssesFPDTStrategy(sequence_parallel_size=2), accelerator="cpu", devices=2)


class _GroupRanks(L.Callback):
    """The ranks of the strategy's sp and dp groups, read during the fit (its teardown destroys them)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        s = trainer.strategy
        self.ranks = {
            "sp_group": dist.get_process_group_ranks(s.sp_group),
            "dp_group": dist.get_process_group_ranks(s.dp_group),
        }


def _fit_under_fake_slurm() -> dict:
    """One rank of a fake 2-node x 2-task srun job: a one-step fit, then the groups the mesh built."""
    from lightning_longctx.recipes import CausalLM

    saved = dict(os.environ)
    rank = dist.get_rank()
    try:
        for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
            os.environ.pop(key, None)
        os.environ.update(_slurm_env(nodes=2, tasks_per_node=2, rank=rank))
        config = dict(
            model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        trainer = L.Trainer(
            strategy=UlyssesFPDTStrategy(sequence_parallel_size=2),
            accelerator="cpu",
            devices=2,
            num_nodes=2,
            max_steps=1,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        data = RecallDataModule(seq_len=32, vocab_size=64, num_pairs=2, batch_size=1, train_samples=4)
        groups = _GroupRanks()
        trainer.callbacks.append(groups)
        trainer.fit(CausalLM(model_config=config), data)
        s = trainer.strategy
        return {
            "env": type(s.cluster_environment).__name__,
            **groups.ranks,
            "sampler": s.distributed_sampler_kwargs,
            "train_sampler": dict(
                num_replicas=trainer.train_dataloader.sampler.num_replicas,
                rank=trainer.train_dataloader.sampler.rank,
            ),
        }
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_fit_under_slurm_uses_the_dp_sp_mesh(dist_pool):
    results = dist_pool(4).run(_fit_under_fake_slurm)
    for rank, got in enumerate(results):
        assert got["env"] == "SLURMEnvironment"
        assert got["sp_group"] == [2 * (rank // 2), 2 * (rank // 2) + 1], "sp must stay inside a node"
        assert got["dp_group"] == [rank % 2, rank % 2 + 2]
        assert got["sampler"] == got["train_sampler"] == {"num_replicas": 2, "rank": rank // 2}


# ---- torchrun: the world is what torchrun started ----


def _fake_torchrun(monkeypatch: pytest.MonkeyPatch, *, world: int, local: int) -> None:
    """Rank 0 of a torchrun launch of ``world`` processes, ``local`` per node (no process is started)."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    env = {"TORCHELASTIC_RUN_ID": "test", "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": local, "RANK": 0,
           "LOCAL_RANK": 0, "GROUP_RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))


def test_torchrun_world_takes_torchruns_and_refuses_a_count_that_disagrees(monkeypatch):
    from lightning_longctx.cli import torchrun_world

    for key in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert torchrun_world("auto", 1) == ("auto", 1)  # not under torchrun: as given
    _fake_torchrun(monkeypatch, world=16, local=8)
    assert torchrun_world("auto", 1) == torchrun_world(None, None) == torchrun_world(-1, 2) == (8, 2)
    assert torchrun_world(8, 1) == (8, 2) and torchrun_world("8", 2) == ("8", 2)  # the count torchrun started
    assert torchrun_world([0, 1, 2, 3, 4, 5, 6, 7], 1) == ([0, 1, 2, 3, 4, 5, 6, 7], 2)
    with pytest.raises(
        ValueError, match=r"devices=2: torchrun started 16 processes, 8 per node.*--nproc_per_node 2"
    ):
        torchrun_world(2, 1)
    with pytest.raises(ValueError, match=r"num_nodes=4: .*set devices=8 and num_nodes=2"):
        torchrun_world("auto", 4)


def test_cli_and_train_hf_under_torchrun_take_its_world(monkeypatch):
    """`torchrun --nproc_per_node 2 -m lightning_longctx fit ...` (faked: rank 0's variables): the Trainer gets
    torchrun's 2 devices when the config leaves devices at 'auto', and a config or examples/train_hf.py asking
    for another count is refused before anything is built."""
    import importlib.util

    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    _fake_torchrun(monkeypatch, world=2, local=2)
    args = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.strategy=ulysses",
            '--model.model_config={"model_type": "llama"}']  # fmt: skip
    cli = LongCtxCLI(
        L.LightningModule, None, subclass_mode_model=True, subclass_mode_data=True, run=False, args=args
    )
    assert (cli.trainer.num_devices, cli.trainer.num_nodes) == (2, 1)
    assert isinstance(cli.trainer.strategy.cluster_environment, TorchElasticEnvironment)
    assert cli.trainer.strategy.sp_config.sequence_parallel_size == "auto"  # all devices of the node: sp 2
    with pytest.raises(ValueError, match=r"devices=4: torchrun started 2 processes, 2 per node"):
        LongCtxCLI(L.LightningModule, None, subclass_mode_model=True, subclass_mode_data=True, run=False,
                   args=[*args, "--trainer.devices=4"])  # fmt: skip

    spec = importlib.util.spec_from_file_location("train_hf", ROOT / "examples" / "train_hf.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.parse_args([]).devices is None  # torchrun's, else 2
    with pytest.raises(ValueError, match=r"devices=4: torchrun started 2 processes"):
        example.main(["--devices", "4"])
