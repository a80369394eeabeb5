"""perfrun tune's library: its configuration (the trainer's with tune's keys) and the
greedy search over batch size, checkpointing, compile and workers.
Imports only perfrun's root modules (config, console); the command runs the trials."""
