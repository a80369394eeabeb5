"""One training job: setup, the schedule, the step, evaluation, what stops a run, the
optimizer and its schedule, and the automatic batch size.
May import every library package (knobs, models, data, checkpoint, telemetry); never commands/."""
