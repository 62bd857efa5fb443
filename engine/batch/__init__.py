"""Continuous batching for the embedded engine (paper 2.2, 4.4).

* :mod:`.scheduler`  ``BatchDecoder``: requests join and leave between steps, one weight stream per step
* :mod:`.requests`   ``Request``: prompt, stop conditions, progress, timings
* :mod:`.rules`      shared or equal node budget, per-request drafter block, prompt admission
* :mod:`.drafting`   one lattice per request per step (ngram, self, model drafters)
* :mod:`.step`       the rows of a step (verify trees, prompt chunks) as one batched input
* :mod:`.cache`      per-request cache slots (K/V, GDN states)
* :mod:`.graphs`     CUDA graphs per (requests, rows) bucket
"""
