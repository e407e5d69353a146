"""The rate of a large jit bf16 matrix product on the first device, on random data (median of 20)."""

import statistics
import sys
import time

import jax
import jax.numpy as jnp

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in range(2))
f = jax.jit(lambda x, y: x @ y)
f(a, b).block_until_ready()
times = []
for _ in range(20):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t)
rate = 2 * n**3 / statistics.median(times) / 1e12
print(f"{jax.devices()[0].device_kind}: jit matmul {n}^3 bfloat16 {rate:.1f} TFLOP/s")
