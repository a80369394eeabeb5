"""One training job: setup, the schedule, the step, evaluation, what stops a run, the
optimizer and its schedule, and the automatic batch size.
May import knobs, models, data, checkpoint and telemetry (tests/test_house.py MAY_IMPORT); never commands/."""
