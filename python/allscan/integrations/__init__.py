"""Drop-in use of allscan in models people already have.

- :mod:`allscan.integrations.transformers`: Ulysses attention (allscan's chunked all-to-all + SDPA) as a
  Hugging Face transformers attention implementation, and the helpers to shard a batch along the
  sequence and to get the single-process loss back.

Each submodule imports its library lazily and raises ImportError naming what to install.
"""
