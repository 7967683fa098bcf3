"""jaxscale: how large language models are trained across many accelerators, in JAX.

The same code runs on N forced host-CPU devices on a laptop and unchanged on GPU/TPU meshes.
Modules: devices (meshes), garden (corpus with an exact entropy floor), model (the one
transformer), train (single-device reference training), cli (the `jaxscale` command).
"""

__version__ = "0.1.0"
