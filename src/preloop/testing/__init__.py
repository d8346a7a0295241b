"""Helpers shared by preloop's tests and benchmarks (generated trees, PostgreSQL schemas).

They ship with the package so `tests/` and `bench/` use one implementation.
"""
