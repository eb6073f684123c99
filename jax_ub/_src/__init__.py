"""jax_ub internals, by layer: ``ops`` -> ``lowering`` -> ``runtime``; ``settings`` and
``jax_compat`` (every private JAX use) are read by all of them."""
