"""Pipeline healing: the supervisor that starts, rebuilds and re-places the stages, and its rules."""
