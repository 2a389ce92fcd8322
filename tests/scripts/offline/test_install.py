"""scripts/offline/install.py on CPU: arguments, the wheel chosen for this torch, the compile path (against a
fake TE source distribution and CUDA toolkit) and its reuse, the errors that name a missing wheel, and that
nothing tries the network. The real pip installs the wheels every time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import install
import kit_fakes as fakes
import node_checks as nc
import pytest
import te_wheel
from kit_fakes import read_jsonl

INSTALL = Path(install.__file__)


def run_main(argv: list[str], capfd) -> tuple[int, str, str]:
    code = install.main([str(a) for a in argv])
    out = capfd.readouterr()
    return code, out.out, out.err


def run_script(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(INSTALL), *map(str, argv)], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.fixture
def guarded(tmp_path, monkeypatch):
    """Children of an in-process install run under the network guard; returns the attempts log."""
    env, log = fakes.net_guard(tmp_path)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return log


def test_the_network_guard_catches_a_connection(tmp_path):
    env, log = fakes.net_guard(tmp_path)
    code = "import urllib.request\ntry:\n    urllib.request.urlopen('http://192.0.2.1/', timeout=2)\nexcept OSError:\n    pass"
    subprocess.run([sys.executable, "-c", code], env=fakes.merge_env(env), check=True, timeout=60)
    assert "192.0.2.1" in log.read_text()  # so an empty log below means no attempt was made


@pytest.mark.slow
def test_prebuilt_wheel_for_this_torch_is_installed_and_imports(tmp_path, capfd, guarded):
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=fakes.torch_version(), build_log=tmp_path / "build.jsonl")
    target = tmp_path / "site"
    code, out, err = run_main([kit, target], capfd)
    assert code == 0, out + err
    assert (target / "transformer_engine" / "pytorch" / "__init__.py").is_file()  # TE and its extension share
    assert (target / "transformer_engine" / "wheel_lib" / "fake_ext.py").is_file()  # transformer_engine/
    assert (target / "torchao" / "__init__.py").is_file() and (target / "datasets_fake").is_dir()
    assert "no build record: kept only if it imports" in out and "TE: transformer_engine.pytorch imports" in out
    assert "TE kernels: no CUDA device: TE's kernels not run" in out  # on a GPU: one FP8 te.Linear step
    assert not (tmp_path / "build.jsonl").exists() and not (kit / te_wheel.BUILT_DIR).exists()  # no compile
    assert out.count("== versions") == 1
    assert "GPU                 no GPU" in out and "compute capability  no GPU" in out
    assert "Transformer Engine  9.9.0" in out and "torchao             0.0.1" in out
    assert not guarded.exists()


@pytest.mark.slow
def test_te_that_imports_but_whose_kernels_fail_is_not_usable(tmp_path, capfd, guarded, monkeypatch):
    """The kernel check (one te.Linear forward+backward on the GPU) fails as a core library without this GPU's
    code would: exit 3 with TE's error, and the versions block is still printed."""
    monkeypatch.setattr(nc, "KERNEL_CHECK", "raise RuntimeError('CUDA error: no kernel image is available')")
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=fakes.torch_version())
    code, out, err = run_main([kit, tmp_path / "site"], capfd)
    assert code == install.EXIT_NO_TE, out + err
    assert "TE imports but its kernels do not run on this GPU" in err and "no kernel image is available" in err
    assert out.count("== versions") == 1


