from __future__ import annotations

import pytest

from lightning_longctx.cli.slurm import main, write_sbatch


def _sbatch_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#SBATCH")]


def test_script_has_every_line():
    text = write_sbatch(
        nodes=4,
        gpus_per_node=8,
        config="configs/llama.yaml",
        time="2-00:00:00",
        partition="gpu",
        account="proj42",
        job_name="ctx1m",
        extra_args=["--trainer.max_steps=100"],
    )
    assert text.startswith("#!/bin/bash\n")
    sb = _sbatch_lines(text)
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --signal=SIGUSR1@600",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --job-name=ctx1m",
    ):
        assert line in sb, line
    # the signal must reach the srun tasks, not only the batch shell
    assert [line for line in sb if "--signal" in line] == ["#SBATCH --signal=SIGUSR1@600"]
    assert "--signal=B:" not in text
    srun = [line for line in text.splitlines() if line.startswith("srun ")]
    assert srun == [
        "srun lightning-longctx fit --config configs/llama.yaml --trainer.num_nodes=4 "
        "--trainer.devices=8 --ckpt_path auto --trainer.max_steps=100"
    ]
    # every #SBATCH line sits before the first command, or sbatch ignores it
    lines = text.splitlines()
    first_cmd = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(i < first_cmd for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    # comments explain the lines
    assert text.count("\n# ") >= 5


def test_optional_lines_absent_and_quoting():
    text = write_sbatch(nodes=1, gpus_per_node=1, config="my dir/c.yml")
    sb = _sbatch_lines(text)
    assert not any(line.startswith(("#SBATCH --partition", "#SBATCH --account")) for line in sb)
    assert "#SBATCH --time=24:00:00" in sb
    assert "#SBATCH --job-name=longctx" in sb
    assert "--config 'my dir/c.yml'" in text


def test_write_sbatch_output_file(tmp_path):
    out = tmp_path / "job.sbatch"
    text = write_sbatch(nodes=2, gpus_per_node=4, config="c.yaml", output=str(out))
    assert out.read_text() == text


def test_cli_writes_file(tmp_path, capsys):
    out = tmp_path / "train.sbatch"
    args = ["--nodes", "2", "--gpus-per-node", "4", "--config", "c.yaml", "-o", str(out), "--partition", "p"]
    rc = main([*args, "--", "--trainer.max_steps=5"])
    assert rc == 0
    text = out.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --partition=p" in text
    assert text.rstrip().endswith(
        "--trainer.num_nodes=2 --trainer.devices=4 --ckpt_path auto --trainer.max_steps=5"
    )
    assert capsys.readouterr().out == ""


def test_cli_stdout_and_bad_input(capsys):
    assert main(["--nodes", "1", "--gpus-per-node", "2", "--config", "c.yaml"]) == 0
    assert "#SBATCH --ntasks-per-node=2" in capsys.readouterr().out
    assert main(["--nodes", "0", "--gpus-per-node", "2", "--config", "c.yaml"]) == 2
    assert "nodes=0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--nodes", "1"])  # argparse: missing required arguments


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(nodes=0), r"nodes=0 must be an integer >= 1"),
        (dict(gpus_per_node=0), r"gpus_per_node=0 must be an integer >= 1"),
        (dict(config="c.json"), r"config='c.json' must be .*\.yaml or \.yml"),
        (dict(time="tomorrow"), r"time='tomorrow'"),
        (dict(job_name="interactive"), r"job_name='interactive'.*choose another name"),
        (dict(partition="a b"), r"partition='a b'"),
        (dict(signal_lead=0), r"signal_lead=0 must be whole seconds in 1\.\.65535"),
        (dict(signal_lead=70000), r"signal_lead=70000 must be whole seconds"),
        (dict(signal_lead=1.5), r"signal_lead=1\.5 must be whole seconds"),
        (
            dict(time="10", signal_lead=600),
            r"signal_lead=600 s is not shorter than the time limit '10' \(600 s\)",
        ),
    ],
)
def test_bad_inputs(kwargs, match):
    args = dict(nodes=1, gpus_per_node=1, config="c.yaml") | kwargs
    with pytest.raises(ValueError, match=match):
        write_sbatch(**args)


def test_signal_lead_is_an_option_and_the_job_resumes_automatically(capsys):
    """The lead time (one optimizer step plus one save) is the CLI's --signal-lead; every generated job runs
    `fit --ckpt_path auto`, so a requeued job resumes from the run's newest committed checkpoint."""
    assert main(["--nodes", "1", "--gpus-per-node", "2", "--config", "c.yaml", "--signal-lead", "1200"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --signal=SIGUSR1@1200" in _sbatch_lines(text)
    assert "# SIGUSR1 1200 s before the time limit" in text
    assert {"#SBATCH --requeue", "#SBATCH --open-mode=append"} <= set(_sbatch_lines(text))
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.endswith("--trainer.devices=2 --ckpt_path auto")
    # a --ckpt_path of the user's own is kept, and not doubled
    text = write_sbatch(nodes=1, gpus_per_node=1, config="c.yaml", extra_args=["--ckpt_path=run/x.ckpt"])
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.count("--ckpt_path") == 1 and srun.endswith("--ckpt_path=run/x.ckpt")
    assert main(["--nodes", "1", "--gpus-per-node", "2", "--config", "c.yaml", "--signal-lead", "0"]) == 2
    assert "signal_lead=0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("time", "seconds"),
    [("90", 5400), ("1:30", 90), ("2:00:00", 7200), ("1-0", 86400), ("1-2:3", 93780), ("1-2:3:4", 93784)],
)
def test_time_limit_seconds(time, seconds):
    from lightning_longctx.cli.slurm import time_limit_seconds

    assert time_limit_seconds(time) == seconds
