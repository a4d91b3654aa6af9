"""Flotilla's controller and actor runtime."""
