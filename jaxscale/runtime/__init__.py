"""Where programs run: forced CPU devices and meshes, processes (jax.distributed), profiling.

The bottom layer: it imports nothing else of jaxscale.
"""
