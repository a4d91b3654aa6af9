"""The RL recipe: pure functions on tensors."""
