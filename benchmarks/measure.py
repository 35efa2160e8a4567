"""How the benchmarks measure: time per call, the card's copy and matmul rates, and XLA
compilations. Every benchmark that times calls or quotes a rate takes it from here, so that two
numbers called the same are measured the same way.

jax (and paxengine) are imported inside the functions: a process that times torch calls with
`time_per_call` must not load JAX next to vLLM.
"""

from __future__ import annotations

import statistics
import time


def _block(out):
    import jax

    return jax.block_until_ready(out)


def time_per_call(run, calls: int, reps: int = 5, sync=_block, reduce=statistics.median) -> float:
    """Seconds per call: `reps` times, run() (which makes `calls` calls and returns what to wait
    for) and then sync(that); `reduce` over the reps: the median, or min for a rate's best case
    (a rate is a ceiling; anything slower than the best rep is interference)."""
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        sync(run())
        ts.append((time.perf_counter() - t) / calls)
    return float(reduce(ts))


def time_loop(f, args, reps: int, iters: int, per_sync: int = 1) -> float:
    """Seconds per call of f(*args), a compiled loop (or unrolled sequence) of `iters` calls:
    median over `reps` synchronisations of `per_sync` dispatches of f."""

    def run():
        for _ in range(per_sync):
            out = f(*args)
        return out

    return time_per_call(run, iters * per_sync, reps)


def chained_calls(one, iters: int, keep_last: bool = True):
    """One jit: `iters` chained calls of one(q, *rest). q carries a zero-valued dependency on each
    call's output, so XLA can neither hoist the calls out of the loop nor run them as one.
    Returns the last output (keep_last: its shape and dtype must be q's, it is the loop's carry),
    else the sum of every output's first element (any output shape)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def many(q, *rest):
        def body(i, c):
            q, acc = c
            o = one(q, *rest)
            q = q.at[0, 0, 0].add((o[0, 0, 0] * 0).astype(q.dtype))
            return q, (o if keep_last else acc + o[0, 0, 0].astype(jnp.float32))

        init = jnp.zeros_like(q) if keep_last else jnp.float32(0)
        return jax.lax.fori_loop(0, iters, body, (q, init))[1]

    return many


def device_dtype():
    """bf16 on a GPU (the engine's dtype there), f32 elsewhere (CPUs are slow at bf16)."""
    import jax
    import jax.numpy as jnp

    return jnp.bfloat16 if jax.devices()[0].platform == "gpu" else jnp.float32


def copy_rate(mib: float, iters: int = 20, reps: int = 3, dtype=None) -> tuple[float, int]:
    """(bytes per second, bytes per pass): an elementwise pass over `mib` MiB of random data,
    chained `iters` times between syncs (one live buffer, each pass reads and writes all of it),
    best of `reps`. dtype: device_dtype() unless given."""
    import jax
    import jax.numpy as jnp

    dt = dtype or device_dtype()
    n = int(mib * 2**20) // jnp.dtype(dt).itemsize
    key = jax.random.PRNGKey(0)
    xs = [jax.random.normal(jax.random.fold_in(key, k), (n,), dt) for k in range(2)]
    f = jax.jit(lambda x: x * 1.0001 + 0.5)
    for x in xs:
        f(x).block_until_ready()
    rep = iter(range(reps))

    def run():
        y = xs[next(rep) % 2]  # a fresh input each rep, not the last rep's output
        for _ in range(iters):
            y = f(y)
        return y

    nbytes = 2 * n * jnp.dtype(dt).itemsize
    return nbytes / time_per_call(run, iters, reps, reduce=min), nbytes


def matmul_rate(
    m: int, k: int | None = None, n: int | None = None, iters: int = 20, reps: int = 3, dtype=None
) -> float:
    """FLOP/s of an (m, k) x (k, n) matmul (square m^3 by default) on random data, `iters` calls
    between syncs, best of `reps`. dtype: device_dtype() unless given; the product is kept in it."""
    import jax
    import jax.numpy as jnp

    k, n = k or m, n or m
    dt = dtype or device_dtype()
    key = jax.random.PRNGKey(0)
    # two left operands taken in turn: no two consecutive calls are the same computation
    a = [jax.random.normal(jax.random.fold_in(key, 10 + j), (m, k), dt) for j in range(2)]
    b = jax.random.normal(jax.random.fold_in(key, 20), (k, n), dt)
    g = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=dt))
    g(a[0], b).block_until_ready()

    def run():
        return [g(a[j % 2], b) for j in range(iters)][-1]

    return 2 * m * k * n / time_per_call(run, iters, reps, reduce=min)


class CompileCounter:
    """XLA compilations in this process since this counter was made: paxengine.step_build's count
    (every backend compile, the engine's and any other jit's; persistent-cache hits are not
    compiles), so a benchmark's "compiles during timed runs" is the number the engine's
    `xla_compiles_after_warmup` metric reports."""

    def __init__(self):
        from paxengine.step_build import compile_count

        self._count = compile_count
        self._start = compile_count()

    @property
    def n(self) -> int:
        return self._count() - self._start
