"""The commands a user types, each a thin module over the library: dispatch, train's
launch on several ranks, tune, generate, export, quantize, report and gpu-check.
May import everything; nothing in the library imports commands/."""
