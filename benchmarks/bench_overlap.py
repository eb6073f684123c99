"""Overlap benchmark entry point; see jax_ub/bench/ (same as `python -m jax_ub.bench`)."""

from jax_ub.bench import main

if __name__ == "__main__":
    main()