@pytest.mark.gpu
def test_the_kernel_check_runs_an_fp8_te_linear_on_this_gpu():
    """On a GPU node with Transformer Engine: the install's kernel check passes and says what it ran."""
    import importlib.util

    import torch

    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("needs a CUDA GPU and Transformer Engine")
    proc = subprocess.run([sys.executable, "-c", nc.KERNEL_CHECK], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    assert ("under FP8 current scaling" if fp8 else "in BF16") in proc.stdout and "finite True" in proc.stdout


@pytest.mark.slow
def test_compiles_when_no_wheel_fits_then_reuses_the_compiled_wheel(tmp_path):
    """The kit's prebuilt wheel is for another torch: it does not import, so install compiles the sdist
    with TE's build variables and the node's headers, keeps the wheel with a build record (and exports a
    copy), and the next run installs that wheel without compiling. No run opens a network connection."""
    guard_env, net_log = fakes.net_guard(tmp_path)
    env = fakes.merge_env(guard_env, fakes.toolchain(tmp_path))
    build_log = tmp_path / "build.jsonl"
    kit = fakes.kit(tmp_path / "kit", prebuilt_for="2.11.0+cu130", build_log=build_log)
    first = run_script([kit, tmp_path / "site", "--export", tmp_path / "out" / "built", "--jobs", "3"], env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "TE does not import with this wheel" in first.stdout and "undefined symbol" in first.stdout
    [seen] = read_jsonl(build_log)
    assert seen["NVTE_FRAMEWORK"] == "pytorch" and seen["NVTE_PYTORCH_FORCE_BUILD"] == "TRUE"
    assert seen["MAX_JOBS"] == "3" and seen["PIP_NO_INDEX"] == "1"
    assert seen["CUDA_HOME"] == str((tmp_path / "cuda").resolve())
    includes = seen["CPLUS_INCLUDE_PATH"].split(":")
    assert includes[0] == str((tmp_path / "cuda" / "include").resolve())
    for pkg in ("cudnn", "nccl", "cu13"):
        assert str(tmp_path / "node_site" / "nvidia" / pkg / "include") in includes
    key = te_wheel.build_key(fakes.TE_VERSION, fakes.torch_version(), fakes.CP)
    [wheel] = (kit / te_wheel.BUILT_DIR / key).glob("*.whl")
    record = json.loads(te_wheel.record_path(wheel).read_text())
    assert (record["torch"], record["python"], record["te_version"]) == (fakes.torch_version(), fakes.CP, "9.9.0")
    assert record["sha256"] == te_wheel.sha256(wheel)
    assert sorted(p.name for p in (tmp_path / "out" / "built" / key).iterdir()) == sorted(
        [wheel.name, te_wheel.record_path(wheel).name])

    second = run_script([kit, tmp_path / "site"], env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"built/{key}/{wheel.name} (built for this torch (build record))" in second.stdout
    assert len(read_jsonl(build_log)) == 1  # not compiled again
    assert not net_log.exists(), net_log.read_text()


def test_missing_wheels_are_named(tmp_path, capfd):
    """transformer_engine is neither in the kit nor on this Python: named. torchao is not in the kit either,
    but this Python has it (as a node may): not an error."""
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=None, with_sdist=False, skip=("torchao", "transformer_engine"))
    code, _, err = run_main([kit, tmp_path / "site"], capfd)
    assert code == install.EXIT_BAD_KIT
    assert "no transformer_engine wheel (transformer_engine-VERSION-*.whl)" in err and "torchao" not in err
    assert "neither a transformer_engine_torch wheel" in err and "transformer_engine_torch-VERSION.tar.gz" in err
    assert not (tmp_path / "site").exists()


def test_missing_te_core_and_two_versions_of_one_wheel(tmp_path, capfd):
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=fakes.torch_version(), skip=("transformer_engine_cu13",))
    fakes.make_wheel(kit, "datasets_fake", "2.0", {"datasets_fake/__init__.py": ""})
    code, _, err = run_main([kit, tmp_path / "site"], capfd)
    assert code == install.EXIT_BAD_KIT
    assert "no transformer_engine_cuNN wheel" in err
    assert "2 wheels of datasets_fake (datasets_fake-1.0-py3-none-any.whl, datasets_fake-2.0-py3-none-any.whl)" in err


def test_wheels_dir_must_be_a_folder(tmp_path, capfd):
    code, _, err = run_main([tmp_path / "nowhere"], capfd)
    assert code == install.EXIT_BAD_KIT and f"WHEELS_DIR {tmp_path / 'nowhere'}: not a folder" in err


@pytest.mark.slow
def test_a_folder_install_did_not_make_is_left_alone(tmp_path, capfd, guarded):
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=fakes.torch_version())
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    code, _, err = run_main([kit, target], capfd)
    assert code == install.EXIT_BAD_KIT and "was not made by install.py" in err
    assert (target / "notes.txt").read_text() == "keep me" and len(list(target.iterdir())) == 1


