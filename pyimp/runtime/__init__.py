"""What a process running pyimp needs around the engine.

- ``warmup``: a first run's compiling and the Numba cache checks.
- ``parallel_compile``, ``compile_helper``: compiling in a helper process while the engine
  loads.
- ``process``: the process-wide settings pyimp's own programs apply.
- ``memory``: what a configuration needs and what the machine has.
- ``default_model``: the embedded Gemma 3 270M model.
"""
