"""S3 settings and decisions that need no server: where the region and endpoint come from, the writer's threads and
prefix strategy, addresses and keys confined, which S3 errors are transient, the newest of two tiers, every M-th
copy. (The saves, loads and faults against a real server: tests/reliability/test_s3.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import s3kit
from llama_fp8 import config, faults
from llama_fp8.checkpoint import places
from llama_fp8.checkpoint.s3 import S3Location, S3Options
from llama_fp8.checkpoint.s3.location import confined_key
from llama_fp8.checkpoint.safe_io import UnsafeCheckpointFile
from llama_fp8.errors import ConfigError


def test_s3_region_and_endpoint_come_from_flags_or_the_aws_environment(monkeypatch):
    for k in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    cfg = config.parse_args(["--checkpoint_dir", "s3://bk1/run", "--s3_region", "eu-west-1", "--s3_endpoint",
                             "http://127.0.0.1:9000", "--s3_threads", "8", "--s3_prefix_strategy", "binary"])
    assert S3Options.from_config(cfg) == S3Options("eu-west-1", "http://127.0.0.1:9000", 8, "binary")
    bare = config.parse_args(["--checkpoint_dir", "s3://bk1/run"])
    with pytest.raises(ValueError, match="--s3_region"):
        S3Options.from_config(bare)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://s3.example.com")
    assert S3Options.from_config(bare) == S3Options("us-west-2", "https://s3.example.com", 4, "auto")
    with pytest.raises(ValueError, match="--s3_endpoint"):
        S3Options.from_config(config.parse_args(["--s3_endpoint", "127.0.0.1:9000"]))
    with pytest.raises(ConfigError, match="prefix"):
        places.location("s3://bk1/a/../b")
    with pytest.raises(ConfigError, match="bucket name"):
        places.location("s3://B_ad/run")


def test_s3_writer_threads_and_prefix_strategy_reach_the_connectors_writer():
    s3kit.require()
    from s3torchconnector.dcp import BinaryPrefixStrategy, DefaultPrefixStrategy, HexPrefixStrategy

    from llama_fp8.checkpoint.s3 import save

    ckpt = S3Location("bk1", "run/step_2")
    w = save.storage_writer(S3Options("us-east-1", "http://127.0.0.1:1", threads=6), ckpt, object, 2)
    assert w.thread_count == 6 and isinstance(w.prefix_strategy, DefaultPrefixStrategy)
    assert w.fs.root == str(ckpt) and w.fs._client._endpoint == "http://127.0.0.1:1"  # the connector's lacks it
    assert isinstance(S3Options("r").strategy(16), HexPrefixStrategy)  # auto: spread from 16 ranks on
    assert isinstance(S3Options("r", prefix_strategy="binary").strategy(2), BinaryPrefixStrategy)
    assert S3Options("r", prefix_strategy="hex").strategy(4)(3).endswith("/__3_")


@pytest.mark.parametrize("name", ["../x", "/abs", "a//b", "a/b/c/d", "", "a\\b", "x\0"])
def test_s3_keys_outside_the_checkpoint_are_refused(name):
    with pytest.raises(UnsafeCheckpointFile, match="not a plain key"):
        confined_key(S3Location("bk1", "run/step_2"), name)
    assert str(confined_key(S3Location("bk1", "run/step_2"), "0a1b/__3_0.distcp")) == "s3://bk1/run/step_2/0a1b/__3_0.distcp"


def test_s3_errors_are_transient_only_when_a_rerun_may_not_repeat_them():
    S3Exception = type("S3Exception", (Exception,), {})
    transient = ["Client error: Unknown CRT error: CRT error 1047: aws-c-io: AWS_IO_SOCKET_CONNECTION_REFUSED, "
                 "socket connection refused.", "Service error: SlowDown: Please reduce your request rate.",
                 "Client error: Request timeout"]
    setting = ["Client error: Forbidden: The access key ID you provided does not exist in our records.",
               "Service error: The bucket does not exist"]
    assert [faults.kind_of(S3Exception(t)) for t in transient] == ["network"] * 3
    assert [faults.kind_of(S3Exception(t)) for t in setting] == [None, None]


def test_the_newest_complete_checkpoint_of_either_tier_is_resumed(monkeypatch, tmp_path):
    fs, s3 = tmp_path / "fsx", S3Location("bk1", "tier")
    listed = {str(fs): [(2, fs / "step_2"), (4, fs / "step_4")], str(s3): [(2, s3 / "step_2"), (6, s3 / "step_6")]}
    monkeypatch.setattr(places, "complete", lambda cfg, where: listed[str(where)])
    cfg = SimpleNamespace(checkpoint_copy_dir=str(s3), resume_from_checkpoint="auto")
    assert places.candidates(cfg, fs) == [(6, s3 / "step_6"), (4, fs / "step_4"), (2, fs / "step_2"),
                                          (2, s3 / "step_2")]  # a tie: the file system's first (faster)
    assert places.find_resume(cfg, fs) == s3 / "step_6"
    listed[str(s3)] = [(2, s3 / "step_2")]
    assert places.find_resume(cfg, fs) == fs / "step_4"


def test_every_mth_checkpoint_is_copied_and_one_copy_at_a_time():
    from llama_fp8.checkpoint.s3.copy import Copier

    c = Copier(SimpleNamespace(root=S3Location("bk1", "tier")), every=3, keep=2)
    due = [c.destination(s) for s in (2, 4, 6, 8, 10, 12, 14)]
    assert [d.name if d else None for d in due] == ["step_2", None, None, "step_8", None, None, "step_14"]
    c._pending = (8, SimpleNamespace(done=lambda: False))  # the copy of step_8 still running
    c2 = Copier(SimpleNamespace(root=S3Location("bk1", "tier")), every=1, keep=2)
    c2._pending = c._pending
    assert c2.destination(10) is None and c2.busy() == 8  # not copied; training goes on
    c2._pending = None
    assert c2.destination(12).name == "step_12"


def test_a_copy_dir_must_be_s3_from_a_file_system_checkpoint_dir(tmp_path):
    from llama_fp8 import plan

    cfg = config.parse_args(["--run_dir", str(tmp_path / "r"), "--checkpoint_copy_dir", str(tmp_path / "other")])
    with pytest.raises(ConfigError, match="--checkpoint_copy_dir"):
        plan.decide_dirs(cfg)
    assert not Path(tmp_path / "r").exists()
