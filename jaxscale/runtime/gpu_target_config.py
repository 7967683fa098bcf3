"""What XLA:GPU needs to know of an NVIDIA GPU to compile for it without one: a
GpuTargetConfigProto, written here as text from the device's facts.

The CUDA plugin (`pip install -e ".[gpu]"`: jax-cuda12-plugin and the nvcc wheel, whose
ptxas turns PTX into machine code) compiles for a GPU that is not there when it is given
the device's description: how many streaming multiprocessors, how much shared memory and
how many registers each has, the memory size and bandwidth, the compute capability. The
numbers below are the ones XLA's own target specs give for these devices
(openxla/xla, xla/backends/gpu/target_config/specs/h100_sxm.txtpb and h200.txtpb,
Apache-2.0); the two differ only in memory and its bandwidth. Only the fields jax 0.10.2's
plugin reads are written (newer spec files carry fields it does not know).
"""
from __future__ import annotations

# one Hopper streaming multiprocessor, and the limits of a launch
HOPPER = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
          "shared_memory_per_block": 49152, "shared_memory_per_core": 233472,
          "threads_per_core_limit": 2048, "core_count": 132, "fpus_per_core": 128,
          "block_dim_limit_x": 2147483647, "block_dim_limit_y": 65535,
          "block_dim_limit_z": 65535, "l2_cache_size": 52428800, "clock_rate_ghz": 1.98,
          "shared_memory_per_block_optin": 232448, "registers_per_core_limit": 65536,
          "registers_per_block_limit": 65536}

GPUS = {
    "h100": {"name": "NVIDIA H100 80GB HBM3", "device_memory_size": 84942979072,
             "memory_bandwidth": 3352320000000, **HOPPER},
    "h200": {"name": "NVIDIA H200 141GB HBM3e", "device_memory_size": 151397597184,
             "memory_bandwidth": 4800000000000, **HOPPER},
}
CUDNN = (9, 10, 0)  # the cuDNN version the program is compiled against (its fused attention)


def target_config(gpu: str) -> str:
    """The GpuTargetConfigProto text for one of GPUS."""
    facts = {k: v for k, v in GPUS[gpu].items() if k != "name"}
    major, minor, patch = CUDNN
    return "\n".join(
        ["gpu_device_info {", *(f"  {k}: {v}" for k, v in facts.items()),
         "  cuda_compute_capability { major: 9 minor: 0 }",
         '  device_vendor: "NVIDIA Corporation"', "}", 'platform_name: "CUDA"',
         f"dnn_version_info {{ major: {major} minor: {minor} patch: {patch} }}",
         f'device_description_str: "{GPUS[gpu]["name"]}"']) + "\n"