@pytest.mark.slow
def test_no_build_stops_with_exit_3_when_te_does_not_import(tmp_path, capfd, guarded):
    kit = fakes.kit(tmp_path / "kit", prebuilt_for="2.11.0+cu130", build_log=tmp_path / "build.jsonl")
    code, out, err = run_main([kit, tmp_path / "site", "--no-build"], capfd)
    assert code == install.EXIT_NO_TE and "--no-build" in err
    assert "undefined symbol" in out and out.count("== versions") == 1  # the block is printed anyway
    assert not (tmp_path / "build.jsonl").exists()


@pytest.mark.slow
def test_a_missing_python_module_is_named_and_not_compiled_for(tmp_path, capfd, guarded, monkeypatch):
    """TE's import fails because a pure-Python module it imports is not on the node (TE 2.20 imports onnxscript at
    import time, and the kit does not carry it): compiling TE's extension cannot help, so install names the module
    and stops with exit 3 at once instead of spending the compile's minutes (a visit's whole command)."""
    env = fakes.toolchain(tmp_path)  # a compile would be possible (and would "succeed")
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"] + ":" + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("CUDA_HOME", env["CUDA_HOME"])
    monkeypatch.setattr(nc, "IMPORT_CHECK", "import torch\nimport onnxscript_not_on_this_node")
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=fakes.torch_version(), build_log=tmp_path / "build.jsonl")
    code, out, err = run_main([kit, tmp_path / "site"], capfd)
    assert code == install.EXIT_NO_TE, out + err
    assert "onnxscript_not_on_this_node" in err and "carry its wheel in the kit" in err
    assert not (tmp_path / "build.jsonl").exists() and "compiling" not in out  # no compile was started
    assert out.count("== versions") == 1


@pytest.mark.slow
def test_dry_run_prints_the_install_and_compile_commands_and_changes_nothing(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", fakes.toolchain(tmp_path)["PYTHONPATH"])
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=None)
    code, out, _ = run_main([kit, tmp_path / "site", "--dry-run", "--jobs", "5"], capfd)
    assert code == 0
    assert "pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target" in out
    assert "transformer_engine_torch" not in out.split("then compile with")[0].split("--target")[1]
    compile_part = out.split("then compile with")[1]
    for line in ("export NVTE_FRAMEWORK=pytorch", "export NVTE_PYTORCH_FORCE_BUILD=TRUE", "export MAX_JOBS=5",
                 "export PIP_NO_INDEX=1", f"export CUDA_HOME={(tmp_path / 'cuda').resolve()}"):
        assert line in compile_part
    assert "pip wheel --no-index --no-deps --no-build-isolation --no-cache-dir --wheel-dir" in compile_part
    assert str(kit / "transformer_engine_torch-9.9.0.tar.gz") in compile_part
    assert "nvidia/cudnn/include" in compile_part and "would fail" not in compile_part
    assert not (tmp_path / "site").exists()


def test_force_build_and_no_build_contradict(tmp_path, capfd):
    with pytest.raises(SystemExit) as e:
        install.main([str(tmp_path), "--no-build", "--force-build"])
    assert e.value.code == 2 and "contradict" in capfd.readouterr().err
    with pytest.raises(SystemExit) as e:
        install.main([str(tmp_path), "--jobs", "0"])
    assert e.value.code == 2 and "--jobs 0" in capfd.readouterr().err


