"""Trainer, sampler and environment actors."""
