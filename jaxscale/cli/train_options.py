"""The options of `jaxscale train`, one function per group, in the order `--help` lists them.

Each default is TrainConfig's (or CheckpointOptions') own, so the command and the Python
API start from the same run. The command itself (parse -> run -> print) is
jaxscale.cli.commands.train; the options shared with other commands are in
cli/runtime_options.py and cli/cluster_options.py.
"""
from __future__ import annotations

from jaxscale.cli import cluster_options, runtime_options
from jaxscale.cli.calculator_args import preset_summary
from jaxscale.cli.main import COMMANDS, _number
from jaxscale.cli.paths import output_dir
from jaxscale.cli.model_arg import FILE_HELP, model_arg
from jaxscale.model.config import CPU_PRESETS, PRESETS
from jaxscale.model.optim_states import STATE_DTYPES
from jaxscale.model.precision import POLICIES, POLICY_HELP
from jaxscale.model.transformer import REMAT_POLICIES
from jaxscale.parallel.schedules import SCHEDULES
from jaxscale.training.checkpoint.manager import CheckpointOptions
from jaxscale.training.config import LR_SCHEDULES, OPTIMIZERS, TrainConfig
from jaxscale.training.spikes import SPIKE_POLICIES


def add_parser(subparsers):
    """The `train` parser with every option (its handler is set by the command)."""
    d = TrainConfig()
    t = subparsers.add_parser("train", help=COMMANDS["train"], description=(
        "Train a causal transformer on the garden-world corpus and report the validation "
        "loss next to the language's exact entropy floor (the loss no model can beat)."))
    _model_and_optimizer(t, d)
    _data(t, d)
    _output(t)
    _mesh_and_plan(t, d)
    _compute(t, d)
    _checkpoints(t)
    _spikes_and_faults(t, d)
    runtime_options.add_arguments(t)
    cluster_options.add_arguments(t)
    return t


def _model_and_optimizer(t, d) -> None:
    t.add_argument("--model", default=d.model, type=model_arg, metavar="NAME",
                   help=f"model preset: {'; '.join(preset_summary(k) for k in PRESETS)}; "
                        f"{FILE_HELP} (default {d.model}; only "
                        f"{', '.join(CPU_PRESETS)} are sized for a CPU)")
    t.add_argument("--steps", type=_number(), default=d.steps,
                   help=f"training steps (default {d.steps})")
    t.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZERS, metavar="NAME",
                   help=f"one of {', '.join(OPTIMIZERS)} (default {d.optimizer})")
    t.add_argument("--optimizer-state-dtype", default=d.optimizer_state_dtype,
                   choices=list(STATE_DTYPES), metavar="DTYPE",
                   help="the optimizer's moments in fp32 or bf16 (MaxText's mu_dtype; with a "
                        "16-bit precision policy the master weights stay fp32; default "
                        f"{d.optimizer_state_dtype})")
    t.add_argument("--lr", type=_number(float, 0, exclusive=True), default=d.lr,
                   help=f"peak learning rate (default {d.lr:g})")
    t.add_argument("--lr-schedule", default=d.lr_schedule, choices=LR_SCHEDULES,
                   metavar="NAME", help="cosine (warm-up, then decay to 10%%) or constant "
                                        f"(after warm-up); default {d.lr_schedule}")
    t.add_argument("--warmup", type=_number(minimum=0), default=d.warmup,
                   help=f"linear warm-up steps (default {d.warmup})")


def _data(t, d) -> None:
    """The batches, the corpus and its seed, validation and the early stop."""
    t.add_argument("--batch-size", type=_number(), default=d.batch_size,
                   help=f"documents per step (default {d.batch_size})")
    t.add_argument("--train-docs", type=_number(), default=d.n_train_docs, metavar="N",
                   help=f"garden documents drawn for training (default {d.n_train_docs:,}); "
                        "the mid, 1b and 7b presets pack about 45 of them into a row of "
                        "1,024 tokens")
    t.add_argument("--seed", type=_number(minimum=0), default=d.seed,
                   help="seed of the corpus, the initialisation and the batch order "
                        f"(default {d.seed})")
    t.add_argument("--eval-every", type=_number(), default=d.eval_every,
                   help=f"validate every N steps (default {d.eval_every})")
    t.add_argument("--stop-gap", type=_number(float, 0, exclusive=True), default=None,
                   metavar="NATS", help="stop as soon as validation loss is within NATS of "
                                        "the entropy floor")


