"""Structured outputs: limits on constraints (limits.py), compilation in a supervised process
(supervisor.py) behind a cache and a service thread (service.py), and the driver's matchers and
bitmasks (matchers.py)."""
