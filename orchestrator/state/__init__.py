"""Run state and files: the run config, the rollout buffer, checkpoint files, progress lines,
metric sinks and telemetry setup. Below the controller; imports only the actor runtime."""
