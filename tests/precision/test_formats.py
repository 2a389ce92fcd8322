"""The block formats beside FP8: torchao MXFP8 (emulated off SM100) and NVFP4, TE NVFP4. Their refusals (GPU,
dimension rules, unsupported combinations) with their messages, `auto` by compute capability, the BF16 tail, the
eager warning, their statistics and NVFP4's buffers. Loss parity on 2 ranks: tests/report/test_arms.py."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from helpers import build_meta
from llama_fp8 import config, models, precision
from llama_fp8.errors import ConfigError
from llama_fp8.models.te.fp8 import recipes as te_recipes
from llama_fp8.parallel.loss import OutputHead
from llama_fp8.precision import exclude, fp8_stats, recipes, torchao_mx

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
HF, TE = models.get("hf"), models.get("te")


def cfg_for(*args: str) -> config.TrainConfig:
    return config.parse_args(["--model", "tiny", *args])


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of a chosen compute capability, as torch reports it (nothing runs on it here)."""
    def make(capability: tuple[int, int], name: str = "NVIDIA B200"):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        import torch.utils._triton as triton_probe

        monkeypatch.setattr(triton_probe, "has_triton", lambda: True)
        return CUDA
    return make


# --- the GPU requirement ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("capability, where", [(None, "this CPU"), ((9, 0), "compute capability 9.0")])
def test_torchao_nvfp4_is_refused_where_nothing_runs_it_naming_what_would(gpu, capability, where):
    device = CPU if capability is None else gpu(capability, "NVIDIA H100 80GB HBM3")
    with pytest.raises(ConfigError) as e:
        precision.resolve(cfg_for("--fp8", "1", "--fp8_recipe", "nvfp4"), HF, device)
    msg = str(e.value)
    assert "--fp8_recipe nvfp4 (torchao) needs an NVIDIA GPU of compute capability >= 10.0" in msg
    assert where in msg and "no emulation" in msg and "Blackwell" in msg
    assert "--fp8_recipe mxfp8" in msg and "--model_impl te" in msg  # what would run it here, and there


def test_torchao_mxfp8_is_emulated_on_cpu_and_hopper_and_native_on_blackwell(gpu, caplog):
    cfg = cfg_for("--fp8", "1", "--fp8_recipe", "mxfp8", "--compile", "1")
    cpu = precision.resolve(cfg, HF, CPU)
    assert (cpu.name, cpu.format, cpu.emulated) == ("fp8-torchao-mxfp8", "mxfp8", True)
    assert precision.resolve(cfg, HF, gpu((9, 0), "NVIDIA H100 80GB HBM3")).emulated is True
    assert "EMULATED on NVIDIA H100" in caplog.text
    assert precision.resolve(cfg, HF, gpu((10, 0))).emulated is False


def test_te_nvfp4_needs_blackwell_and_te_2_8():
    with pytest.raises(ValueError, match=r"nvfp4 needs compute capability >= 10\.0 \(Blackwell: B200, GB200; TE has "
                                         r"no emulation of it\); this GPU is SM 9\.0"):
        te_recipes.check_recipe_supported("nvfp4", (9, 0), "12.8", "2.20.2")
    with pytest.raises(ValueError, match=r"needs Transformer Engine >= 2\.8, found 2\.7\.0"):
        te_recipes.check_recipe_supported("nvfp4", (10, 0), "12.8", "2.7.0")
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        te_recipes.check_recipe_supported("nvfp4", None, None, "2.20.2")
    te_recipes.check_recipe_supported("nvfp4", (10, 0), "12.8", "2.8.0")
    te_recipes.check_recipe_supported("nvfp4", (11, 0), "12.8", "2.20.2")


@pytest.mark.parametrize("capability", [(12, 0), (12, 1)])
def test_te_nvfp4_is_refused_on_12x_naming_te_s_own_skip(capability):
    """TE's NVFP4 check passes on 12.x, but its FSDP2 tests skip NVFP4 there as crashing
    (tests/pytorch/distributed/fsdp2_tests/conftest.py _check_nvfp4_support, v2.15 ... main): every run here is
    FSDP2, so the recipe is refused before anything is built, the message naming that skip."""
    with pytest.raises(ValueError) as e:
        te_recipes.check_recipe_supported("nvfp4", capability, "13.0", "2.20.2")
    msg = str(e.value)
    assert "--fp8_recipe nvfp4 needs compute capability >= 10.0 and < 12.0" in msg
    assert "own FSDP2 tests skip NVFP4BlockScaling on SM 12.x" in msg and "_check_nvfp4_support" in msg
    assert "rht_gemm_ntt_w_sfc" in msg and f"this GPU is SM {capability[0]}.{capability[1]}" in msg
    assert recipes.where_it_runs(recipes.get("nvfp4", "te"), capability) == "refused"


