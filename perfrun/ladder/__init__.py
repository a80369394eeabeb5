"""The ladder: a sweep of rungs, each a knob on top of the last, measured and compared."""
