"""Per-rank windows: a rank slowed by a fault is named with its host and local GPU; NVML readings from a
fake NVML module mark throttled windows; no NVML says "not measured"."""

from __future__ import annotations

import socket
import subprocess
import sys
import types

import pytest
import torch

from helpers import REPO, cli_env, train_records
from llama_fp8.telemetry import gpu_health, stragglers


@pytest.mark.slow
def test_a_rank_slowed_by_a_fault_is_named_with_host_and_gpu(tiny_args, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "llama_fp8",
           "train", *tiny_args, "--max_steps", "6", "--logging_freq", "3", "--straggler_threshold_pct", "15"]
    # rank 1's input pipeline is slow: 2 s a batch, so that rank 0's own noise on a busy machine stays well under the
    # 15 % (a CI run with 1 s: rank 0 named too, 16 % over the median, rank 1 at 32 %)
    env = cli_env(LLAMA_FP8_FAULT="sleep@data:rank=1:seconds=2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    recs = train_records(tmp_path / "run")
    assert len(recs) == 2
    for rec in recs:
        r0, r1 = rec["ranks"]
        assert (r0["rank"], r0["local_rank"], r1["rank"], r1["local_rank"]) == (0, 0, 1, 1)
        assert r1["data_wait_s"] >= 1.0 > r0["data_wait_s"]                  # per-rank figures are kept
        assert r0["host"] == r1["host"] == socket.gethostname()
        assert len(rec["stragglers"]) == 1, rec                              # rank 1 only, named
        (s,) = rec["stragglers"]
        assert (s["rank"], s["host"], s["local_rank"], s["cause"]) == (1, socket.gethostname(), 1, "data wait")
        assert s["slower_pct"] > 15 and rec["gpu_health"].startswith("not measured (no CUDA")
        assert r0["sm_clock_mhz"] is None and rec["throttled"] is False
    assert f"rank 1 ({socket.gethostname()} GPU 1)" in proc.stderr


@pytest.mark.slow
def test_a_rank_paused_from_outside_most_of_the_time_is_named_as_the_one_the_others_wait_for(tiny_args, tmp_path):
    """Rank 1 of 2 gloo ranks is stopped and continued from outside, 90 ms of every 120 (a noisy neighbour, a
    throttled device): its steps take as long as rank 0's (every collective makes rank 0 wait for it), so host step
    timers make them equal and it was not named. Rank 0 spends its waits in the collectives, rank 1 hardly any:
    rank 1 is named, with the cause "the others wait for it"; rank 0 never is.

    Why 3/4 of the time: half the margin in collectives per step is what names a rank, and it must clear the
    sampler's noise floor (2 looks, 20 ms a step). Paused a fraction p of the time, rank 0 waits p/(1-p) times
    rank 1's own work per step: with p = 1/2 the margin was half a step's work, 17.5-24.5 ms on an idle 2-core
    machine, so one or two of five windows fell under the floor (a flaky test); with p = 3/4 it is 1.5 times the
    work, 49-90 ms there (2.5 times the floor or more)."""
    import os
    import signal
    import threading
    import time

    from helpers import worker_pids

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "llama_fp8",
           "train", *tiny_args, "--max_steps", "36", "--logging_freq", "6", "--straggler_threshold_pct", "10"]
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cli_env(), cwd=REPO)
    done = threading.Event()

    def noisy_neighbour():
        # From the training loop on: paused 3/4 of its start-up too, a run took half as long again.
        pid = None
        while (pid is None or "start-up" not in log.read_text()) and not done.is_set():
            pid = pid or worker_pids(proc.pid).get(1)
            time.sleep(0.05)
        while not done.is_set():
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.09)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.03)
            except ProcessLookupError:
                return

    pauser = threading.Thread(target=noisy_neighbour, daemon=True)
    pauser.start()
    try:
        proc.wait(timeout=600)
    finally:
        done.set()
        pauser.join()
    err = log.read_text()
    assert proc.returncode == 0, err[-3000:]
    recs = train_records(tmp_path / "run")[1:]  # the first window holds start-up's warm-up
    named = [[(s["rank"], s["cause"]) for s in rec["stragglers"]] for rec in recs]
    assert all((0, "the others wait for it") not in n and all(r == 1 for r, _ in n) for n in named), named
    assert sum((1, "the others wait for it") in n for n in named) >= len(recs) - 1, named
    assert all(rec["ranks"][0]["comm_wait_s"] > rec["ranks"][1]["comm_wait_s"] for rec in recs), recs


