"""``python -m jax_ub.bench``."""

from jax_ub.bench.cli import main

main()