@pytest.mark.slow
def test_force_build_compiles_even_when_a_wheel_fits(tmp_path, capfd, monkeypatch):
    env = fakes.toolchain(tmp_path)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.setenv("CUDA_HOME", env["CUDA_HOME"])
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=fakes.torch_version(), build_log=tmp_path / "build.jsonl")
    code, out, _ = run_main([kit, tmp_path / "site", "--force-build", "--dry-run"], capfd)
    assert code == 0 and "then compile with" in out


@pytest.mark.slow
def test_build_timeout_stops_the_compile(tmp_path, capfd, monkeypatch):
    env = fakes.toolchain(tmp_path)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.setenv("CUDA_HOME", env["CUDA_HOME"])
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=None, build_log=tmp_path / "build.jsonl")
    code, _, err = run_main([kit, tmp_path / "site", "--build-timeout", "0.2"], capfd)
    assert code == install.EXIT_NO_TE and "more than 0 s" in err and "--build-timeout" in err
    assert not (kit / te_wheel.BUILT_DIR).exists()


def test_the_cuda_toolkit_is_the_one_with_headers_not_a_wrapper_on_path(tmp_path):

    real = fakes.toolchain(tmp_path)["CUDA_HOME"]
    wrapper = tmp_path / "bin" / "nvcc"  # like /usr/local/bin/nvcc: `exec /usr/local/cuda-13.0/bin/nvcc "$@"`
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {real}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    assert te_wheel.find_cuda_home({"PATH": str(wrapper.parent), "CUDA_HOME": real}) == Path(real).resolve()
    found = te_wheel.find_cuda_home({"PATH": str(wrapper.parent)})
    assert found != tmp_path  # the wrapper's folder has no include/cuda_runtime.h: passed over


def test_compile_prerequisites_are_named(tmp_path, monkeypatch):

    monkeypatch.setattr(te_wheel, "BUILD_IMPORTS", ("import torch", "import no_such_build_module"))
    monkeypatch.setattr(te_wheel, "find_cuda_home", lambda env: None)
    plan = te_wheel.build_plan(sys.executable, tmp_path / "te.tar.gz", tmp_path, tmp_path, None, {})
    assert any("no CUDA toolkit" in p for p in plan.problems)
    assert [p for p in plan.problems if "import" in p] == [
        "the build cannot import no_such_build_module -> ModuleNotFoundError(\"No module named 'no_such_build_module'\")"
        " (add the missing wheel to the kit)"]
    assert any("no cuDNN headers" in p for p in plan.problems)
    assert int(plan.env["MAX_JOBS"]) == te_wheel.cpu_count() >= 1


# --- wheel selection, without installing -------------------------------------------------------------
def test_wheel_names_and_platforms():
    w = te_wheel.parse_wheel(Path("torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"))
    assert (w.name, w.version, w.py, w.abi) == ("torchao", "0.18.0", "cp310", "abi3")
    assert te_wheel.runs_on(w, "cp312", "x86_64") and not te_wheel.runs_on(w, "cp312", "aarch64")
    te = te_wheel.parse_wheel(Path("transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl"))
    assert te_wheel.runs_on(te, "cp312", "x86_64") and not te_wheel.runs_on(te, "cp311", "x86_64")
    assert te_wheel.parse_wheel(Path("multiprocess-0.70.19-py312-none-any.whl")).py == "py312"
    with pytest.raises(ValueError, match="not a wheel file name"):
        te_wheel.parse_wheel(Path("readme.whl"))
    assert te_wheel.build_key("2.20.2", "2.11.0+cu130", "cp312") == "te2.20.2-torch2.11.0_cu130-cp312"