def test_te_nvfp4_weights_all_gather_in_fp4_from_te_2_16():
    """TE 2.15 has NVFP4's FSDP2 hooks; its own FSDP2 test of FP4-initialized TransformerLayers passes (the xfail
    removed) and DCP loads NVFP4 weights from NVIDIA/TransformerEngine#2974, which is in the v2.16 tag."""
    with pytest.raises(ValueError, match=r"nvfp4 under FSDP2 need Transformer Engine >= 2\.16 .*found 2\.15\.2"):
        te_recipes.check_combination("nvfp4", compile=False, fp8_params=True, te_version="2.15.2")
    te_recipes.check_combination("nvfp4", compile=False, fp8_params=True, te_version="2.16.0")
    te_recipes.check_combination("nvfp4", compile=True, fp8_params=True, te_version="2.17.0")
    assert te_recipes.recipe_spec("nvfp4", 1024, "max") == ("NVFP4BlockScaling", {})


def test_te_mxfp8_runs_where_te_s_own_check_passes_10_0_to_below_12_0():
    """TE's _compute_mxfp8_support: refused from 12.0 ("not supported on 12.0+ architectures yet"), runs from 10.0
    (so on 11.0 too); auto picks MXFP8 on that whole range, as TE's get_default_fp8_recipe, current on 12.x."""
    for capability in ((10, 0), (10, 3), (11, 0)):
        te_recipes.check_recipe_supported("mxfp8", capability, "13.0", "2.20.2")
        assert recipes.default_for("te", capability=capability).name == "mxfp8"
    with pytest.raises(ValueError) as e:
        te_recipes.check_recipe_supported("mxfp8", (12, 0), "13.0", "2.20.2")
    assert "needs compute capability >= 10.0 and < 12.0 (Transformer Engine's own check, check_mxfp8_support" in \
        str(e.value) and "not supported on 12.0+ architectures yet" in str(e.value)
    assert recipes.default_for("te", capability=(12, 0)).name == "current"
    assert recipes.gpu_text(recipes.get("mxfp8", "te")) == ">= 10.0, < 12.0"


def test_te_mxfp8_on_hopper_names_torchao_s_emulated_route():
    """TE has no MXFP8 below 10.0; torchao's MXFP8 emulates it (its numerics, no speed-up): the refusal says so,
    with the flags that run it. NVFP4 has no emulated route (torchao's runs Triton kernels only): none named."""
    with pytest.raises(ValueError) as e:
        te_recipes.check_recipe_supported("mxfp8", (9, 0), "12.8", "2.20.2")
    msg = str(e.value)
    assert "TE has no emulation of it); this GPU is SM 9.0" in msg
    assert "for MXFP8's numerics on this GPU, emulated (its loss, no speed-up): --model_impl hf --fp8_backend " \
           "torchao --fp8_recipe mxfp8" in msg
    with pytest.raises(ValueError) as e:
        te_recipes.check_recipe_supported("nvfp4", (9, 0), "12.8", "2.20.2")
    assert "--fp8_backend torchao" not in str(e.value)


# --- unsupported combinations -------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--fp8_recipe", "mxfp8", "--fp8_all_gather", "1"], "--fp8_all_gather 1 works with the tensorwise recipe only "
                                                         "(torchao's FSDP2 hooks for its block formats all-gather the "
                                                         "high-precision weight); got --fp8_recipe mxfp8"),
    (["--fp8_recipe", "mxfp8", "--tp_size", "2"], "--fp8_recipe mxfp8 with --tp_size 2"),
    (["--fp8_recipe", "nvfp4", "--bf16", "0"], "--fp8_recipe nvfp4 (torchao) quantizes from BF16 inputs only; use "
                                               "--bf16 1"),
    (["--fp8_backend", "torchao", "--fp8_recipe", "block"], "--fp8_recipe block is a recipe of --fp8_backend te"),
])
def test_unsupported_combinations_are_refused_from_the_flags_alone(args, message):
    with pytest.raises(ConfigError) as e:
        precision.check_flags(cfg_for("--fp8", "1", *args), HF, models.implementations())
    assert message in str(e.value)


