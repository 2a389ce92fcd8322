"""Config: precedence (defaults < preset < --config file < flags), every error path, help, dump."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from helpers import REPO, run_cli
from llama_fp8 import config
from llama_fp8.errors import ConfigError


def parse(*args: str) -> config.TrainConfig:
    return config.parse_args(list(args))


def test_precedence_defaults_preset_file_flags(tmp_path):
    assert config.TrainConfig.lr == 1e-4 and config.TrainConfig.weight_decay == 0.1   # defaults
    assert parse("--model", "tiny").lr == 3e-3                              # preset beats default
    f = tmp_path / "c.yaml"
    f.write_text("lr: 5.0e-4\nweight_decay: 0.2\nmax_steps: 7\n")
    cfg = parse("--model", "tiny", "--config", str(f))
    assert (cfg.lr, cfg.weight_decay, cfg.max_steps) == (5e-4, 0.2, 7)   # file beats preset and default
    cfg = parse("--model", "tiny", "--config", str(f), "--lr", "1e-3", "--weight_decay=0.3")
    assert (cfg.lr, cfg.weight_decay, cfg.max_steps) == (1e-3, 0.3, 7)   # flags beat the file


def test_model_can_come_from_config_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: llama2-7b\n")
    cfg = parse("--config", str(f))
    assert cfg.model == "llama2-7b" and cfg.hidden_width == 4096 and cfg.rope_theta == 10000.0


@pytest.mark.parametrize("preset", config.available_presets())
def test_a_preset_file_given_with_config_runs_as_the_preset_named_with_model(preset):
    """`--config configs/llama2-7b.yaml` (docs/cluster.md, the batch script's header) is the same run as `--model
    llama2-7b`: before, the file did not select its preset and the run took tiny's training settings (its warm-up and
    micro-batch) under llama2-7b's shape."""
    by_name = dataclasses.asdict(parse("--model", preset))
    by_file = dataclasses.asdict(parse("--config", str(REPO / "configs" / f"{preset}.yaml")))
    assert by_file.pop("config") == str(REPO / "configs" / f"{preset}.yaml") and by_name.pop("config") is None
    assert by_file == by_name


def test_a_preset_file_names_its_own_preset(tmp_path, monkeypatch):
    from llama_fp8.config import values

    (tmp_path / "a.yaml").write_text("model: b\nlr: 1.0e-3\n")
    monkeypatch.setattr(values, "PRESET_DIR", tmp_path)
    with pytest.raises(ConfigError, match=r"preset a: model: b does not name this preset \(a.yaml\); write model: a"):
        values.load_preset("a")


def test_both_flag_forms_and_bools():
    cfg = parse("--model=tiny", "--max_steps", "3", "--bf16=0", "--fp8", "true")
    assert (cfg.max_steps, cfg.bf16, cfg.fp8) == (3, False, True)


@pytest.mark.parametrize("args, needle", [
    (["--max_steps", "abc"], "max_steps='abc' is not valid"),
    (["--max_steps", "0"], "max_steps=0 is out of range; valid: an integer >= 1"),
    (["--lr", "-1"], "lr=-1.0 is out of range"),
    (["--warmup", "1.5"], "warmup=1.5 is out of range; valid: a number in [0.0, 1.0]"),
    (["--lr_decay_style", "step"], "valid: cosine, linear, constant"),
    (["--bf16", "2"], "is not a boolean (use 0 or 1)"),
    (["--model", "llama9"], "--model 'llama9' is not a preset"),
    (["--config", "/nonexistent.yaml"], "/nonexistent.yaml: file not found"),
    (["--num_heads", "3"], "--hidden_width 128 is not divisible by --num_heads 3"),
    (["--num_key_value_heads", "3"], "is not divisible by --num_key_value_heads 3"),
    (["--min_lr", "1"], "--min_lr 1.0 is larger than --lr"),
    (["--fp8", "1", "--fp8_backend", "torchao", "--fp8_recipe", "delayed"], "--fp8_recipe delayed is a recipe of --fp8_backend te; with --fp8_backend torchao use one of tensorwise, rowwise"),
    (["--fp8", "1", "--fp8_backend", "te", "--fp8_recipe", "rowwise"], "is a recipe of --fp8_backend torchao; with --fp8_backend te use one of delayed"),
    (["--activation_checkpointing", "2"], "activation_checkpointing='2' is not valid; valid: none, full, selective "
                                          "(or 0 = none, 1 = full)"),
])
def test_bad_values_name_flag_value_and_valid_range(args, needle):
    with pytest.raises(config.ConfigError) as e:
        parse("--model", "tiny", *args)
    assert needle in str(e.value)


def test_yaml_unknown_key_wrong_type_and_not_a_mapping(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train_batch_sizee: 2\n")
    with pytest.raises(config.ConfigError, match=r"unknown key 'train_batch_sizee' \(did you mean train_batch_size\?\)"):
        parse("--config", str(f))
    f.write_text("max_steps: many\n")
    with pytest.raises(config.ConfigError, match=r"c.yaml: max_steps='many' is not valid"):
        parse("--config", str(f))
    f.write_text("- 1\n- 2\n")
    with pytest.raises(config.ConfigError, match="expected a mapping"):
        parse("--config", str(f))
    f.write_text("lr: [1\n")
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        parse("--config", str(f))


def test_unknown_flag_exits_2_with_suggestion(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--model", "tiny", "--train_batch_sizee=2")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--train_batch_sizee" in err and "did you mean --train_batch_size" in err


def test_abbreviated_flag_is_not_accepted(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--max_step", "3")
    assert e.value.code == 2 and "--max_step" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_unknown_flag_exit_code_2():
    """The acceptance command itself, in a real process."""
    r = run_cli(["train", "--model", "tiny", "--train_batch_sizee=2"], timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--train_batch_sizee" in r.stderr


@pytest.mark.slow
def test_cli_bad_value_exit_code_2():
    r = run_cli(["train", "--model", "tiny", "--lr_decay_style", "step"], timeout=120)
    assert r.returncode == 2 and "valid: cosine, linear, constant" in r.stderr


def test_help_lists_every_flag_with_description():
    text = config.build_parser().format_help()
    for f in dataclasses.fields(config.TrainConfig):
        assert f"--{f.name}" in text, f.name
        first_words = " ".join(config.help_of(f).split()[:3])
        assert first_words in " ".join(text.split()), f.name


@pytest.mark.slow
def test_cli_help_exit_0():
    r = run_cli(["train", "--help"], timeout=120)
    assert r.returncode == 0 and "--max_context_width" in r.stdout and "--fp8_backend" in r.stdout


def test_asked_roundtrip_through_a_run_config_yaml(tmp_path):
    """A run's config.yaml (asked + resolved, written by plan.write_config) loads back as what was asked."""
    cfg = parse("--model", "llama3.1-8b", "--lr", "2e-4", "--fp8", "1")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"asked": config.asked(cfg), "resolved": {"model_impl": "hf"}}))
    data = yaml.safe_load((tmp_path / "config.yaml").read_text())["asked"]
    assert data["rope_scaling"]["rope_type"] == "llama3" and data["fp8"] is True
    again = parse("--config", str(tmp_path / "config.yaml"))
    assert dataclasses.asdict(again) | {"config": None} == dataclasses.asdict(cfg) | {"config": None}


def test_the_config_is_frozen():
    cfg = parse("--model", "tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0


def test_model_type_sets_rope_family():
    assert parse("--model", "tiny").rope_theta == 10000.0
    assert parse("--model", "tiny", "--model_type", "llama_v3").rope_theta == 500000.0
    assert parse("--model", "llama3.1-8b", "--model_type", "llama_v2").rope_theta == 10000.0


def test_lr_decay_iters_defaults_to_max_steps():
    assert parse("--model", "tiny", "--max_steps", "33").lr_decay_iters == 33
    assert parse("--model", "tiny", "--max_steps", "33", "--lr_decay_iters", "10").lr_decay_iters == 10


def test_every_preset_loads():
    for name in config.available_presets():
        cfg = parse("--model", name)
        assert all(getattr(cfg, n) is not None for n in config.MODEL_FIELDS if n != "rope_scaling"), name
    assert {"tiny", "llama2-7b", "llama2-13b", "llama2-70b", "llama3.1-8b", "llama3.1-70b", "llama3.2-1b",
            "llama3.2-3b"} <= set(config.available_presets())


@pytest.mark.parametrize(("asked", "name"), [("none", "none"), ("full", "full"), ("selective", "selective"),
                                             ("0", "none"), ("1", "full")])
def test_activation_checkpointing_takes_names_and_reads_0_and_1_as_them(asked, name):
    """none | full | selective (torchtitan's names); the older 0 and 1 still work and are recorded by name."""
    cfg = parse("--model", "tiny", "--activation_checkpointing", asked)
    assert cfg.activation_checkpointing == name and config.asked(cfg)["activation_checkpointing"] == name
    assert "--activation_checkpointing {none,full,selective}" in config.build_parser().format_help()


@pytest.mark.parametrize(("recorded", "name"), [(0, "none"), (1, "full"), ("0", "none"), ("1", "full")])
def test_a_config_yaml_written_with_0_or_1_still_replays(tmp_path, recorded, name):
    """A run folder's config.yaml from before the names (the value as a YAML string or number) runs again."""
    f = tmp_path / "config.yaml"
    f.write_text(yaml.safe_dump({"asked": {"model": "tiny", "activation_checkpointing": recorded},
                                 "resolved": {"model_impl": "hf"}}))
    assert parse("--config", str(f)).activation_checkpointing == name


def test_the_run_dirs_default_is_said_as_the_code_makes_it(monkeypatch):
    """docs/flags.md (the field's help) said runs/<SLURM_JOB_ID or timestamp>; the code makes runs/job_<id>."""
    import re
    import time

    from llama_fp8.config.fields import TrainConfig

    text = config.help_of(TrainConfig.__dataclass_fields__["run_dir"])
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    assert config.default_run_dir() == "runs/job_123" and "runs/job_<SLURM_JOB_ID> in a Slurm job" in text
    monkeypatch.delenv("SLURM_JOB_ID")
    made = config.default_run_dir()
    assert re.fullmatch(r"runs/\d{8}-\d{6}", made) and "else runs/<YYYYmmdd-HHMMSS>" in text
    assert abs(time.mktime(time.strptime(made, "runs/%Y%m%d-%H%M%S")) - time.time()) < 5
