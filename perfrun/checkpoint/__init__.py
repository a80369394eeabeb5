"""Saving and restoring a run: when to save, the file formats, safe loading, checkpoint
names, the search for the run resume=auto continues, the run lock and atomic writes.
Saves Stateful parts; imports only perfrun's root modules (never loop/, knobs/ or telemetry/)."""