# --- dimension rules ------------------------------------------------------------------------------------------
def test_a_shape_that_does_not_divide_is_refused_naming_the_layer_and_the_rule():
    cfg = cfg_for("--fp8", "1", "--fp8_recipe", "mxfp8", "--intermediate_size", "80")
    with pytest.raises(ConfigError) as e:
        precision.resolve(cfg, HF, CPU)
    msg = str(e.value)
    assert "model.layers.0.mlp.gate_proj (and 3 more blocks) is 128 -> 80: in and out features must be multiples of " \
           "32" in msg
    assert "model.layers.0.mlp.down_proj (and 3 more blocks) is 80 -> 128" in msg
    assert "MXTensor.to_mx: 32-element blocks" in msg and "--fp8_exclude" in msg
    assert "q_proj" not in msg  # 128 -> 128 divides
    # the same layers kept in BF16: nothing left to refuse
    kept = cfg_for("--fp8", "1", "--fp8_recipe", "mxfp8", "--intermediate_size", "80", "--fp8_exclude",
                   "model.layers.*.mlp.*")
    assert precision.resolve(kept, HF, CPU).recipe == "mxfp8"


def test_the_tokens_of_a_micro_batch_must_fill_whole_blocks():
    cfg = cfg_for("--fp8", "1", "--fp8_recipe", "mxfp8", "--train_batch_size", "1", "--max_context_width", "40")
    with pytest.raises(ConfigError, match=r"--train_batch_size 1 x 40 tokens = 40 tokens per micro-batch: must be a "
                                          r"multiple of 32"):
        precision.check_flags(cfg, HF, models.implementations())


def test_torchao_nvfp4_rules_on_blackwell_name_every_layer_that_breaks_them(gpu):
    """tiny's k/v projections (128 -> 64) and MLP (352) break NVFP4's 128-multiples; its q/o (128) do not."""
    with pytest.raises(ConfigError) as e:
        precision.resolve(cfg_for("--fp8", "1", "--fp8_recipe", "nvfp4"), HF, gpu((10, 0)))
    msg = str(e.value)
    assert "self_attn.k_proj (and 3 more blocks) is 128 -> 64" in msg and "mlp.up_proj" in msg
    assert "multiples of 128" in msg and "o_proj" not in msg


def test_te_rules_are_checked_on_te_s_own_fused_layers():
    """The TE model multiplies by a fused QKV and a fused gate/up: the rule holds on those shapes."""
    assert TE.gemm_shapes(cfg_for())[0] == ("te_layer.self_attention.layernorm_qkv", 128, 128 + 2 * 64)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.te_layer\.layernorm_mlp\.fc2 \(and 3 more blocks\) is 88 "
                                          r"-> 128: in and out features must be multiples of 16"):
        precision.check_flags(cfg_for("--model_impl", "te", "--fp8", "1", "--fp8_recipe", "nvfp4",
                                      "--intermediate_size", "88"), TE, models.implementations())
    precision.check_flags(cfg_for("--model_impl", "te", "--fp8", "1", "--fp8_recipe", "nvfp4"), TE,
                          models.implementations())


# --- auto by the GPU -------------------------------------------------------------------------------------------
def test_auto_picks_mxfp8_on_blackwell_for_te_and_the_current_default_elsewhere():
    cfg = cfg_for("--model_impl", "te", "--fp8", "1")
    on = {cap: precision.choose(cfg, TE, (), cap) for cap in ((10, 0), (9, 0), (12, 0), None)}
    assert {cap: r.name for cap, (_, r, _) in on.items()} == {(10, 0): "mxfp8", (9, 0): "current",
                                                             (12, 0): "current", None: "current"}
    assert "compute capability 10.0 runs mxfp8 natively" in on[(10, 0)][2]
    assert "te's default (compute capability 9.0)" in on[(9, 0)][2]
    # torchao keeps tensorwise on Blackwell too (its MXFP8 has no FP8 all-gather and is a prototype)
    assert precision.choose(cfg_for("--fp8", "1"), HF, (), (10, 0))[1].name == "tensorwise"


