"""Where the engine computes: the array backend (`xp`: NumPy, or CuPy on a GPU), the engine's
CPU threads and the C allocator's settings, phase timing, atomic file writes, processes and the
user's data folders.

Owns nothing about models or training. May import: numpy/cupy, threadpoolctl, platformdirs,
the standard library and `app.engine.errors`; nothing else of the engine.
"""
