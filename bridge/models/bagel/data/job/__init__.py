"""The main job's building blocks: batch contract checks, telemetry, job config and checkpoints."""