def test_the_choice_and_its_reason_are_recorded_and_printed_once(tmp_path, caplog):
    from llama_fp8 import plan

    choice = precision.resolve(cfg_for("--fp8", "1", "--fp8_exclude", "last:25%"), HF, CPU)
    assert choice.reason == "backend torchao: the first of --model_impl hf; recipe tensorwise: auto: torchao's " \
                            "default (no GPU seen)"
    assert choice.bf16_tail == "decoder blocks 3 (1 of 4) and the output layer in BF16"
    caplog.set_level(logging.INFO)
    plan.announce(choice)
    assert caplog.text.count("precision fp8-torchao-tensorwise: backend torchao") == 1
    assert "decoder blocks 3 (1 of 4)" in caplog.text


# --- the eager warning ----------------------------------------------------------------------------------------
def test_a_torchao_arm_running_eager_on_a_gpu_is_warned_with_the_measured_reason(gpu):
    hopper = gpu((9, 0), "NVIDIA H100 80GB HBM3")
    eager = precision.resolve(cfg_for("--fp8", "1"), HF, hopper)
    (note,) = eager.notes
    assert "runs eager (--compile 0)" in note and "0.184 s" in note and "0.130 s" in note
    assert "pytorch/ao#2262" in note and "--compile 1" in note
    assert precision.resolve(cfg_for("--fp8", "1", "--compile", "1"), HF, hopper).notes == ()
    assert precision.resolve(cfg_for("--fp8", "1"), HF, CPU).notes == ()  # emulated: speed is not the question


# --- the BF16 tail ---------------------------------------------------------------------------------------------
def test_the_bf16_tail_keeps_the_last_blocks_as_published_recipes_do():
    assert exclude.tail_layers("last:15%", 32) == (27, 28, 29, 30, 31)  # torchtitan's NVFP4 Llama 3 8B: 27-31
    assert exclude.tail_layers("last:4", 32) == (28, 29, 30, 31)
    assert exclude.parse("last:2,model.layers.0.*", 4) == ("model.layers.2.*", "model.layers.3.*", "model.layers.0.*")
    for bad, why in (("last:0%", "> 0 and <= 100"), ("last:101%", "> 0 and <= 100"), ("last:9", "from 1 to 4"),
                     ("last:x", "a BF16 tail is last:P%")):
        with pytest.raises(ConfigError, match=why):
            exclude.parse(bad, 4)
    with pytest.raises(ConfigError, match="a BF16 tail is last:P%"):  # refused by the plan, before building
        precision.resolve(cfg_for("--fp8", "1", "--fp8_exclude", "last:some"), HF, CPU)


def test_the_tail_stays_in_bf16_on_the_converted_model():
    cfg = cfg_for("--fp8", "1", "--fp8_recipe", "mxfp8", "--fp8_exclude", "last:50%")
    choice = precision.resolve(cfg, HF, CPU)
    runtime = precision.build(choice, HF, cfg)
    model = runtime.convert(build_meta(cfg))
    kinds = {i: {type(m).__name__ for m in model.model.layers[i].modules() if isinstance(m, nn.Linear)} for i in range(4)}
    assert kinds == {0: {"MXFP8Linear"}, 1: {"MXFP8Linear"}, 2: {"Linear"}, 3: {"Linear"}}
    layers = {x.name: x for x in runtime.layers(model)}
    assert layers["model.layers.3.mlp.up_proj"].reason == "user exception (--fp8_exclude model.layers.3.*)"


# --- statistics of the block formats ----------------------------------------------------------------------------
def test_block_statistics_count_underflow_and_each_block_scale():
    """MXFP8: a block holding 1 and 1e-6 flushes the small values (E4M3's range under the block's E8M0 scale is
    ~2^17), a block of only 1e-6 keeps them (its own scale). NVFP4: a block 1e-9 of the tensor's amax would need an
    E4M3 scale (under the per-tensor scale) below the smallest torchao stores: its scale underflows, the block flushes."""
    x = torch.cat([torch.tensor([1.0] + [1e-6] * 31), torch.full((32,), 1e-6)]).reshape(1, 64)
    mx = fp8_stats.block_stats(x, "mxfp8")
    assert mx["underflow"] == pytest.approx(31 / 64) and mx["scale_underflow"] == 0.0 and mx["saturation"] == 0.0
    y = torch.cat([torch.linspace(0.5, 6.0, 16), torch.full((16,), 6e-9)]).reshape(1, 32)
    nv = fp8_stats.block_stats(y, "nvfp4")
    assert nv["scale_underflow"] == pytest.approx(0.5) and nv["underflow"] == pytest.approx(16 / 32)
    assert nv["saturation"] is None and nv["snr_db"] > 10