def test_find_stragglers_threshold_and_causes():
    ranks = [{"rank": i, "host": f"n{i // 2}", "local_rank": i % 2, "step_s": st, "data_wait_s": dw}
             for i, (st, dw) in enumerate([(1.0, 0.0), (1.0, 0.0), (1.25, 0.0), (1.0, 0.15)])]
    named = stragglers.find_stragglers(ranks, 0.10)
    assert [(s["rank"], s["host"], s["local_rank"], s["cause"]) for s in named] == [
        (2, "n1", 0, "step time"), (3, "n1", 1, "data wait")]
    assert named[0]["slower_pct"] == pytest.approx((1.25 - 1.075) / 1.075 * 100)   # median of 1, 1, 1.15, 1.25
    assert stragglers.find_stragglers(ranks, 0.30) == []          # both within 30 %
    assert stragglers.find_stragglers(ranks[:1], 0.0) == []       # one rank: nobody to compare with


def test_the_rank_that_waits_least_in_collectives_is_the_one_the_others_wait_for():
    """Equal step times (the collectives make them so); ranks 0, 1, 3 wait 40 ms per step in collectives, rank 2
    4 ms: the others wait for rank 2. Its margin over the median is 36 ms of a 100 ms step."""
    ranks = [{"rank": i, "host": "n0", "local_rank": i, "step_s": 0.1, "data_wait_s": 0.0, "comm_wait_s": c}
             for i, c in enumerate([0.04, 0.04, 0.004, 0.04])]
    (named,) = stragglers.find_stragglers(ranks, 0.10)
    assert (named["rank"], named["cause"]) == (2, stragglers.WAIT_CAUSE)
    assert named["slower_pct"] == pytest.approx(36.0)
    assert stragglers.find_stragglers(ranks, 0.40) == []
    old = [{k: v for k, v in r.items() if k != "comm_wait_s"} for r in ranks]  # records of the previous version
    assert stragglers.find_stragglers(old, 0.10) == []


def test_a_rank_whose_loader_makes_the_others_wait_is_named_for_its_data_wait():
    """Rank 1 waits 1 s per step for its data; rank 0 waits as long in the collectives for rank 1. Both measures
    point at rank 1, by nearly equal margins (which one was larger depended on the sampler's luck: CI saw "the
    others wait for it"); the data wait is the cause, the others' wait its consequence."""
    ranks = [{"rank": 0, "host": "n0", "local_rank": 0, "step_s": 0.2, "data_wait_s": 0.0, "comm_wait_s": 1.08},
             {"rank": 1, "host": "n0", "local_rank": 1, "step_s": 0.2, "data_wait_s": 1.0, "comm_wait_s": 0.0}]
    (named,) = stragglers.find_stragglers(ranks, 0.15)
    assert (named["rank"], named["cause"]) == (1, "data wait")
    assert named["slower_pct"] == pytest.approx(100 * 0.54 / 0.7)  # the larger margin: 0.54 s less in collectives


class FakeNvml(types.SimpleNamespace):
    """The pynvml calls GpuHealth makes, returning set values (reasons: NVML's throttle bit mask)."""

    NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0

    def __init__(self, reasons: int, clock: int = 1980, fail_init: bool = False):
        super().__init__(reasons=reasons, clock=clock, fail_init=fail_init)

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("Driver Not Loaded")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("uuid", uuid)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("index", i)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self.reasons

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == self.NVML_CLOCK_SM
        return self.clock

    def nvmlDeviceGetPowerUsage(self, h):
        return 612_500   # mW

    def nvmlDeviceGetTemperature(self, h, kind):
        return 71


