"""Drop-in use of allscan in models people already have.

- :mod:`allscan.integrations.transformers`: Ulysses attention (allscan's chunked all-to-all + SDPA) as a
  Hugging Face transformers attention implementation, and the helpers to shard a batch along the
  sequence and to get the single-process loss back.
- :mod:`allscan.integrations.fla`: flash-linear-attention's models with their GLA and Gated DeltaNet
  layers swapped for allscan's sequence-parallel ones (same Parameter objects).
- :mod:`allscan.integrations.batch`: what every sequence-parallel model needs around its layers (a
  batch cut along the sequence, the whole batch's loss and gradients); both re-export it.

Each submodule imports its library lazily and raises ImportError naming what to install.
"""