def _output(t) -> None:
    t.add_argument("--out", type=output_dir, default="runs/train", metavar="DIR",
                   help="output folder for metrics.jsonl, loss_curve.png, result.json "
                        "(default runs/train)")
    t.add_argument("--json", action="store_true",
                   help="print one JSON object with every figure instead of a table")
    t.add_argument("--tensorboard", type=output_dir, default=None, metavar="DIR",
                   help="also write TensorBoard scalars to DIR (loss, gradient norm, "
                        "learning rate, loss scale, tokens/s, validation loss, guard events; "
                        "needs the tensorboard extra: pip install -e \".[tensorboard]\"); "
                        "metrics.jsonl stays the record")


def _mesh_and_plan(t, d) -> None:
    """The devices, the mesh over them, and how the step is split: ZeRO, sequence
    parallelism, micro-batches, the pipeline schedule."""
    t.add_argument("--devices", type=_number(), default=None, metavar="N",
                   help="split the host CPU into N devices (several processes: N in all, "
                        "split evenly over them; default: the platform's own, 1 CPU device or all "
                        "the accelerators)")
    t.add_argument("--mesh", default=None, metavar="SPEC",
                   help="device mesh, e.g. dp=8, dp=2,tp=2,pp=2 or dp=2,cp=2,tp=2 (sizes "
                        "multiply to the device count; cp splits the sequence: ring "
                        "attention, try --model long; default dp=1, or dp over every device of a "
                        "job of several processes)")
    t.add_argument("--zero", type=int, default=d.zero_stage, choices=[0, 1, 2, 3],
                   metavar="STAGE", help="ZeRO stage over the dp axis: 1 shards the optimizer "
                                         "state, 2 also the gradients, 3 also the parameters "
                                         "(gathered per layer when needed)")
    t.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism (needs tp >= 2): the tp group also "
                        "splits the sequence between its all-reduces, which become a "
                        "reduce-scatter and an all-gather")
    t.add_argument("--micro-batches", type=_number(), default=None, metavar="M",
                   help="gradient accumulation: split each batch into M micro-batches, reduce "
                        "gradients once per step (default 1; with --resume on another mesh, "
                        "as many as keep the checkpoint's rows per micro-batch)")
    t.add_argument("--schedule", default=d.schedule, choices=list(SCHEDULES), metavar="NAME",
                   help="pipeline schedule over pp: gpipe (all forwards, then all backwards), "
                        "1f1b (one forward, one backward: at most pp micro-batches in flight), "
                        "interleaved (--virtual chunks of layers per device), and the zero-"
                        "bubble zb-h1, zb-h2 and zbv (each backward split into input and weight "
                        "gradients, the weights' moved into the gaps; zbv: two chunks per "
                        f"device in a V); default {d.schedule}")
    t.add_argument("--virtual", type=_number(), default=None, metavar="V",
                   help="model chunks per pipeline device for --schedule interleaved, or 2 "
                        "for zbv "
                        "(default 2 there, 1 otherwise)")


