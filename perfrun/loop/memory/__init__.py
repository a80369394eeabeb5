"""Memory: the estimate of a configuration before it runs, and what would make it fit."""