def test_choice_prefers_a_recorded_build_and_passes_over_others_with_reasons(tmp_path):
    kit_dir = tmp_path / "kit"
    kit_dir.mkdir()
    fakes.te_torch_wheel(kit_dir, "x")  # unrecorded, top level
    for torch_version in ("2.11.0+cu130", "2.12.0+cu130"):
        sub = tmp_path / torch_version
        sub.mkdir()
        te_wheel.save_build(fakes.te_torch_wheel(sub, torch_version), kit_dir,
                           {"te_version": fakes.TE_VERSION, "torch": torch_version, "python": fakes.CP})
    kit = te_wheel.inventory(kit_dir)
    pick = te_wheel.choose_te_torch(kit, fakes.TE_VERSION, "2.12.0+cu130", fakes.CP, "x86_64")
    assert pick.recorded and "torch2.12.0_cu130" in str(pick.wheel.path)
    assert any("'2.11.0+cu130' != '2.12.0+cu130'" in n for n in pick.notes)
    pick = te_wheel.choose_te_torch(kit, fakes.TE_VERSION, "2.13.0", fakes.CP, "x86_64")
    assert not pick.recorded and pick.wheel.path.parent == kit_dir  # only the unrecorded one is left
    pick = te_wheel.choose_te_torch(kit, "1.0.0", "2.13.0", fakes.CP, "x86_64")
    assert pick.wheel is None and all("the kit's TE is 1.0.0" in n for n in pick.notes)
    # a record whose sha256 is not the wheel's (the wheel was replaced) does not count
    [built] = (kit_dir / te_wheel.BUILT_DIR).glob("*2.12.0*/*.whl")
    built.write_bytes(built.read_bytes() + b"\0")
    pick = te_wheel.choose_te_torch(te_wheel.inventory(kit_dir), fakes.TE_VERSION, "2.12.0+cu130", fakes.CP, "x86_64")
    assert not pick.recorded and any("sha256 differs" in n for n in pick.notes)


def test_a_wheel_without_a_build_record_is_unrecorded(tmp_path):
    wheel = fakes.te_torch_wheel(tmp_path, "y")
    assert te_wheel.read_record(wheel) is None  # an unknown hash without a record: unrecorded


# --- inside a command's time: every wait bounded, a second command reuses the install -------------------------
@pytest.mark.slow
def test_each_check_waits_at_most_check_s_or_what_is_left(tmp_path, monkeypatch):
    """A check that hangs (TE's import stuck on a driver, say) is cut at CHECK_S (~2 minutes) or, inside a
    command's budget, at what is left of it: never the 600 s of a whole command."""
    seen = []
    real_run = nc.run_bounded
    monkeypatch.setattr(nc, "run_bounded", lambda cmd, timeout, *a, **k: seen.append(timeout) or real_run(
        cmd, timeout, *a, **k))
    monkeypatch.setattr(nc, "CLOCK", nc.Clock(None))
    assert nc.check(tmp_path, "print('fine')", "a check") == (True, "fine")
    monkeypatch.setattr(nc, "CLOCK", nc.Clock(2.0))
    ok, message = nc.check(tmp_path, "import time; time.sleep(60)", "TE's import check")
    assert not ok and message.startswith("TE's import check: no answer in 2 s")
    assert seen[0] == nc.CHECK_S <= 120 and seen[1] <= 2.0
    monkeypatch.setattr(nc, "CLOCK", nc.Clock(0.5))
    with pytest.raises(install.InstallError, match=r"no time left for TE's kernel check \(--budget-seconds\)"):
        install.kernel_check(tmp_path)


def test_a_compile_may_take_half_the_budget_at_most(monkeypatch):
    monkeypatch.setattr(nc, "CLOCK", nc.Clock(None))
    assert install.compile_timeout(480) == 480
    monkeypatch.setattr(nc, "CLOCK", nc.Clock(300))
    assert 149 < install.compile_timeout(480) <= 150 and install.compile_timeout(60) == 60
    monkeypatch.setattr(nc, "CLOCK", nc.Clock(0.2))
    with pytest.raises(install.InstallError, match="no time left for a compile"):
        install.compile_timeout(480)


