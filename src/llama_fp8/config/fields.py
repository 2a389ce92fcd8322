"""The fields of a run's configuration: ``TrainConfig``, one typed frozen dataclass whose field metadata
carries each flag's help, valid choices or range, and group. Every field is a flag ``--<field>``
(booleans take 0/1) and a key of a preset or ``--config`` YAML; add a setting here and the parser, the YAML
loader and docs/flags.md's flag table pick it up.

Flag names follow the AWS FSDP sample (``--train_batch_size``, ``--max_context_width``, ...) so that
existing sbatch argument lines keep working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llama_fp8.precision import recipes

Text = str | Callable[[], str]
Choices = tuple | Callable[[], tuple] | None


def _f(default: Any, help: Text, *, choices: Choices = None, min: float | None = None,
       max: float | None = None, group: str = "training", aliases: dict[str, str] | None = None) -> Any:
    """A dataclass field whose metadata carries its one-line help and its valid range. ``help`` and
    ``choices`` may be functions: those read a table that lives elsewhere (model implementations, FP8
    recipes), so that the table stays the one place that lists them. ``aliases``: older spellings still
    accepted, each read as the choice it names (the config records that name)."""
    return field(default=default, metadata={"help": help, "choices": choices, "min": min, "max": max,
                                            "group": group, "aliases": aliases or {}})


def _impl_choices() -> tuple:
    from llama_fp8 import models

    return ("auto", *models.names())


def _impl_help() -> str:
    from llama_fp8 import models

    return models.help_text()


def _backend_help() -> str:
    from llama_fp8 import models

    return recipes.backend_help({i.name: i.fp8_backends()[0].name for i in models.implementations()
                                 if i.fp8_backends()})


@dataclass(frozen=True)
class TrainConfig:
    """Every setting the user asked for (defaults < preset < YAML < flags), frozen once parsed: what
    will actually run is decided from it once, in ``plan.make_plan``. The metadata ``help`` of each
    field is its docstring."""

    # --- config sources -------------------------------------------------------------------------
    config: str | None = _f(None, "YAML file with any of these fields (overrides the preset, overridden by flags)",
                            group="config")
    model: str = _f("tiny", "model preset: a name from configs/ (tiny, llama2-7b, llama3.1-8b, ...)",
                    group="model")
    # --- model shape (default: from the preset) ---------------------------------------------------
    model_type: str | None = _f(None, "Llama family: llama_v2 (rope_theta 10000) or llama_v3 (rope_theta 500000)",
                                choices=("llama_v2", "llama_v3"), group="model")
    model_impl: str = _f("auto", _impl_help, choices=_impl_choices, group="model")
    vocab_size: int | None = _f(None, "vocabulary size (default: preset)", min=1, group="model")
    hidden_width: int | None = _f(None, "hidden size (default: preset)", min=1, group="model")
    num_layers: int | None = _f(None, "number of decoder layers (default: preset)", min=1, group="model")
    num_heads: int | None = _f(None, "attention heads (default: preset)", min=1, group="model")
    num_key_value_heads: int | None = _f(None, "key/value heads for GQA (default: preset)", min=1, group="model")
    intermediate_size: int | None = _f(None, "MLP intermediate size (default: preset)", min=1, group="model")
    max_context_width: int | None = _f(None, "training sequence length in tokens (default: preset)", min=2,
                                       group="model")
    initializer_range: float | None = _f(None, "std of the normal weight init (default: preset)", min=0.0,
                                         group="model")
    rope_theta: float | None = _f(None, "RoPE base (default: preset; set by --model_type when given)", min=1.0,
                                  group="model")
    # The next three are preset-only knobs (flags work too, but are rarely needed).
    rms_norm_eps: float | None = _f(None, "RMSNorm epsilon (default: preset)", min=0.0, group="model")
    tie_word_embeddings: bool | None = _f(None, "share embedding and output weights (default: preset)",
                                          group="model")
    rope_scaling: dict | None = _f(None, "Llama 3.1 RoPE scaling (YAML mapping; default: preset)", group="model")
    max_position_embeddings: int | None = _f(None, "longest position the RoPE tables cover (default: preset)",
                                             min=1, group="model")
    # --- precision ---------------------------------------------------------------------------------
    bf16: bool = _f(True, "1: BF16 compute with FP32 master weights and FP32 gradient reduction; 0: FP32",
                    group="precision")
    fp8: bool = _f(False, "1: FP8 linear layers (backend from --fp8_backend); 0: off", group="precision")
    fp8_backend: str = _f("auto", _backend_help, choices=("auto", *recipes.backends()), group="precision")
    fp8_recipe: str = _f("auto", recipes.recipe_help, choices=("auto", *recipes.names()),
                         group="precision")
    fp8_all_gather: bool = _f(False, "1: all-gather FSDP parameters in FP8 (torchao tensorwise; TE: FP8 "
                              "parameters) - half the all-gather bytes of BF16", group="precision")
    fp8_exclude: str | None = _f(None, "comma-separated globs on module names kept in high precision with --fp8 1 "
                                 "(e.g. model.layers.0.*,model.layers.31.*; a glob matching no layer is an error), "
                                 "or a BF16 tail: last:15% (the last 15 % of decoder blocks, and the output layer) or last:4",
                                 group="precision")
    fp8_verify: str = _f("error", "after the warm-up step, check FP8 is really on (layers, FLOP share, all-gather "
                         "dtypes, GEMM kernels): error stops the run naming what is off, warn logs it",
                         choices=("error", "warn"), group="precision")
    fp8_stats: int = _f(0, "every N steps, per-layer FP8 numerics (amax, scale, underflow, saturation, SNR) of each "
                        "FP8 linear's input, weight and output gradient to <run_dir>/fp8_stats.jsonl (0 = off)",
                        min=0, group="precision")
    fp8_amax_history_len: int = _f(1024, "TE delayed scaling: amax history length", min=1, group="precision")
    fp8_amax_compute_algo: str = _f("max", "TE delayed scaling: amax from the history's max or most_recent",
                                    choices=("max", "most_recent"), group="precision")
    # --- optimisation ------------------------------------------------------------------------------
    train_batch_size: int = _f(2, "micro-batch size per device (sequences)", min=1)
    val_batch_size: int = _f(2, "validation batch size per device (sequences)", min=1)
    max_steps: int = _f(20, "optimizer steps to train", min=1)
    seed: int = _f(42, "seed for init, data order and dropout; identical across an A/B pair", min=0)
    lr: float = _f(1e-4, "peak learning rate", min=0.0)
    min_lr: float = _f(1e-5, "learning rate at the end of the decay", min=0.0)
    warmup: float = _f(0.01, "fraction of --lr_decay_iters spent in linear warmup (0.01 = 1 %)", min=0.0, max=1.0)
    lr_decay_style: str = _f("cosine", "decay after warmup", choices=("cosine", "linear", "constant"))
    lr_decay_iters: int | None = _f(None, "steps over which the LR decays (default: --max_steps)", min=1)
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to norms, biases, embeddings)", min=0.0)
    beta1: float = _f(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = _f(0.95, "AdamW beta2", min=0.0, max=1.0)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this value (0 = no clipping)", min=0.0)
    grad_accum_steps: int = _f(1, "micro-batches per optimizer step (gradients are reduced on the last one only)",
                               min=1)
    optimizer: str = _f("adamw", "adamw (FP32 states), adamw8bit or adamw_fp8 (torchao.optim low-precision "
                        "states; adamw_fp8 needs CUDA)", choices=("adamw", "adamw8bit", "adamw_fp8"))
    # --- data ----------------------------------------------------------------------------------------
    dataset: str = _f("synthetic", "synthetic, a hub dataset name, a local file/folder (.jsonl .json .parquet .txt "
                      "arrow), or a tokenized corpus (a folder made by llama_fp8 tokenize, or Megatron .bin/.idx)",
                      group="data")
    data_blend: str | None = _f(None, "mix tokenized corpora by weight instead of --dataset: W1:PATH1,W2:PATH2 "
                                "(e.g. 0.7:/fsx/web,0.3:/fsx/code); deterministic, resumed exactly", group="data")
    skip_samples: str | None = _f(None, "A:B[,C:D]: leave out global samples A to B-1 of a tokenized corpus's order "
                                  "(e.g. the batches before a loss spike); kept in the checkpoint", group="data")
    doc_masking: bool = _f(False, "1: packed documents do not attend to each other and their positions restart "
                           "(HF model: block mask, TE model: THD cu_seqlens); labels never cross a document",
                           group="data")
    dataset_config_name: str | None = _f(None, "hub dataset config (e.g. en for allenai/c4)", group="data")
    text_field: str = _f("text", "name of the text column", group="data")
    data_files: str | None = _f(None, "comma-separated files or globs inside --dataset", group="data")
    val_data_files: str | None = _f(None, "comma-separated validation files or globs", group="data")
    val_fraction: float = _f(0.0, "fraction of local documents held out for validation when no "
                             "--val_data_files", min=0.0, max=0.5, group="data")
    tokenizer: str | None = _f(None, "hub name or local folder for AutoTokenizer (not needed for synthetic)",
                               group="data")
    streaming: bool = _f(True, "stream hub datasets instead of downloading them whole", group="data")
    num_workers: int = _f(1, "DataLoader worker processes per rank (tokenized corpora: threads reading ahead)", min=0,
                          group="data")
    validation_freq: int = _f(0, "validate every N steps (0 = never)", min=0, group="data")
    validation_batches: int = _f(4, "batches per rank in each validation", min=1, group="data")
    # --- parallelism ---------------------------------------------------------------------------------
    sharding_strategy: str = _f("full", "full: shard over all ranks; hybrid: replicate across nodes, shard "
                                "within a node (HSDP)", choices=("full", "hybrid"), group="parallel")
    dp_replicate_size: int = _f(1, "HSDP replicas (1 = plain FSDP; -1 = the rest of the world)", min=-1,
                                group="parallel")
    dp_shard_size: int = _f(-1, "ranks each replica shards over (-1 = the rest of the world)", min=-1,
                            group="parallel")
    tp_size: int = _f(1, "tensor-parallel ranks (keep within a node): each decoder block's linears split across them, "
                      "with sequence parallelism (Hugging Face model; torchao FP8 tensorwise)", min=1, group="parallel")
    cp_size: int = _f(1, "context-parallel ranks: each sequence split across them in load-balanced chunks (long "
                      "contexts; needs CUDA)", min=1, group="parallel")
    cp_comm_type: str = _f("p2p", "how context-parallel ranks exchange keys and values: p2p (ring), all_gather, a2a "
                           "(Ulysses: heads across ranks; TE model), a2a+p2p (a2a within pairs, p2p between; TE model)",
                           choices=("p2p", "all_gather", "a2a", "a2a+p2p"), group="parallel")
    activation_checkpointing: str = _f("none", "recompute activations in backward: none, full (every decoder "
                                       "block), or selective (HF model: keep attention's and the q, k, v, o, gate "
                                       "matmuls' outputs, recompute the rest); 0 and 1 are read as none and full",
                                       choices=("none", "full", "selective"),
                                       group="parallel", aliases={"0": "none", "1": "full"})
    compile: bool = _f(False, "1: torch.compile each decoder block (after activation checkpointing, before "
                       "fully_shard)", group="parallel")
    cpu_offload: bool = _f(False, "1: keep sharded parameters, gradients and optimizer states in host memory "
                           "(FSDP2 CPUOffloadPolicy; needs CUDA)", group="parallel")
    device: str = _f("auto", "auto (cuda if available), cuda, or cpu", choices=("auto", "cuda", "cpu"),
                     group="parallel")
    # --- checkpoints and faults -------------------------------------------------------------------
    checkpoint_dir: str | None = _f(None, "where step_N checkpoints go (default: <run_dir>/checkpoints; use a shared "
                                    "file system on a cluster), or an s3://bucket/prefix (the Amazon S3 Connector for "
                                    "PyTorch: pip install 'llama-fp8[s3]')", group="checkpoint")
    checkpoint_copy_dir: str | None = _f(None, "s3://bucket/prefix: copy checkpoints of the file-system "
                                         "--checkpoint_dir there in the background (the fast tier and the durable "
                                         "one); resume takes the newest complete checkpoint of either",
                                         group="checkpoint")
    checkpoint_copy_every: int = _f(1, "with --checkpoint_copy_dir: copy every M-th checkpoint saved (1: each one)",
                                    min=1, group="checkpoint")
    s3_region: str | None = _f(None, "region of the s3:// bucket (default: AWS_REGION or AWS_DEFAULT_REGION)",
                               group="checkpoint")
    s3_endpoint: str | None = _f(None, "http(s)://host:port of an S3-compatible store, addressed path-style (default: "
                                 "AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS's endpoint of the region)",
                                 group="checkpoint")
    s3_threads: int = _f(4, "upload threads per rank for an s3:// save (DCP's thread_count: each writes its own "
                         "objects)", min=1, max=64, group="checkpoint")
    s3_prefix_strategy: str = _f("auto", "how shard keys are spread under a checkpoint's prefix against S3's 503 Slow "
                                 "Down: default (one prefix), binary, hex, or auto (hex from 16 ranks on)",
                                 choices=("auto", "default", "binary", "hex"), group="checkpoint")
    checkpoint_freq: int = _f(0, "save a checkpoint every N steps and at the end (0 = only on SIGUSR1/SIGTERM)",
                              min=0, group="checkpoint")
    keep_last_k: int = _f(2, "complete checkpoints to keep (0 = all)", min=0, group="checkpoint")
    async_checkpoint: bool = _f(False, "1: write checkpoints in the background (DCP async_save) while training "
                                "goes on", group="checkpoint")
    resume_from_checkpoint: str = _f("auto", "auto (latest complete checkpoint in --checkpoint_dir, if any), "
                                     "none, or a step_N folder", group="checkpoint")
    init_from_hf: str | None = _f(None, "start from a Hugging Face checkpoint folder (safetensors); each rank "
                                  "reads only its shard", group="checkpoint")
    nan_policy: str = _f("error", "non-finite loss or grad norm: error (stop, naming the step) or skip (skip the "
                         "update; costs a host sync per step)", choices=("error", "skip"), group="checkpoint")
    max_nan_skips: int = _f(10, "with --nan_policy skip: stop after this many skipped steps", min=0,
                            group="checkpoint")
    process_group_timeout: float = _f(600.0, "seconds a collective of the training may wait before the job fails, in "
                                      "every process group (the backstop behind the launcher's hang detection)",
                                      min=1.0, group="checkpoint")
    checkpoint_timeout: float = _f(1800.0, "seconds a collective of a checkpoint save or load may wait (a rank still "
                                   "writing its shards: saves take longer than steps)", min=1.0, group="checkpoint")
    # --- logging -------------------------------------------------------------------------------------
    logging_freq: int = _f(1, "print the Batch/Loss/Speed line and write metrics every N steps", min=1,
                           group="logging")
    straggler_threshold_pct: float = _f(10.0, "name a rank in a logging window when it is more than this many "
                                        "percent slower than the median rank (metrics.jsonl 'stragglers')",
                                        min=0.0, group="logging")
    peak_tflops: float | None = _f(None, "dense BF16 peak TFLOPS per device for MFU (FP8 peak taken as 2x); "
                                   "default: the built-in table for known GPUs, none on CPU", min=0.0,
                                   group="logging")
    tensorboard_dir: str | None = _f(None, "also write scalars for TensorBoard here (needs tensorboard)",
                                     group="logging")
    wandb_project: str | None = _f(None, "also log to this Weights & Biases project (needs wandb)", group="logging")
    wandb_mode: str = _f("offline", "wandb mode: offline (no network; `wandb sync` later) or online",
                         choices=("offline", "online"), group="logging")
    prometheus_textfile_dir: str | None = _f(None, "node_exporter's textfile collector folder: every rank writes its "
                                             "llama_fp8_* gauges there (atomically), removed at the end (needs "
                                             "prometheus_client)", group="logging")
    otlp_endpoint: str | None = _f(None, "also push the llama_fp8_* gauges to this OTLP/HTTP receiver, e.g. "
                                   "http://localhost:4318 (needs opentelemetry-sdk)", group="logging")
    mlflow_tracking_uri: str | None = _f(None, "also log the run to MLflow: a server URL, a database, a file store or a "
                                         "SageMaker MLflow ARN (needs mlflow)", group="logging")
    mlflow_experiment: str = _f("llama-fp8", "MLflow experiment of the run (with --mlflow_tracking_uri)",
                                group="logging")
    mlflow_run_name: str | None = _f(None, "MLflow run name (default: the run dir's name)", group="logging")
    run_dir: str | None = _f(None, "where config.yaml and metrics.jsonl go (default: runs/job_<SLURM_JOB_ID> in a Slurm "
                             "job, else runs/<YYYYmmdd-HHMMSS>, the start time)", group="logging")
    # --- profiling -------------------------------------------------------------------------------------
    profile_steps: str | None = _f(None, "A:B: a torch.profiler trace of steps A..B (CPU + CUDA activities, "
                                   "Chrome/Perfetto JSON) in <run_dir>/profile/", group="profiling")
    profile_ranks: str = _f("0", "ranks that write a trace: 0, a comma-separated list, or all", group="profiling")
    memory_snapshot: bool = _f(False, "1: record CUDA memory history and dump a snapshot for PyTorch's memory "
                               "visualizer (<run_dir>/profile/, at the end and on out-of-memory)", group="profiling")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


MODEL_FIELDS = ("vocab_size", "hidden_width", "num_layers", "num_heads", "num_key_value_heads",
                "intermediate_size", "max_context_width", "initializer_range", "rope_theta", "rms_norm_eps",
                "tie_word_embeddings", "rope_scaling", "max_position_embeddings")
ROPE_THETA_BY_TYPE = {"llama_v2": 10000.0, "llama_v3": 500000.0}
