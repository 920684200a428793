"""Functional Flax models and weight loaders."""
