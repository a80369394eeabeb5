"""perfrun tune's library: its configuration (the trainer's with tune's keys) and the
greedy search over batch size, checkpointing, compile and workers.
May import config, console and report; never loop/ or commands/."""