def test_gpu_health_from_a_fake_nvml_marks_throttling_and_summarises_per_node():
    hot = gpu_health.GpuHealth("cuda", 0, nvml=FakeNvml(gpu_health.HW_THERMAL, clock=1400)).sample()
    assert hot == {"sm_clock_mhz": 1400.0, "power_w": 612.5, "temp_c": 71.0, "throttle_thermal": 1.0,
                   "throttle_power": 0.0}
    capped = gpu_health.GpuHealth("cuda", 0, nvml=FakeNvml(gpu_health.SW_POWER_CAP)).sample()
    assert capped["throttle_power"] == 1.0 and capped["throttle_thermal"] == 0.0
    idle = gpu_health.GpuHealth("cuda", 0, nvml=FakeNvml(0x1)).sample()   # GPU idle: not a slowdown
    assert idle["throttle_power"] == idle["throttle_thermal"] == 0.0
    nodes = gpu_health.per_node([{"host": "a", **hot}, {"host": "a", **idle}, {"host": "b", **capped}])
    assert nodes["a"]["min_sm_clock_mhz"] == 1400.0 and nodes["a"]["throttle_thermal"] is True
    assert nodes["b"]["throttle_power"] is True and nodes["b"]["throttle_thermal"] is False


def test_gpu_health_not_measured_without_cuda_nvml_or_driver(monkeypatch):
    assert gpu_health.GpuHealth("cpu", None).status == "not measured (no CUDA device)"
    monkeypatch.setitem(sys.modules, "pynvml", None)   # import pynvml -> ImportError
    g = gpu_health.GpuHealth("cuda", 0)
    assert g.status.startswith("not measured (nvidia-ml-py not installed") and g.sample()["sm_clock_mhz"] is None
    broken = gpu_health.GpuHealth("cuda", 0, nvml=FakeNvml(0, fail_init=True))
    assert broken.status == "not measured (NVML: Driver Not Loaded)"


def test_rank_monitor_window_in_one_process_carries_fake_nvml_readings():
    health = gpu_health.GpuHealth("cuda", 0, nvml=FakeNvml(gpu_health.SW_THERMAL))
    mon = stragglers.RankMonitor(torch.device("cpu"), 0, 10.0, health)
    mon.add_step(1.0, 0.25)
    mon.add_step(2.0, 0.25)
    w = mon.window()
    (r,) = w["ranks"]
    assert r["step_s"] == pytest.approx(1.25) and r["data_wait_s"] == pytest.approx(0.25)
    assert r["throttle_thermal"] == 1.0 and w["throttled"] is True and w["stragglers"] == []
    assert w["gpu_nodes"][socket.gethostname()]["throttle_thermal"] is True
    # the rank's data fingerprint travels with the same gather, exactly (the observer sums them: data_crc32)
    assert mon.window(data_sum=2**32 - 1)["data_sums"] == [2**32 - 1] and w["data_sums"] == [0]


def test_the_comm_sampler_keeps_no_frame_of_the_training_thread_alive():
    """The sampler looks at the training thread's frames; a frame it still holds between looks keeps the locals of
    every caller alive (on a GPU: activations past their last use, a higher and run-dependent memory peak; it made
    the estimate differ from a tracked `train` step). Found inside torch.distributed, it must let go at once."""
    import weakref

    namespace: dict = {}
    fake_dist = "def wait():\n    import time\n    time.sleep(0.35)\n"  # a frame whose file is in torch.distributed
    exec(compile(fake_dist, "/site-packages/torch/distributed/fake.py", "exec"), namespace)

    class Activation:
        pass

    def step() -> weakref.ref:
        activation = Activation()
        namespace["wait"]()  # the sampler looks while this frame (holding `activation`) waits in a collective
        return weakref.ref(activation)

    sampler = stragglers.CommSampler(interval=0.1)
    try:
        ref = step()
        alive = ref() is not None  # at once: a look in the next 0.1 s would hide a frame held until then
        assert sampler.take() > 0, "the sampler saw no look inside torch.distributed"
        assert not alive, "the sampler still holds the frame of a step that returned"
    finally:
        sampler.close()
