"""Adapters that put sequence-parallel attention into other libraries' models."""
