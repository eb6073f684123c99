"""Models built on jax_ub's Flax layers, used by the examples, the tests and the benchmarks.

* :mod:`jax_ub.models.llama`: a Llama-style decoder (gated MLP, grouped-query attention with
  rotary embeddings, layers under ``nnx.scan``, a key/value cache for decoding), tensor- and
  sequence-parallel over ``tp``, data-parallel over ``dp``.
"""
