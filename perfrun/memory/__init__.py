"""Memory: what a configuration will need before it runs (an estimate under fake tensors),
what fits a memory size, the largest batch that fits (estimates, then trials), and the
breakdown of a real step by category and module (torch's memory tracker)."""
