"""Saving and restoring a run: when to save, the file formats, safe loading, checkpoint
names, the search for the run resume=auto continues, the run lock and atomic writes.
May import config, console, summary, distributed and telemetry's sinks; never loop/ or knobs/."""