# --- torchao NVFP4's buffers (its forward needs SM100: tests/precision/test_formats_gpu.py) ------------------------
def nvfp4_model(seed: int) -> nn.Module:
    cfg = cfg_for("--hidden_width", "256", "--num_heads", "2", "--num_key_value_heads", "1", "--intermediate_size",
                  "512", "--num_layers", "2", "--seed", str(seed))
    model = build_meta(cfg)
    assert torchao_mx.convert(model, "nvfp4", False, lambda m, name: not name.endswith("lm_head")) == 14
    model.to_empty(device="cpu")
    torchao_mx.prepare(model, seed)
    return model


def test_nvfp4_layers_draw_their_hadamard_signs_and_rounding_seeds_from_the_seed():
    a, b, c = nvfp4_model(7), nvfp4_model(7), nvfp4_model(8)
    layer = "model.layers.0.mlp.up_proj"
    sa, sb = (dict(m.named_buffers()) for m in (a, b))
    assert torch.equal(sa[f"{layer}._rht_sign_vector"], sb[f"{layer}._rht_sign_vector"])  # every rank: the same
    signs = sa[f"{layer}._rht_sign_vector"]
    assert set(signs.tolist()) <= {-1, 1} and signs.numel() == 16 and len(set(signs.tolist())) == 2
    assert a.get_submodule(layer).rht_sign_vector == tuple(signs.tolist())  # torchao's own cached copy follows
    other = dict(c.named_buffers())[f"{layer}._rht_sign_vector"]
    assert not torch.equal(signs, other) or not torch.equal(sa[f"{layer}._sr_seed"],
                                                            dict(c.named_buffers())[f"{layer}._sr_seed"])
    assert not torch.equal(sa[f"{layer}._sr_seed"], sa["model.layers.0.mlp.down_proj._sr_seed"])  # per layer
    assert type(a.get_submodule(layer)).__name__ == "NVFP4Linear" and type(a.lm_head) is OutputHead


def test_the_tables_docs_show_list_every_format_where_it_runs():
    table = recipes.formats_table_markdown()
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:6]] for line in table.splitlines()[2:]}
    ok = "supported by the library (not run here)"  # nothing has run on a GPU: never "runs"
    assert rows["`torchao` `mxfp8`"] == ["emulated", "emulated", ok]
    assert rows["`torchao` `nvfp4`"] == ["refused", "refused", ok]
    assert rows["`te` `nvfp4`"] == ["refused", "refused", ok]
    assert rows["`te` `current`"] == ["refused", ok, ok]
    assert " runs |" not in recipes.formats_table_markdown()


def test_the_estimate_keeps_a_job_s_format_where_its_stand_in_emulates_it():
    """A TE job estimated on a machine without TE runs the HF stand-in: an MXFP8 job through torchao's emulated
    MXFP8 (the format's layers, not FP8's), an NVFP4 job (no CPU path) through the stand-in's default, said so."""
    from llama_fp8.estimate import build

    mx = build.stand_in_recipe(cfg_for("--model_impl", "te", "--fp8", "1", "--fp8_recipe", "mxfp8"), HF)
    assert mx[0] == "mxfp8" and "estimated through torchao's emulated mxfp8" in mx[1]
    nv = build.stand_in_recipe(cfg_for("--model_impl", "te", "--fp8", "1", "--fp8_recipe", "nvfp4"), HF)
    assert nv == ("auto", "--fp8_recipe nvfp4 has no CPU path on the stand-in: its layers estimated as tensorwise "
                          "(torchao) ones")
    assert build.stand_in_recipe(cfg_for("--model_impl", "te", "--fp8", "1"), HF) == ("auto", None)
