import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402

from kernels_pallas import attention_mgpu  # noqa: E402

if attention_mgpu.available():
    # GPU interpret mode runs each warpgroup of a CTA as its own CPU computation, and a barrier
    # wait blocks a host-callback thread: with only as many threads as a 2-core machine has, two
    # waiting warpgroups starve the third and the kernel deadlocks. More CPU devices, more threads.
    jax.config.update("jax_num_cpu_devices", 8)
