"""Structured outputs: limits on constraints (limits.py), compilation in a supervised process
(compiler.py) behind a cache and a service thread (service.py), and the driver's matchers and
bitmasks (matchers.py)."""
