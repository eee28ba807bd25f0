"""A JaxTrainer run (JAX's multi-process runtime on CPUs, as Ray sets it up with JAX_PLATFORMS=cpu), run
unchanged by Ray 2.60 and by `outlast run`: python jax_example.py STORAGE_DIR"""
import sys

import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.v2.jax import JaxConfig, JaxTrainer


def train_func():
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = np.random.default_rng(jax.process_index()).normal(size=(64, 8))
    y = x @ np.arange(8.0)
    grad = jax.jit(jax.grad(lambda w: jnp.mean((x @ w - y) ** 2)))
    w = jnp.zeros(8)
    for _ in range(50):
        w = w - 0.05 * grad(w)
    ray.train.report({"process_count": jax.process_count(), "steps": 50})


result = JaxTrainer(train_func, jax_config=JaxConfig(use_gpu=True), scaling_config=ScalingConfig(num_workers=2),
                    run_config=RunConfig(name="jax", storage_path=sys.argv[1],
                                         worker_runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu"}})).fit()
print("ok")
