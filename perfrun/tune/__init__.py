"""perfrun tune's library: its configuration (the trainer's with tune's keys), the search
space, the greedy search over batch size, checkpointing, compile and workers, the trials (short
runs of the trainer) and their table."""
