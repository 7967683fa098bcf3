"""The published figures the cost model is checked against, as printed, with their sources.

One place for them: tests/costmodel/test_papers.py and tests/costmodel/test_planner.py assert against them,
experiments/cost_model.py prints them next to ours. Strings keep the paper's rounding.

  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
      (arXiv 2205.05198): Table 3 (configurations; s = 2048, V = 51200, A100 80 GB),
      Table 5 (iteration seconds and MFU with sequence parallelism + selective recompute).
  Rajbhandari et al. 2020, "ZeRO" (arXiv 1910.02054): Table 1 cells printed in its text,
      Table 2 (largest model by memory analysis, 32 GB V100s, N_d = 64).
  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
      Using Megatron-LM" (arXiv 2104.04473): Table 1 (s = 2048, V = 51200, A100s).
"""
from __future__ import annotations

from jaxscale.costmodel.shape import Transformer

# name: heads, hidden, layers, tp, pp, GPUs, global batch, micro-batch
KORTHIKANTI_TABLE3 = {
    "22B": (64, 6144, 48, 8, 1, 8, 4, 4),
    "175B": (96, 12288, 96, 8, 8, 64, 64, 1),
    "530B": (128, 20480, 105, 8, 35, 280, 280, 1),
    "1T": (160, 25600, 128, 8, 64, 512, 512, 1),
}
KORTHIKANTI_INTERLEAVED = {"175B": 3, "530B": 3}  # interleaving stages; none for 22B and 1T
# name: (seconds per iteration, MFU) with sequence parallelism and selective recompute
KORTHIKANTI_TABLE5 = {"22B": (1.10, 0.415), "175B": (13.75, 0.514), "530B": (37.83, 0.560),
                      "1T": (71.49, 0.563)}

# (psi, N_d, ZeRO stage) -> GB per device, the cells its text prints
ZERO_TABLE1 = {(7.5e9, 1, 0): "120", (7.5e9, 64, 1): "31.4", (7.5e9, 64, 2): "16.6",
               (7.5e9, 64, 3): "1.9", (7.5e9, 4, 3): "30", (7.5e9, 16, 2): "21.6",
               (128e9, 64, 3): "32", (1e12, 1024, 3): "15.6"}
# (MP, GPUs) -> largest model in billions: baseline, P_os, P_os+g, P_os+g+p
ZERO_TABLE2 = {(1, 64): ("2", "7.6", "14.4", "128"), (2, 128): ("4", "15.2", "28.8", "256"),
               (4, 256): ("8", "30.4", "57.6", "500"), (8, 512): ("16", "60.8", "115.2", "1000"),
               (16, 1024): ("32", "121.6", "230.4", "2000")}

# params (B), heads, hidden, layers, tp, pp, GPUs, batch, achieved TFLOP/s per GPU
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def korthikanti_shape(name: str) -> Transformer:
    a, h, L, *_ = KORTHIKANTI_TABLE3[name]
    return Transformer(L, h, a, 2048, vocab=51200)


def narayanan_shape(row: tuple) -> Transformer:
    _, a, h, L, *_ = row
    return Transformer(L, h, a, 2048, vocab=51200)


def rounds_to(ours: float, printed: str) -> bool:
    """ours, rounded to as many decimals as `printed` shows, equals it."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return round(ours, decimals) == float(printed)
