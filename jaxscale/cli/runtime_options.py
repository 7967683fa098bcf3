"""Options shared by the commands that run the model: where (--platform), with which
attention kernel (--attention), the layers scanned or unrolled (--unroll), and a profile of
the steps (--profile). One definition, so train, bench and compare mean the same thing."""
from __future__ import annotations

from jaxscale.cli.main import UsageError
from jaxscale.cli.paths import output_dir
from jaxscale.runtime.devices import PLATFORMS
from jaxscale.model.attention import KERNELS, KernelError, check_kernel

ATTENTION_CHOICES = ("auto", *KERNELS)


def add_arguments(parser, platform: bool = True) -> None:
    if platform:
        parser.add_argument("--platform", default="auto", choices=PLATFORMS, metavar="NAME",
                            help=f"{', '.join(PLATFORMS)} (default auto: the accelerators if "
                                 "JAX has any, else the CPU)")
    parser.add_argument("--attention", default="auto", choices=ATTENTION_CHOICES,
                        metavar="KERNEL",
                        help="einsum (written out: the reference), xla or cudnn "
                             "(jax.nn.dot_product_attention; cudnn is flash attention on "
                             "NVIDIA GPUs in bf16/fp16), tpu-flash (Pallas's flash attention "
                             "on TPUs, sequences of a multiple of 128); default auto: cudnn "
                             "on a GPU with a 16-bit precision, else einsum")
    parser.add_argument("--unroll", action="store_true",
                        help="write the layers out one after another instead of one scanned "
                             "loop body (longer compile; XLA may fuse across layers)")
    add_profile_argument(parser)


def add_profile_argument(parser) -> None:
    parser.add_argument("--profile", type=output_dir, default=None, metavar="DIR",
                        help="write a jax.profiler trace of the steps (compile excluded) to "
                             "DIR: open it with `tensorboard --logdir DIR` (profile plugin) "
                             "or drop its perfetto_trace.json.gz on https://ui.perfetto.dev")


def resolve_attention(choice: str, platform: str, precision: str) -> str:
    """The kernel `--attention choice` means on `platform` (cpu, gpu, tpu) under a precision
    policy: auto takes cuDNN's flash attention where it runs (a GPU, 16-bit compute), and
    the einsum reference elsewhere (on CPU and TPU XLA lowers both to the same einsums)."""
    from jaxscale.model import precision as precisionlib
    if choice not in ATTENTION_CHOICES:
        raise UsageError(f"unknown attention kernel {choice!r}; choose from "
                         f"{', '.join(ATTENTION_CHOICES)}")
    compute = precisionlib.policy(precision).compute_dtype
    if choice == "auto":
        return "cudnn" if platform == "gpu" and compute.itemsize == 2 else "einsum"
    try:
        check_kernel(choice, platform, compute)
    except KernelError as e:
        raise UsageError(f"--attention {choice}: {e}") from None
    return choice
