"""The embedded reference engine: a small gpt-fast-style decoder with AR, chain and tree decoding.

Start at :mod:`specpilot.engine.api` (``EngineSpec``, ``load_engine``).
"""