@pytest.mark.slow
def test_a_second_run_reuses_the_install_of_the_same_kit_and_installs_a_changed_one_afresh(tmp_path, capfd, guarded,
                                                                                           monkeypatch):
    import kit as kit_files

    monkeypatch.setattr(nc, "CHECK_S", 900.0)  # a busy test machine imports torch slowly: not the question here
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=fakes.torch_version())
    kit_files.write_manifest(kit, {"python": "3.x"})
    target = tmp_path / "site"
    code, out, err = run_main([kit, target, "--budget-seconds", "1800"], capfd)
    assert code == 0 and "installing" in out, out + err
    code, out, err = run_main([kit, target, "--budget-seconds", "1800"], capfd)
    assert code == 0, out + err
    assert "reused the install" in out and "installing" not in out and "TE: transformer_engine.pytorch imports" in out
    assert "TE kernels (when installed): no CUDA device" in out and out.count("== versions") == 1
    fakes.make_wheel(kit, "einops", "0.8.2", {"einops/__init__.py": ""})  # the kit changed: its manifest too
    kit_files.write_manifest(kit, {"python": "3.x"})
    code, out, err = run_main([kit, target], capfd)
    assert code == 0 and "reused" not in out and "installing" in out and (target / "einops").is_dir(), out + err
    (target / "transformer_engine" / "pytorch" / "__init__.py").write_text("raise ImportError('broken')\n")
    code, out, err = run_main([kit, target], capfd)  # same kit, but TE no longer imports there: installed again
    assert code == 0 and "TE does not import there now: installing again" in out, out + err


@pytest.mark.slow
def test_an_install_whose_te_was_not_usable_is_reused_without_te(tmp_path, capfd, guarded, monkeypatch):
    """A first command's TE did not import in time (a busy node): its wheels are reused by the second, which checks
    TE again and goes on without it (exit 3) when it still does not answer, instead of installing everything again."""
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=fakes.torch_version())
    target = tmp_path / "site"
    real_check = nc.IMPORT_CHECK
    monkeypatch.setattr(nc, "IMPORT_CHECK", "import time; time.sleep(30)")
    monkeypatch.setattr(nc, "CHECK_S", 2.0)
    code, out, err = run_main([kit, target], capfd)
    assert code == install.EXIT_NO_TE and "installing" in out, out + err
    code, out, err = run_main([kit, target], capfd)
    assert code == install.EXIT_NO_TE and "reused the install" in out and "installing" not in out, out + err
    assert "TE was not usable in that install (TE's import check: no answer in 2 s" in err
    monkeypatch.setattr(nc, "IMPORT_CHECK", real_check)  # TE answers now: the same install is used, with TE
    monkeypatch.setattr(nc, "CHECK_S", 900.0)
    code, out, err = run_main([kit, target], capfd)
    assert code == 0 and "reused the install" in out and "TE: transformer_engine.pytorch imports" in out, out + err


@pytest.mark.slow
def test_a_timeout_holds_against_a_grandchild_that_keeps_the_output_open(tmp_path, monkeypatch):
    """A check whose process started a helper that outlives it (an import that spawned one) ends at its limit: the
    whole process group is killed, not only the child (a plain subprocess.run waits for the helper's output)."""
    import time

    monkeypatch.setattr(nc, "CLOCK", nc.Clock(3.0))
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    t0 = time.monotonic()
    ok, message = nc.check(tmp_path, code, "TE's import check")
    assert not ok and "TE's import check: no answer in 3 s" in message and time.monotonic() - t0 < 20


@pytest.mark.slow
def test_an_import_that_does_not_answer_is_not_compiled_for(tmp_path, capfd, guarded, monkeypatch):
    monkeypatch.setattr(nc, "IMPORT_CHECK", "import time; time.sleep(30)")
    monkeypatch.setattr(nc, "CHECK_S", 2.0)
    kit = fakes.kit(tmp_path / "kit", prebuilt_for=fakes.torch_version(), build_log=tmp_path / "build.jsonl")
    code, out, err = run_main([kit, tmp_path / "site"], capfd)
    assert code == install.EXIT_NO_TE and "no answer in 2 s: TE is not used in this command (no compile tried)" in err
    assert not (tmp_path / "build.jsonl").exists() and out.count("installing") == 1


def test_the_nodes_torch_is_read_without_importing_it():
    import torch

    assert nc.torch_versions() == (torch.__version__, torch.version.cuda)