def _compute(t, d) -> None:
    """What the step recomputes, and in which number formats."""
    t.add_argument("--remat", default=d.remat, choices=list(REMAT_POLICIES), metavar="POLICY",
                   help="activation recomputation: none; full (keep each block's input, "
                        "recompute the block in backward); matmuls (keep matmul outputs); "
                        "selective (recompute only the attention core)")
    t.add_argument("--precision", default=d.precision, choices=list(POLICIES), metavar="POLICY",
                   help="number formats: " + "; ".join(f"{k}: {v}" for k, v in POLICY_HELP.items()))
    t.add_argument("--fp8-block", type=_number(), default=d.fp8_block, metavar="N",
                   help="with --precision fp8-block: the tile length (activations and "
                        "gradients 1 x N, weights N x N); every tiled dimension must be a "
                        f"multiple of it or shorter (default {d.fp8_block})")
    t.add_argument("--fp8-head", action="store_true",
                   help="with an fp8 precision: the output head multiplies in FP8 too "
                        "(default: bf16, as most recipes keep it)")
    t.add_argument("--fp8-history", type=_number(), default=d.fp8_history, metavar="N",
                   help="with --precision fp8-delayed: how many steps of amaxes each "
                        "tensor's scale is taken from (the largest of them; training "
                        f"state, checkpointed; default {d.fp8_history})")


def _checkpoints(t) -> None:
    c = t.add_argument_group("checkpoints", "save the whole training state (Orbax, in a "
                             "plan-independent form) and resume it, under any plan")
    c.add_argument("--checkpoint-dir", type=output_dir, default=None, metavar="DIR",
                   help="directory of the run's checkpoints, one sub-directory per step")
    c.add_argument("--checkpoint-every", type=_number(), default=None, metavar="N",
                   help="save every N steps and at the last step (needs --checkpoint-dir)")
    c.add_argument("--keep", type=_number(), default=None, metavar="K",
                   help="complete checkpoints to keep, the oldest deleted first (default "
                        f"{CheckpointOptions.keep})")
    c.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background: training waits only for the "
                        "copy to host memory")
    c.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in --checkpoint-dir; "
                        "--mesh, --zero, --devices, --micro-batches, --schedule may differ "
                        "from the run that saved it (the state is resharded)")
    c.add_argument("--accept-lr-change", action="store_true",
                   help="resume although --lr differs from the checkpoint's (the new "
                        "learning rate applies from here on)")
    c.add_argument("--halt-after", type=_number(), default=None, metavar="N",
                   help="stop after step N as if interrupted, keeping the schedule of all "
                        "--steps (save with --checkpoint-every; continue with --resume)")


def _spikes_and_faults(t, d) -> None:
    g = t.add_argument_group("spikes and faults", "catch loss spikes as they happen (a "
                             "rolling z-score of the loss and the gradient norm) and provoke "
                             "them, or crashes, on purpose")
    g.add_argument("--spike-policy", default=d.spike_policy, choices=SPIKE_POLICIES,
                   metavar="POLICY", help="what a spike does: skip (drop the update), "
                   "rollback (restore the last checkpoint, skip the batches since, lower the "
                   "learning rate), stop; none: no guard (default). With any guard a "
                   "non-finite loss or gradient is skipped")
    g.add_argument("--spike-z", type=_number(float, 0, exclusive=True), default=d.spike_z,
                   metavar="K", help="a spike is a loss or gradient norm above the mean + K "
                   f"standard deviations of the window (default {d.spike_z:g})")
    g.add_argument("--spike-window", type=_number(minimum=2), default=d.spike_window,
                   metavar="W", help="accepted steps in the rolling statistics; no decision "
                   f"before W steps (default {d.spike_window})")
    g.add_argument("--rollback-lr-factor", type=_number(float, 0, exclusive=True),
                   default=d.rollback_lr_factor, metavar="F",
                   help=f"each rollback multiplies the learning rate by F (default "
                        f"{d.rollback_lr_factor:g})")
    g.add_argument("--inject", action="append", default=[], metavar="FAULT",
                   help="inject a fault, once per run (repeat the flag for several): "
                        "nan@STEP (NaN gradients), spike@STEP[:random|repeat|ngram] (a garbage "
                        "batch), lr@STEP:FACTOR (the learning rate jumps from STEP on), "
                        "crash@STEP (the process kills itself with SIGKILL)")
    g.add_argument("--max-restarts", type=_number(minimum=0), default=None, metavar="R",
                   help="run training in a child process and restart it from its latest "
                        "checkpoint when it dies, at most R times (needs --checkpoint-dir "
                        "and --checkpoint-every)")
